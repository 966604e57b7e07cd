// Model output -> safe HTML: markdown (marked), then the sanitizer (DOMPurify), then code highlighting
// (highlight.js, on text only). Model output is untrusted: whatever it writes (<script>, <img onerror>,
// javascript: links, <style>, forms) must come out inert. DOMPurify removes scripts, event handlers and
// script URLs; the page's Content-Security-Policy (routes/web.py) would block what it missed.
import { Marked } from "./vendor/marked/marked.esm.js";
import DOMPurify from "./vendor/dompurify/purify.es.mjs";
import hljs from "./vendor/highlight/core.min.js";
import bash from "./vendor/highlight/languages/bash.min.js";
import c from "./vendor/highlight/languages/c.min.js";
import cpp from "./vendor/highlight/languages/cpp.min.js";
import diff from "./vendor/highlight/languages/diff.min.js";
import go from "./vendor/highlight/languages/go.min.js";
import java from "./vendor/highlight/languages/java.min.js";
import javascript from "./vendor/highlight/languages/javascript.min.js";
import json from "./vendor/highlight/languages/json.min.js";
import markdown from "./vendor/highlight/languages/markdown.min.js";
import python from "./vendor/highlight/languages/python.min.js";
import rust from "./vendor/highlight/languages/rust.min.js";
import shell from "./vendor/highlight/languages/shell.min.js";
import typescript from "./vendor/highlight/languages/typescript.min.js";
import xml from "./vendor/highlight/languages/xml.min.js";
import yaml from "./vendor/highlight/languages/yaml.min.js";

const LANGUAGES = { bash, c, cpp, diff, go, java, javascript, json, markdown, python, rust, shell, typescript,
                    xml, yaml };
for (const [name, language] of Object.entries(LANGUAGES)) hljs.registerLanguage(name, language);
hljs.configure({ ignoreUnescapedHTML: true });

const marked = new Marked({ gfm: true, breaks: false });

// links open in a new tab without giving it this page (window.opener) or the referrer
DOMPurify.addHook("afterSanitizeAttributes", (node) => {
  if (node.tagName === "A" && node.hasAttribute("href")) {
    node.setAttribute("target", "_blank");
    node.setAttribute("rel", "noopener noreferrer nofollow");
  }
});

const PURIFY = {
  USE_PROFILES: { html: true },          // HTML only: no SVG or MathML, where sanitizers have had holes
  FORBID_TAGS: ["style", "form", "input", "button", "textarea", "select"],
  FORBID_ATTR: ["style"],
};

/** `el`'s children become the markdown `text` rendered, sanitized and highlighted. */
export function renderMarkdown(el, text) {
  const html = DOMPurify.sanitize(marked.parse(text), PURIFY);
  el.innerHTML = html;
  for (const code of el.querySelectorAll("pre code")) {
    const lang = /\blanguage-([\w+-]+)/.exec(code.className)?.[1];
    if (lang && hljs.getLanguage(lang)) hljs.highlightElement(code);   // on its text: the HTML stays inert
  }
}
