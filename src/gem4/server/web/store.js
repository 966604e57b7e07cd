// What the page keeps in the browser (localStorage, this origin only): the conversations, the settings,
// the API key and the theme. Nothing is sent anywhere but to the server, with each request.
//
// A conversation: {id, title, created, messages: [message]}; a message is what the API takes
// ({role, content, reasoning_content?, tool_calls?, tool_call_id?}) plus, for a reply, `stats` and
// `stopped`, which are not sent.

const KEYS = { conversations: "gem4.conversations", current: "gem4.current", settings: "gem4.settings",
               apiKey: "gem4.apiKey", theme: "gem4.theme" };

export const DEFAULT_SETTINGS = {
  system: "", temperature: "", top_p: "", top_k: "", max_tokens: "", seed: "",   // "": the server's default
  thinking: false, tools: "", extra: "", server: "",
};

function read(key, fallback) {
  try {
    const text = localStorage.getItem(key);
    return text === null ? fallback : JSON.parse(text);
  } catch {
    return fallback;
  }
}

function write(key, value) {
  localStorage.setItem(key, JSON.stringify(value));
}

export const store = {
  settings: () => ({ ...DEFAULT_SETTINGS, ...read(KEYS.settings, {}) }),
  saveSettings: (s) => write(KEYS.settings, s),
  apiKey: () => localStorage.getItem(KEYS.apiKey) || "",
  saveApiKey: (key) => (key ? localStorage.setItem(KEYS.apiKey, key) : localStorage.removeItem(KEYS.apiKey)),
  theme: () => localStorage.getItem(KEYS.theme),
  saveTheme: (theme) => localStorage.setItem(KEYS.theme, theme),
  conversations: () => read(KEYS.conversations, []),
  saveConversations: (list) => write(KEYS.conversations, list),
  currentId: () => localStorage.getItem(KEYS.current),
  saveCurrentId: (id) => localStorage.setItem(KEYS.current, id),
};

export function newConversation() {
  return { id: crypto.randomUUID(), title: "New chat", created: Date.now(), messages: [] };
}

/** Conversations read from an export (a JSON list, or one conversation): checked, with fresh ids. */
export function importConversations(text) {
  let value = JSON.parse(text);
  if (!Array.isArray(value)) value = [value];
  return value.map((c, i) => {
    if (!c || !Array.isArray(c.messages)) throw new Error(`item ${i} is not a conversation (it has no messages list)`);
    for (const m of c.messages) {
      if (!["user", "assistant", "tool", "system"].includes(m?.role)) throw new Error(`item ${i}: a message has no valid role`);
    }
    return { ...newConversation(), title: String(c.title ?? "Imported chat"), messages: c.messages };
  });
}
