// The chat page of `gem4 serve` (docs/web.md): conversations kept in this browser, replies streamed from
// /v1/chat/completions, thinking and tool calls shown as such, per-reply stats.
import { ApiError, getModel, streamChat } from "./api.js";
import { renderMarkdown } from "./render.js";
import { DEFAULT_SETTINGS, importConversations, newConversation, store } from "./store.js";

const $ = (id) => document.getElementById(id);

const state = {
  conversations: store.conversations(),
  current: null,                 // the conversation shown
  settings: store.settings(),
  model: null,                   // the card of /v1/models
  controller: null,              // the AbortController of the request in flight
};

// ---------------------------------------------------------------------------------------------
// Elements
// ---------------------------------------------------------------------------------------------

function el(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(props)) {
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else if (v !== undefined && v !== null && v !== false) node.setAttribute(k, v === true ? "" : v);
  }
  node.append(...children.filter((c) => c !== null && c !== undefined));
  return node;
}

function notice(text, kind = "error") {
  const box = $("notice");
  box.dataset.kind = kind;
  box.replaceChildren(el("span", { text }), el("button", { type: "button", class: "link", "aria-label": "Dismiss",
                                                             text: "×", onclick: () => { box.hidden = true; } }));
  box.hidden = false;
}

// ---------------------------------------------------------------------------------------------
// Conversations
// ---------------------------------------------------------------------------------------------

function save() {
  store.saveConversations(state.conversations);
  if (state.current) store.saveCurrentId(state.current.id);
}

function select(conversation) {
  if (state.controller) stop();
  state.current = conversation;
  save();
  renderConversations();
  renderMessages();
  document.body.classList.remove("sidebar-open");
}

function startConversation() {
  const empty = state.conversations.find((c) => c.messages.length === 0);
  const conversation = empty ?? newConversation();
  if (!empty) state.conversations.unshift(conversation);
  select(conversation);
  $("input").focus();
}

function renderConversations() {
  const list = $("conversations");
  list.replaceChildren(...state.conversations.map((c) => {
    const title = el("button", { type: "button", class: "title", text: c.title, title: c.title,
                                 onclick: () => select(c) });
    const rename = el("button", { type: "button", class: "icon", title: "Rename", "aria-label": "Rename", text: "✎",
                                  onclick: () => renameInPlace(item, c) });
    const remove = el("button", { type: "button", class: "icon", title: "Delete", "aria-label": "Delete", text: "×",
                                  onclick: () => {
                                    if (remove.dataset.armed) return deleteConversation(c);
                                    remove.dataset.armed = "1";          // a second click deletes
                                    remove.textContent = "Delete?";
                                    setTimeout(() => { delete remove.dataset.armed; remove.textContent = "×"; }, 3000);
                                  } });
    const item = el("li", { class: c === state.current ? "conversation current" : "conversation",
                            "data-id": c.id }, title, rename, remove);
    return item;
  }));
}

function renameInPlace(item, conversation) {
  const input = el("input", { type: "text", class: "rename", value: conversation.title, "aria-label": "Title" });
  let done = false;
  const finish = (keep) => {
    if (done) return;
    done = true;
    if (keep && input.value.trim()) conversation.title = input.value.trim();
    save();
    renderConversations();
  };
  input.addEventListener("keydown", (e) => {
    if (e.key === "Enter") finish(true);
    if (e.key === "Escape") finish(false);
  });
  input.addEventListener("blur", () => finish(true));
  item.querySelector(".title").replaceWith(input);
  input.focus();
  input.select();
}

function deleteConversation(conversation) {
  state.conversations = state.conversations.filter((c) => c !== conversation);
  if (state.current === conversation) {
    state.current = state.conversations[0] ?? null;
    if (!state.current) {
      state.current = newConversation();
      state.conversations.unshift(state.current);
    }
  }
  select(state.current);
}

function exportConversations() {
  const blob = new Blob([JSON.stringify(state.conversations, null, 2)], { type: "application/json" });
  const link = el("a", { href: URL.createObjectURL(blob), download: "gem4-conversations.json" });
  link.click();
  setTimeout(() => URL.revokeObjectURL(link.href), 1000);
}

