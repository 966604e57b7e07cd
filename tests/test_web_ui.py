"""The chat page (`GET /`, src/gem4/server/web, docs/web.md) in a real browser: Playwright drives Debian's
Chromium against one `gem4 serve --demo --api-key KEY` subprocess for the whole module.

The demo model is random, so what the page shows is checked against the API's answer to the same request
on the same server (greedy, or seeded): the page must show exactly what the server sent. Its thinking is
made to happen by a chat template that opens the thought channel at the start of the reply when
enable_thinking is on (as a model that always thinks does) and a logit bias on <channel|>, which ends it.

Chromium is required: without /usr/bin/chromium (or $GEM4_CHROMIUM) these tests fail, saying how to
install it; GEM4_SKIP_BROWSER_TESTS=1 skips them on a machine that has none (never in CI: .ci/run
installs it). Screenshots and the page's measured first paint go to $GEM4_TEST_OUTPUT/web (default:
test-output/web in the checkout).
"""
from __future__ import annotations

import http.server
import json
import os
import re
import shutil
import statistics
import threading
import time
from pathlib import Path

import httpx
import pytest

from gem4.server import ServerConfig, create_app
from gem4.server.routes.web import CONTENT_SECURITY_POLICY, WEB_DIR
from server_helpers import API_KEY, HOST, InProcessServer, client_for, gem4_serve_process, metric, wait_for