async function importFile(file) {
  try {
    const added = importConversations(await file.text());
    state.conversations.unshift(...added);
    select(added[0]);
    notice(`Imported ${added.length} conversation${added.length === 1 ? "" : "s"}.`, "info");
  } catch (e) {
    notice(`Cannot import ${file.name}: ${e.message}`);
  }
}

// ---------------------------------------------------------------------------------------------
// Messages
// ---------------------------------------------------------------------------------------------

function renderMessages() {
  const box = $("messages");
  const messages = state.current?.messages ?? [];
  box.replaceChildren(...messages.map((m, i) => messageView(m, i)));
  if (!messages.length) box.append(el("p", { class: "empty", text: "Send a message to start." }));
  box.scrollTop = box.scrollHeight;
}

function messageView(message, index, streaming = false) {
  const view = el("article", { class: `message ${message.role}`, "data-index": index });
  if (message.role === "user") {
    view.append(el("div", { class: "body plain", text: message.content }),
                el("div", { class: "actions" }, el("button", { type: "button", class: "link edit", text: "Edit",
                                                               onclick: () => editInPlace(view, index) })));
  } else if (message.role === "tool") {
    view.append(el("div", { class: "label", text: `Tool result${message.name ? ` of ${message.name}` : ""}` }),
                el("pre", { class: "body plain", text: message.content }));
  } else {
    fillReply(view, message, index, streaming);
  }
  return view;
}

/** The parts of an assistant reply: thinking, content, tool calls, stats, actions. Called again as it streams. */
function fillReply(view, message, index, streaming = false) {
  const parts = [];
  if (message.reasoning_content) {
    let details = view.querySelector("details.thinking");
    if (!details) {             // open while it thinks, closed once the answer begins (a click opens it again)
      details = el("details", { class: "thinking", open: streaming },
                   el("summary", { text: "Thinking" }), el("div", { class: "reasoning" }));
    }
    if (streaming && details.open && (message.content || message.tool_calls?.length) && !details.dataset.answered) {
      details.dataset.answered = "1";
      details.open = false;
    }
    details.querySelector(".reasoning").textContent = message.reasoning_content;
    parts.push(details);
  }
  const body = view.querySelector(".body") ?? el("div", { class: "body markdown" });
  renderMarkdown(body, message.content || "");
  parts.push(body);
  const raw = view.querySelector("pre.raw") ?? el("pre", { class: "raw", hidden: true });
  raw.textContent = message.content || "";
  parts.push(raw);
  if (message.tool_calls?.length) parts.push(toolCallsView(message, index, streaming));
  if (message.error) parts.push(el("div", { class: "error", role: "alert", text: message.error }));
  if (!streaming) {
    parts.push(el("div", { class: "stats", text: statsText(message) }));
    const isLast = index === state.current.messages.length - 1;
    parts.push(el("div", { class: "actions" },
      el("button", { type: "button", class: "link raw-toggle", text: "Raw",
                     onclick: () => { raw.hidden = !raw.hidden; body.hidden = !raw.hidden; } }),
      el("button", { type: "button", class: "link copy", text: "Copy",
                     onclick: () => navigator.clipboard?.writeText(message.content || "") }),
      isLast ? el("button", { type: "button", class: "link regenerate", text: "Regenerate",
                              onclick: () => regenerate(index) }) : null));
  }
  view.replaceChildren(...parts);
}

function toolCallsView(message, index, streaming) {
  const waiting = !streaming && index === state.current.messages.length - 1;   // no result yet: boxes for them
  const inputs = [];
  const box = el("div", { class: "tool-calls" }, ...message.tool_calls.map((call) => {
    const result = el("textarea", { class: "tool-result", rows: 2, placeholder: "Paste the tool's result",
                                    "aria-label": `Result of ${call.function.name}` });
    inputs.push([call, result]);
    return el("div", { class: "tool-call" },
      el("div", { class: "label" }, "Tool call ", el("code", { text: call.function.name })),
      el("pre", { class: "arguments", text: prettyJson(call.function.arguments) }),
      waiting ? result : null);
  }));
  if (waiting) {
    box.append(el("button", { type: "button", class: "send-results", text: "Send results", onclick: () => {
      for (const [call, input] of inputs) {
        state.current.messages.push({ role: "tool", tool_call_id: call.id, name: call.function.name,
                                      content: input.value });
      }
      save();
      renderMessages();
      generate();
    } }));
  }
  return box;
}

function prettyJson(text) {
  try {
    return JSON.stringify(JSON.parse(text), null, 2);
  } catch {
    return text;
  }
}

function statsText(message) {
  const s = message.stats ?? {};
  const parts = [];
  if (s.ttft_ms != null) parts.push(`TTFT ${Math.round(s.ttft_ms)} ms`);
  if (s.tokens_per_s != null) parts.push(`${s.tokens_per_s.toFixed(1)} tok/s`);
  if (s.completion_tokens != null) parts.push(`${s.completion_tokens} tokens`);
  if (s.prompt_tokens != null) parts.push(`prompt ${s.prompt_tokens} (${s.cached_tokens ?? 0} cached)`);
  if (message.stopped) parts.push("stopped");
  else if (message.finish_reason && message.finish_reason !== "stop") parts.push(`finish: ${message.finish_reason}`);
  return parts.join(" · ");
}

function editInPlace(view, index) {
  if (state.controller) return;
  const message = state.current.messages[index];
  const input = el("textarea", { class: "edit-input", rows: 3, "aria-label": "Edit message" });
  input.value = message.content;
  const resend = () => {
    if (!input.value.trim()) return;
    state.current.messages = state.current.messages.slice(0, index);
    state.current.messages.push({ role: "user", content: input.value });
    save();
    renderMessages();
    generate();
  };
  input.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); resend(); }
    if (e.key === "Escape") renderMessages();
  });
  view.replaceChildren(input, el("div", { class: "actions" },
    el("button", { type: "button", class: "link resend", text: "Send", onclick: resend }),
    el("button", { type: "button", class: "link", text: "Cancel", onclick: renderMessages })));
  input.focus();
}

function regenerate(index) {
  if (state.controller) return;
  state.current.messages = state.current.messages.slice(0, index);
  save();
  renderMessages();
  generate();
}

// ---------------------------------------------------------------------------------------------
// Requests
// ---------------------------------------------------------------------------------------------

function numberSetting(name) {
  const text = String(state.settings[name] ?? "").trim();
  if (!text) return undefined;
  const value = Number(text);
  if (!Number.isFinite(value)) throw new Error(`${name} must be a number, got ${JSON.stringify(text)}`);
  return value;
}

function jsonSetting(name, check, what) {
  const text = String(state.settings[name] ?? "").trim();
  if (!text) return undefined;
  let value;
  try {
    value = JSON.parse(text);
  } catch (e) {
    throw new Error(`${what} is not valid JSON: ${e.message}`);
  }
  if (!check(value)) throw new Error(`${what} must be ${check.expected}`);
  return value;
}
const isList = Object.assign((v) => Array.isArray(v), { expected: "a JSON list" });
const isObject = Object.assign((v) => v && typeof v === "object" && !Array.isArray(v), { expected: "a JSON object" });

function apiMessage(m) {
  const out = { role: m.role, content: m.content ?? "" };
  if (m.role === "assistant") {
    if (m.reasoning_content) out.reasoning_content = m.reasoning_content;
    if (m.tool_calls?.length) out.tool_calls = m.tool_calls;
  }
  if (m.role === "tool") out.tool_call_id = m.tool_call_id;
  return out;
}

/** The request body for the conversation's messages and the settings. Throws on a bad setting. */
function requestBody(messages) {
  const s = state.settings;
  const body = {
    messages: [...(s.system.trim() ? [{ role: "system", content: s.system }] : []),
               ...messages.filter((m) => !(m.error && !m.content)).map(apiMessage)],
    stream: true,
    stream_options: { include_usage: true },
    chat_template_kwargs: { enable_thinking: Boolean(s.thinking) },
  };
  if (state.model) body.model = state.model.id;
  for (const name of ["temperature", "top_p", "top_k", "max_tokens", "seed"]) {
    const value = numberSetting(name);
    if (value !== undefined) body[name] = value;
  }
  const tools = jsonSetting("tools", isList, "Tools");
  if (tools?.length) body.tools = tools;
  return { ...body, ...jsonSetting("extra", isObject, "Extra request fields") };
}