REPO = Path(__file__).resolve().parents[1]
OUTPUT = Path(os.environ.get("GEM4_TEST_OUTPUT", REPO / "test-output")) / "web"
CHROMIUM = os.environ.get("GEM4_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
CHANNEL_END = 101            # <channel|>, at its real id in the demo vocabulary
DESKTOP = {"width": 1280, "height": 800}
PHONE = {"width": 390, "height": 844}


# ---------------------------------------------------------------------------------------------
# Without a browser: the route, the headers, --no-web-ui
# ---------------------------------------------------------------------------------------------


def test_the_page_is_public_with_a_csp_and_off_with_no_web_ui():
    with InProcessServer(create_app(ServerConfig(served_model_name="m", api_key=API_KEY))) as base:
        page = httpx.get(base + "/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert page.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
        assert "script-src 'self';" in CONTENT_SECURITY_POLICY and "unsafe" not in CONTENT_SECURITY_POLICY
        assert "<script>" not in page.text                    # no inline script: the policy would block it
        for src in re.findall(r'(?:src|href)="(web/[^"]+)"', page.text):
            r = httpx.get(f"{base}/{src}")
            assert r.status_code == 200, src
        js = httpx.get(base + "/web/vendor/dompurify/purify.es.mjs")
        assert js.headers["content-type"].startswith("text/javascript")     # a module needs a JavaScript type
        assert httpx.head(base + "/").status_code == 200
        for path in ("/web/nothing.js", "/web/../routes/web.py", "/web/%2e%2e/app.py"):
            assert httpx.get(base + path).status_code == 404, path
        assert httpx.get(base + "/v1/models").status_code == 401       # the API still needs the key
    with InProcessServer(create_app(ServerConfig(served_model_name="m", web_ui=False))) as base:
        assert httpx.get(base + "/").status_code == 404
        assert httpx.get(base + "/web/app.js").status_code == 404


def test_no_web_ui_flag():
    from gem4.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["serve", "--demo"]).web_ui is True
    assert parser.parse_args(["serve", "--demo", "--no-web-ui"]).web_ui is False


# ---------------------------------------------------------------------------------------------
# The browser, the server, the page
# ---------------------------------------------------------------------------------------------


def thinking_template() -> str:
    """The official template, but a reply with enable_thinking starts inside the thought channel."""
    text = (REPO / "src" / "gem4" / "templates" / "google-gemma-4-31B-it.jinja").read_text(encoding="utf-8")
    closed = ("        {%- if not enable_thinking | default(false) -%}\n"
              "            {{- '<|channel>thought\\n<channel|>' -}}\n"
              "        {%- endif -%}")
    assert text.count(closed) == 1
    return text.replace(closed, "        {%- if enable_thinking | default(false) -%}\n"
                                "            {{- '<|channel>thought\\n' -}}\n"
                                "        {%- else -%}\n"
                                "            {{- '<|channel>thought\\n<channel|>' -}}\n"
                                "        {%- endif -%}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(URL, log file) of `gem4 serve --demo --api-key KEY` with the thinking template."""
    d = tmp_path_factory.mktemp("web")
    template = d / "thinking.jinja"
    template.write_text(thinking_template(), encoding="utf-8")
    log = d / "stderr.txt"
    # the default cache: the demo and the compiled kernels are built there once
    with gem4_serve_process(["--demo", "--api-key", API_KEY, "--chat-template", str(template)], log) as (url, _):
        yield url


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).is_file():
        if os.environ.get("GEM4_SKIP_BROWSER_TESTS") == "1":
            pytest.skip(f"GEM4_SKIP_BROWSER_TESTS=1 and no Chromium at {CHROMIUM}")
        pytest.fail(f"the browser tests need Chromium at {CHROMIUM} (apt-get install chromium; or set GEM4_CHROMIUM "
                    f"to another one); GEM4_SKIP_BROWSER_TESTS=1 skips them on a machine without it", pytrace=False)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


class Page:
    """A page of the chat in a fresh browser context (its own localStorage, the API key in it unless `key` is
    None), with its console errors, uncaught exceptions, CSP violations and requests recorded."""

    def __init__(self, browser, url: str, *, key: str | None = API_KEY, viewport=DESKTOP, color_scheme="light"):
        self.url = url
        self.context = browser.new_context(viewport=viewport, color_scheme=color_scheme, accept_downloads=True)
        self.errors: list[str] = []
        self.requests: list = []
        self.context.add_init_script(
            "window.__csp = []; document.addEventListener('securitypolicyviolation', "
            "(e) => window.__csp.push(e.violatedDirective + ' ' + e.blockedURI));")
        self.page = self.context.new_page()
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(f"{m.text} ({m.location.get('url')})"))
        self.page.on("pageerror", lambda e: self.errors.append(f"uncaught: {e}"))
        self.page.on("request", lambda r: self.requests.append(r))
        if key is not None:         # as the key dialog leaves it (test_with_an_api_key_... fills the dialog)
            self.context.add_init_script(f"localStorage.getItem('gem4.apiKey') ?? localStorage.setItem('gem4.apiKey', "
                                         f"{json.dumps(key)})")
        self.page.goto(url)
        if key is not None:
            self.wait_for_model()

    def wait_for_model(self):
        self.page.wait_for_function("() => document.getElementById('model-name').textContent === 'gem4-demo'")

    def configure(self, **settings):
        """Fills the settings dialog (temperature="0", extra='{...}', ...) and saves it."""
        self.page.click("#settings-button")
        for name, value in settings.items():
            self.page.fill(f"#setting-{name}", str(value))
        self.page.click("#settings-save")
        self.page.wait_for_selector("#settings-dialog", state="hidden")

    def send(self, text: str):
        self.page.fill("#input", text)
        self.page.press("#input", "Enter")

    def wait_reply(self, index: int):
        """The assistant message at `index` once it has finished (its stats line is drawn then)."""
        return self.page.wait_for_selector(f".message.assistant[data-index='{index}'] .stats", state="attached")

    def raw(self, index: int) -> str:
        return self.page.eval_on_selector(f".message.assistant[data-index='{index}'] pre.raw", "e => e.textContent")

    def stats(self, index: int) -> str:
        return self.page.inner_text(f".message.assistant[data-index='{index}'] .stats")

    def stored(self) -> list[dict]:
        return self.page.evaluate("JSON.parse(localStorage.getItem('gem4.conversations'))")

    def check_clean(self, allowed: tuple[str, ...] = ()):
        errors = [e for e in self.errors if not any(a in e for a in allowed)]
        assert errors == [], errors
        assert self.page.evaluate("window.__csp") == []

    def close(self):
        self.context.close()


@pytest.fixture
def open_page(browser, server):
    pages = []

    def opener(**kwargs) -> Page:
        page = Page(browser, kwargs.pop("url", server), **kwargs)
        pages.append(page)
        return page
    yield opener
    for p in pages:
        p.close()


def api_reply(server: str, messages: list[dict], **kwargs):
    return client_for(server).chat.completions.create(model="gem4-demo", messages=messages, **kwargs)