async function generate() {
  const conversation = state.current;
  let body;
  try {
    body = requestBody(conversation.messages);
  } catch (e) {
    notice(e.message);
    return;
  }
  const reply = { role: "assistant", content: "", reasoning_content: "", tool_calls: [], stats: {} };
  conversation.messages.push(reply);
  const index = conversation.messages.length - 1;
  const view = messageView(reply, index, true);
  $("messages").querySelector(".empty")?.remove();
  $("messages").append(view);
  const controller = new AbortController();
  state.controller = controller;
  setBusy(true);

  const start = performance.now();
  let first = null;
  let last = null;
  let usage = null;
  let frame = 0;
  const draw = () => {
    frame = 0;
    if (conversation !== state.current) return;
    const box = $("messages");
    const atBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 40;
    fillReply(view, reply, index, true);
    if (atBottom) box.scrollTop = box.scrollHeight;
  };
  try {
    await streamChat(state.settings.server, store.apiKey(), body, controller.signal, (chunk) => {
      if (chunk.usage) usage = chunk.usage;
      for (const choice of chunk.choices ?? []) {
        const d = choice.delta ?? {};
        if (d.content || d.reasoning_content || d.tool_calls?.length) {
          last = performance.now();
          first ??= last;
        }
        if (d.reasoning_content) reply.reasoning_content += d.reasoning_content;
        if (d.content) reply.content += d.content;
        for (const call of d.tool_calls ?? []) {
          const slot = (reply.tool_calls[call.index] ??= { id: "", type: "function",
                                                           function: { name: "", arguments: "" } });
          if (call.id) slot.id = call.id;
          if (call.function?.name) slot.function.name = call.function.name;
          if (call.function?.arguments) slot.function.arguments += call.function.arguments;
        }
        if (choice.finish_reason) reply.finish_reason = choice.finish_reason;
      }
      frame ||= requestAnimationFrame(draw);
    });
  } catch (e) {
    if (e.name === "AbortError") {
      reply.stopped = true;
    } else {
      reply.error = e.message;
      if (e instanceof ApiError && e.status === 401) askKey(e.message);
    }
  } finally {
    cancelAnimationFrame(frame);
    if (state.controller === controller) state.controller = null;
    reply.stats = {
      ttft_ms: first === null ? null : first - start,
      prompt_tokens: usage?.prompt_tokens,
      cached_tokens: usage?.prompt_tokens_details?.cached_tokens,
      completion_tokens: usage?.completion_tokens,
      tokens_per_s: tokensPerSecond(usage?.completion_tokens, start, first, last),
    };
    if (!reply.reasoning_content) delete reply.reasoning_content;
    if (!reply.tool_calls.length) delete reply.tool_calls;
    save();
    setBusy(false);
    if (conversation === state.current) {
      renderMessages();
    }
  }
}

/** Decode speed: the tokens after the first over the time from the first to the last. When they came too close
 *  together to time (read in one go: the reply was ready before the page read it), the whole reply's rate. */
function tokensPerSecond(tokens, start, first, last) {
  if (!tokens || first === null) return null;
  if (tokens > 1 && last - first >= 50) return (tokens - 1) / ((last - first) / 1000);
  return last > start ? tokens / ((last - start) / 1000) : null;
}

function stop() {
  state.controller?.abort();
}

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
  document.body.classList.toggle("busy", busy);
}

function send() {
  const input = $("input");
  const text = input.value;
  if (!text.trim() || state.controller) return;
  const conversation = state.current;
  if (!conversation.messages.length) {
    conversation.title = text.trim().split("\n")[0].slice(0, 48);
    renderConversations();
  }
  conversation.messages.push({ role: "user", content: text });
  input.value = "";
  autosize(input);
  save();
  renderMessages();
  generate();
}

// ---------------------------------------------------------------------------------------------
// The model, the API key
// ---------------------------------------------------------------------------------------------

async function loadModel() {
  try {
    state.model = await getModel(state.settings.server, store.apiKey());
    $("model-name").textContent = state.model.id;
    $("model-context").textContent = state.model.max_model_len
      ? `${state.model.max_model_len.toLocaleString("en-US")} tokens context` : "";
    document.title = `${state.model.id} · gem4`;
    $("notice").hidden = true;
  } catch (e) {
    if (e instanceof ApiError && e.status === 401) askKey(e.message);
    else if (e instanceof ApiError && e.status === 503) {
      notice(`The server is not ready: ${e.message}`, "info");
      setTimeout(loadModel, 1000);
    } else notice(`Cannot reach the server: ${e.message}`);
  }
}

function askKey(reason) {
  $("key-reason").textContent = reason || "";
  $("key-input").value = "";
  if (!$("key-dialog").open) $("key-dialog").showModal();
}

// ---------------------------------------------------------------------------------------------
// Settings, theme, attachments
// ---------------------------------------------------------------------------------------------

const SETTING_FIELDS = Object.keys(DEFAULT_SETTINGS).filter((k) => k !== "thinking");

function openSettings() {
  for (const name of SETTING_FIELDS) $(`setting-${name}`).value = state.settings[name] ?? "";
  $("settings-dialog").showModal();
}

function saveSettings() {
  const serverBefore = state.settings.server;
  for (const name of SETTING_FIELDS) state.settings[name] = $(`setting-${name}`).value;
  store.saveSettings(state.settings);
  if (state.settings.server !== serverBefore) loadModel();
}

function toggleTheme() {
  const root = document.documentElement;
  const dark = root.dataset.theme ? root.dataset.theme === "dark" : matchMedia("(prefers-color-scheme: dark)").matches;
  root.dataset.theme = dark ? "light" : "dark";
  store.saveTheme(root.dataset.theme);
}

// Images and audio: the server takes text only so far (no vision or audio tower is wired), so an
// attachment is refused here, clearly, rather than sent and refused by the server (docs/web.md says what
// to wire once it takes them).
function refuseAttachments(files) {
  const kinds = new Set([...files].map((f) => (f.type.startsWith("audio/") ? "audio" : f.type.startsWith("image/")
    ? "images" : "files")));
  if (!kinds.size) return;
  notice(`This model/server does not accept ${[...kinds].join(" or ")} yet: gem4 serves text only for now.`);
}

function autosize(input) {
  input.style.height = "auto";
  input.style.height = `${Math.min(input.scrollHeight, 240)}px`;
}

// ---------------------------------------------------------------------------------------------
// Start
// ---------------------------------------------------------------------------------------------

function wire() {
  const input = $("input");
  $("composer").addEventListener("submit", (e) => { e.preventDefault(); send(); });
  input.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); send(); }
  });
  input.addEventListener("input", () => autosize(input));
  document.addEventListener("keydown", (e) => { if (e.key === "Escape" && state.controller) { e.preventDefault(); stop(); } });
  $("stop").addEventListener("click", stop);
  $("new-chat").addEventListener("click", startConversation);
  $("menu").addEventListener("click", () => document.body.classList.toggle("sidebar-open"));
  $("theme").addEventListener("click", toggleTheme);
  $("export").addEventListener("click", exportConversations);
  $("import").addEventListener("click", () => $("import-file").click());
  $("import-file").addEventListener("change", (e) => {
    if (e.target.files[0]) importFile(e.target.files[0]);
    e.target.value = "";
  });
  $("thinking").checked = Boolean(state.settings.thinking);
  $("thinking").addEventListener("change", (e) => {
    state.settings.thinking = e.target.checked;
    store.saveSettings(state.settings);
  });
  $("settings-button").addEventListener("click", openSettings);
  $("settings-form").addEventListener("submit", (e) => { if (e.submitter?.value === "save") saveSettings(); });
  $("forget-key").addEventListener("click", () => { store.saveApiKey(""); loadModel(); });
  $("key-form").addEventListener("submit", () => {
    store.saveApiKey($("key-input").value.trim());
    loadModel();
  });
  $("attach").addEventListener("click", () => $("file").click());
  $("file").addEventListener("change", (e) => { refuseAttachments(e.target.files); e.target.value = ""; });
  input.addEventListener("paste", (e) => {
    if (e.clipboardData?.files?.length) { e.preventDefault(); refuseAttachments(e.clipboardData.files); }
  });
  document.addEventListener("dragover", (e) => e.preventDefault());
  document.addEventListener("drop", (e) => {
    e.preventDefault();
    if (e.dataTransfer?.files?.length) refuseAttachments(e.dataTransfer.files);
  });
}

function start() {
  wire();
  state.current = state.conversations.find((c) => c.id === store.currentId()) ?? state.conversations[0] ?? null;
  if (!state.current) {
    state.current = newConversation();
    state.conversations.unshift(state.current);
  }
  renderConversations();
  renderMessages();
  loadModel();
  $("input").focus();
}

start();