def stats_numbers(text: str) -> dict:
    """'TTFT 12 ms · 345.6 tok/s · 40 tokens · prompt 30 (16 cached)' -> the numbers. tok/s is missing when
    every token came in one read (nothing to time them by): then None."""
    m = re.search(r"TTFT (\d+) ms · (?:([\d.]+) tok/s · )?(\d+) tokens · prompt (\d+) \((\d+) cached\)", text)
    assert m, text
    return dict(zip(("ttft_ms", "tok_s", "tokens", "prompt", "cached"), (g and float(g) for g in m.groups())))


# ---------------------------------------------------------------------------------------------
# Acceptance
# ---------------------------------------------------------------------------------------------


def test_a_streamed_reply_equals_the_apis_greedy_reply(open_page, server):
    question = "Write three short sentences about the sea."
    expected = api_reply(server, [{"role": "user", "content": question}], temperature=0, max_tokens=160,
                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert expected.usage.completion_tokens >= 16             # long enough to arrive in several pieces
    p = open_page()
    p.configure(temperature=0, max_tokens=160)
    # every text the reply shows while it streams
    p.page.evaluate("""() => { window.__seen = new Set();
        new MutationObserver(() => { const raw = document.querySelector('.message.assistant pre.raw');
                                     if (raw) window.__seen.add(raw.textContent); })
          .observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true}); }""")
    p.send(question)
    p.wait_reply(1)
    assert p.raw(1) == expected.choices[0].message.content
    seen = p.page.evaluate("[...window.__seen]")
    partial = [s for s in seen if s and s != expected.choices[0].message.content]
    assert partial and all(expected.choices[0].message.content.startswith(s) for s in partial), seen
    numbers = stats_numbers(p.stats(1))
    assert numbers["tokens"] == expected.usage.completion_tokens and numbers["prompt"] == expected.usage.prompt_tokens
    assert numbers["ttft_ms"] > 0 and numbers["tok_s"] > 0
    assert p.page.inner_text(".message.user[data-index='0'] .body") == question
    assert p.page.inner_text("#model-context") == "8,192 tokens context"
    # the key went as a bearer token, never in a URL
    (chat,) = [r for r in p.requests if r.url.endswith("/v1/chat/completions")]
    assert chat.headers.get("authorization") == f"Bearer {API_KEY}"
    assert all(r.headers.get("authorization") in (None, f"Bearer {API_KEY}") for r in p.requests)
    assert not any(API_KEY in r.url for r in p.requests)
    p.check_clean()


def test_stop_ends_the_stream_and_frees_the_sequence(open_page, server):
    p = open_page()
    p.configure(max_tokens=6000, extra='{"ignore_eos": true}')
    for how in ("button", "escape"):
        if how == "button":
            p.send("Count to a million.")
        else:
            p.page.click(".message.assistant[data-index='1'] .regenerate")
        p.page.wait_for_function(
            "() => (document.querySelector('.message.assistant pre.raw')?.textContent ?? '').length > 20")
        assert metric(server, "gem4:num_requests_running") == 1
        if how == "button":
            p.page.click("#stop")
        else:
            p.page.keyboard.press("Escape")
        p.wait_reply(1)
        wait_for(lambda: metric(server, "gem4:num_requests_running") == 0, timeout=10)
        assert "stopped" in p.stats(1)
        shown = p.raw(1)
        time.sleep(0.3)
        assert p.raw(1) == shown and 0 < len(shown)            # nothing more arrives
        assert p.page.is_visible("#send") and not p.page.is_visible("#stop")
        assert p.stored()[0]["messages"][1]["stopped"] is True
    p.check_clean()


def test_thinking_is_shown_apart_and_collapsible(open_page, server):
    bias = {str(CHANNEL_END): 8.0}
    question = [{"role": "user", "content": "What is 2 + 2?"}]
    for seed in range(30):          # a seed whose reply thinks, then answers
        reply = api_reply(server, question, temperature=1.0, seed=seed, max_tokens=40, logit_bias=bias,
                          extra_body={"chat_template_kwargs": {"enable_thinking": True}})
        message = reply.choices[0].message
        reasoning = (message.model_extra or {}).get("reasoning_content")
        if reasoning and message.content:
            break
    else:
        raise AssertionError("no seed in 30 gave a reply with both reasoning and content")
    p = open_page()
    p.configure(temperature=1.0, seed=seed, max_tokens=40, extra=json.dumps({"logit_bias": bias}))
    p.page.check("#thinking")
    p.send(question[0]["content"])
    p.wait_reply(1)
    reply_view = ".message.assistant[data-index='1']"
    details = p.page.query_selector(f"{reply_view} details.thinking")
    assert details is not None and not details.evaluate("d => d.open")         # collapsed once answered
    assert details.eval_on_selector(".reasoning", "e => e.textContent") == reasoning
    assert not details.is_visible() or not p.page.is_visible(f"{reply_view} .reasoning")
    p.page.click(f"{reply_view} details.thinking summary")
    assert p.page.is_visible(f"{reply_view} .reasoning")
    assert p.raw(1) == message.content
    assert p.page.eval_on_selector(f"{reply_view} .body", "b => b.closest('details')") is None
    assert reasoning not in p.page.inner_text(f"{reply_view} .body")
    assert p.stored()[0]["messages"][1]["reasoning_content"] == reasoning
    p.check_clean()


def test_the_next_message_and_regenerate_report_cached_prompt_tokens(open_page):
    p = open_page()
    p.configure(temperature=0, max_tokens=8)
    p.send("Here is a question about the history of lighthouses along the northern coast, and their keepers.")
    p.wait_reply(1)
    p.send("And the second question: how were they lit?")
    p.wait_reply(3)
    second = stats_numbers(p.stats(3))
    assert 0 < second["cached"] < second["prompt"]
    first_text = p.raw(3)
    p.page.click(".message.assistant[data-index='3'] .regenerate")       # the same prompt again: mostly cached
    p.wait_reply(3)
    again = stats_numbers(p.stats(3))
    assert again["prompt"] == second["prompt"] and again["cached"] > second["cached"]
    assert p.raw(3) == first_text                                  # greedy: the same reply
    # edit and resend the second question: the conversation is cut there and goes on from the new text
    p.page.click(".message.user[data-index='2'] .edit")
    p.page.fill(".message.user[data-index='2'] .edit-input", "And the second question: who kept them?")
    p.page.click(".message.user[data-index='2'] .resend")
    p.wait_reply(3)
    messages = p.stored()[0]["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
    assert messages[2]["content"] == "And the second question: who kept them?"
    assert stats_numbers(p.stats(3))["cached"] > 0
    p.check_clean()


def test_conversations_survive_a_reload_and_are_renamed_deleted_exported(open_page, tmp_path):
    p = open_page()
    p.configure(max_tokens=12)
    p.send("Remember this conversation.")
    p.wait_reply(1)
    before = p.raw(1)
    p.page.click(".conversation.current [aria-label='Rename']")
    p.page.fill(".conversation .rename", "Kept")
    p.page.press(".conversation .rename", "Enter")
    p.page.click("#new-chat")
    p.send("A second conversation.")
    p.wait_reply(1)
    p.page.reload()
    p.wait_for_model()
    titles = p.page.eval_on_selector_all(".conversation .title", "bs => bs.map(b => b.textContent)")
    assert titles == ["A second conversation.", "Kept"]
    p.page.click(".conversation:has-text('Kept') .title")
    assert p.raw(1) == before
    assert p.page.inner_text(".message.user[data-index='0'] .body") == "Remember this conversation."
    with p.page.expect_download() as download:
        p.page.click("#export")
    exported = json.loads(Path(download.value.path()).read_text())
    assert [c["title"] for c in exported] == ["A second conversation.", "Kept"]
    assert exported[1]["messages"][1]["content"] == before
    delete = ".conversation:has-text('A second conversation.') [aria-label='Delete']"
    p.page.click(delete)
    p.page.click(delete)                                       # the second click deletes
    p.page.wait_for_function("() => document.querySelectorAll('.conversation').length === 1")
    p.page.reload()
    p.wait_for_model()
    assert p.page.eval_on_selector_all(".conversation .title", "bs => bs.map(b => b.textContent)") == ["Kept"]
    p.check_clean()


def test_with_an_api_key_no_reply_without_the_key_a_reply_with_it(open_page, server):
    p = open_page(key=None)
    p.page.wait_for_selector("#key-dialog[open]")               # the page loaded, and asks for the key
    assert "API key" in p.page.inner_text("#key-reason")
    p.page.keyboard.press("Escape")                            # dismissed: no key
    p.configure(max_tokens=8)
    p.send("Hello without a key")
    p.wait_reply(1)
    assert p.raw(1) == ""
    assert "API key" in p.page.inner_text(".message.assistant[data-index='1'] .error")
    p.page.wait_for_selector("#key-dialog[open]")
    p.page.fill("#key-input", "wrong-key")
    p.page.click("#key-form button")
    p.page.wait_for_selector("#key-dialog[open]")
    assert "Incorrect API key" in p.page.inner_text("#key-reason")
    p.page.fill("#key-input", API_KEY)
    p.page.click("#key-form button")
    p.wait_for_model()
    assert p.page.evaluate("localStorage.getItem('gem4.apiKey')") == API_KEY
    p.page.click(".message.assistant[data-index='1'] .regenerate")
    p.wait_reply(1)
    assert p.raw(1) and not p.page.query_selector(".message.assistant[data-index='1'] .error")
    assert not any(API_KEY in r.url or "wrong-key" in r.url for r in p.requests)
    p.check_clean(allowed=("status of 401",))


XSS = """Some **bold** text.

<script>window.__xss = 'script'</script>
<img src="x" onerror="window.__xss = 'img'">
<svg onload="window.__xss = 'svg'"><circle r="1"/></svg>
<iframe src="javascript:window.__xss = 'iframe'"></iframe>
<a href="javascript:window.__xss = 'a'">an html link</a>
<details open ontoggle="window.__xss = 'details'">x</details>
<form action="javascript:window.__xss = 'form'"><button>submit</button></form>

[a markdown link](javascript:window.__xss='md')
[an encoded link](jav&#x61;script:window.__xss='encoded')
![an image](javascript:window.__xss='image')
<a href="https://example.com/ok">a fine link</a>

```python
print("<script>window.__xss = 'code'</script>")
```
"""


def test_markdown_with_script_payloads_renders_inert(open_page, server, tmp_path):
    conversation = {"title": "XSS", "messages": [
        {"role": "user", "content": XSS},
        {"role": "assistant", "content": XSS, "reasoning_content": XSS},
        {"role": "tool", "tool_call_id": "x", "content": XSS},
        {"role": "assistant", "content": XSS, "tool_calls": [{"id": "c", "type": "function", "function": {
            "name": "<img src=x onerror=\"window.__xss='name'\">", "arguments": json.dumps({"q": XSS})}}]}]}
    export = tmp_path / "xss.json"
    export.write_text(json.dumps([conversation]))
    p = open_page()
    p.page.set_input_files("#import-file", str(export))
    p.page.wait_for_selector(".message.assistant[data-index='3'] .tool-call")
    markdown = ".markdown"
    assert p.page.inner_text(f".message.assistant[data-index='1'] {markdown} strong") == "bold"   # it is rendered
    assert "print(" in p.page.inner_text(f".message.assistant[data-index='1'] {markdown} pre code")
    for link in p.page.query_selector_all(f"{markdown} a"):
        link.click(modifiers=["Control"]) if link.get_attribute("href") else link.click()
    p.page.click(".message.assistant[data-index='1'] details.thinking summary")
    time.sleep(0.3)
    assert p.page.evaluate("window.__xss") is None                       # no script ran
    found = p.page.evaluate("""() => {
        const all = [...document.querySelectorAll('#messages *')];
        return {scripts: document.querySelectorAll('#messages script, #messages iframe, #messages svg, #messages form').length,
                handlers: all.filter(e => [...e.attributes].some(a => a.name.startsWith('on'))).length,
                scriptUrls: all.filter(e => [...e.attributes].some(a => /^\\s*javascript:/i.test(a.value))).length,
                links: [...document.querySelectorAll('#messages .markdown a')].map(a => a.getAttribute('href'))};
    }""")
    assert (found["scripts"], found["handlers"], found["scriptUrls"]) == (0, 0, 0), found
    assert "https://example.com/ok" in found["links"]
    assert XSS.strip() in p.page.inner_text(".message.user[data-index='0'] .body")     # user text stays text
    p.check_clean(allowed=(f"404 (Not Found) ({server}/x)",))      # <img src="x">; the CSP never had to block


WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_a_tool_call_takes_a_pasted_result_and_the_reply_goes_on(open_page, server, tmp_path):
    """A reply that called a tool (from an imported conversation: the random demo does not call tools) shows
    the call and a box for its result; the result goes to the server as a `tool` message, and the reply
    that follows is the API's reply to the same messages."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    messages = [{"role": "user", "content": "What is the weather in Oslo?"},
                {"role": "assistant", "content": "", "tool_calls": [call]}]
    export = tmp_path / "tool.json"
    export.write_text(json.dumps({"title": "Weather", "messages": messages}))
    p = open_page()
    p.configure(temperature=0, max_tokens=12, tools=json.dumps([WEATHER_TOOL]))
    p.page.set_input_files("#import-file", str(export))
    view = ".message.assistant[data-index='1']"
    assert p.page.inner_text(f"{view} .tool-call code") == "get_weather"
    assert json.loads(p.page.inner_text(f"{view} .tool-call .arguments")) == {"city": "Oslo"}
    p.page.fill(f"{view} .tool-result", "Sunny, 21 degrees")
    p.page.click(f"{view} .send-results")
    p.wait_reply(3)
    expected = api_reply(server, [*messages, {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 degrees"}],
                         tools=[WEATHER_TOOL], temperature=0, max_tokens=12,
                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert p.raw(3) == expected.choices[0].message.content
    assert p.page.inner_text(".message.tool[data-index='2'] .body") == "Sunny, 21 degrees"
    assert not p.page.query_selector(f"{view} .tool-result")           # answered: no box any more
    # the keyboard: Shift-Enter is a new line, Enter sends
    p.page.click("#input")
    p.page.keyboard.type("first line")
    p.page.keyboard.press("Shift+Enter")
    p.page.keyboard.type("second line")
    assert p.page.input_value("#input") == "first line\nsecond line"
    assert len(p.page.query_selector_all(".message")) == 4
    p.page.keyboard.press("Enter")
    p.wait_reply(5)
    assert p.page.inner_text(".message.user[data-index='4'] .body") == "first line\nsecond line"
    assert p.page.input_value("#input") == ""
    p.check_clean()


def test_the_theme_toggle_is_kept(open_page):
    p = open_page()
    system = p.page.evaluate("matchMedia('(prefers-color-scheme: dark)').matches")
    background = p.page.evaluate("getComputedStyle(document.body).backgroundColor")
    p.page.click("#theme")
    assert p.page.evaluate("document.documentElement.dataset.theme") == ("light" if system else "dark")
    toggled = p.page.evaluate("getComputedStyle(document.body).backgroundColor")
    assert toggled != background
    p.page.reload()
    p.wait_for_model()
    assert p.page.evaluate("getComputedStyle(document.body).backgroundColor") == toggled
    p.check_clean()


def test_attachments_are_refused_clearly(open_page, tmp_path):
    p = open_page()
    image = tmp_path / "cat.png"
    image.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(32))
    p.page.set_input_files("#file", str(image))
    assert "does not accept images yet" in p.page.inner_text("#notice")
    audio = tmp_path / "hello.wav"
    audio.write_bytes(b"RIFF" + bytes(40))
    p.page.set_input_files("#file", str(audio))
    assert "does not accept audio yet" in p.page.inner_text("#notice")
    p.check_clean()


def test_the_page_works_served_from_another_origin(open_page, server, tmp_path):
    """The page's files on a plain static server; the API on gem4 serve's (default) CORS settings."""
    site = tmp_path / "site"
    shutil.copytree(WEB_DIR, site / "web")
    shutil.copy(WEB_DIR / "index.html", site / "index.html")
    handler = lambda *a: http.server.SimpleHTTPRequestHandler(*a, directory=str(site))  # noqa: E731
    static = http.server.ThreadingHTTPServer((HOST, 0), handler)
    threading.Thread(target=static.serve_forever, daemon=True).start()
    try:
        url = f"http://{HOST}:{static.server_address[1]}/"
        p = open_page(url=url, key=None)
        p.configure(server=server, max_tokens=8)
        p.page.wait_for_selector("#key-dialog[open]")
        p.page.fill("#key-input", API_KEY)
        p.page.click("#key-form button")
        p.wait_for_model()
        p.send("Hello from another origin")
        p.wait_reply(1)
        assert p.raw(1) and stats_numbers(p.stats(1))["tokens"] == 8
        p.check_clean(allowed=("status of 401", f"404 (File not found) ({url}v1/models)"))   # before it knew the server
    finally:
        static.shutdown()


def test_screenshots_first_paint_and_bundle_size(open_page, server, browser):
    """Screenshots at desktop and phone sizes; the first paint of / against the browser's first paint of the
    server's smallest reply (/version), interleaved; the bytes the page loads."""
    OUTPUT.mkdir(parents=True, exist_ok=True)
    sample = [{"title": "Tides", "messages": [
        {"role": "user", "content": "Why are there two tides a day? Keep it short, with a formula."},
        {"role": "assistant", "reasoning_content": "The Moon's pull differs across the Earth: a bulge on each side.",
         "content": "Because the Moon's pull is **stronger on the near side** and weaker on the far side, the oceans "
                    "bulge on both sides:\n\n- the near bulge faces the Moon\n- the far bulge is left behind\n\n"
                    "The tidal acceleration falls off as the cube of the distance:\n\n```python\n"
                    "def tidal_acceleration(G, M, r, d):\n    return 2 * G * M * r / d**3\n```",
         "stats": {"ttft_ms": 41, "tokens_per_s": 21.7, "completion_tokens": 96, "prompt_tokens": 31,
                   "cached_tokens": 0}}]}]
    for name, viewport, scheme in (("desktop", DESKTOP, "light"), ("phone", PHONE, "light"),
                                   ("desktop-dark", DESKTOP, "dark")):
        p = open_page(viewport=viewport, color_scheme=scheme)
        p.page.evaluate("(c) => localStorage.setItem('gem4.conversations', JSON.stringify(c))", sample)
        p.page.evaluate("localStorage.setItem('gem4.current', JSON.parse(localStorage.getItem('gem4.conversations'))[0].id)")
        p.page.reload()
        p.wait_for_model()
        p.configure(max_tokens=24, temperature=0)
        p.send("And in the demo model's words?")
        p.wait_reply(3)
        p.page.click(".message.assistant[data-index='1'] details.thinking summary")
        p.page.screenshot(path=str(OUTPUT / f"chat-{name}.png"))
        assert (OUTPUT / f"chat-{name}.png").stat().st_size > 10_000
        p.check_clean()
    assert (REPO / "docs" / "web-ui.png").is_file() and "docs/web-ui.png" in (REPO / "README.md").read_text()

    # first paint: the page against the browser's rendering of a small JSON reply of the same server
    context = browser.new_context(viewport=DESKTOP)
    fcp = {"/": [], "/version": []}
    loaded: dict[str, int] = {}
    try:
        for _ in range(3):
            for path in fcp:
                page = context.new_page()
                if path == "/":
                    page.on("response", lambda r: r.url.startswith(server + "/web/") and
                            loaded.setdefault(r.url, len(r.body())))
                page.goto(server + path)
                page.wait_for_load_state("load")
                page.wait_for_function("() => performance.getEntriesByName('first-contentful-paint').length > 0")
                fcp[path].append(page.evaluate("performance.getEntriesByName('first-contentful-paint')[0].startTime"))
                page.close()
    finally:
        context.close()
    page_ms, baseline_ms = statistics.median(fcp["/"]), statistics.median(fcp["/version"])
    index_bytes = len(httpx.get(server + "/").content)
    total = index_bytes + sum(loaded.values())
    shipped = sum(f.stat().st_size for f in WEB_DIR.rglob("*") if f.is_file() and "LICENSE" not in f.name)
    (OUTPUT / "timing.json").write_text(json.dumps({"first_contentful_paint_ms": fcp, "page_bytes": total,
                                                    "files": loaded}, indent=1))
    print(f"first contentful paint: page {page_ms:.0f} ms, /version {baseline_ms:.0f} ms; page {total} bytes")
    assert page_ms < baseline_ms + 500                       # generous: two busy cores
    assert total < 400_000 and total <= shipped                # a few hundred KB at most, all of it ours
