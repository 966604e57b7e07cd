// The server's API as the page uses it: the model card and streamed chat completions (SSE), with the API
// key as a bearer token (never in the URL). `base` is "" for the server that served the page, or another
// server's URL (its CORS settings must allow this page's origin).

export class ApiError extends Error {
  constructor(status, message, code = null) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

function headers(key) {
  const h = { "Content-Type": "application/json" };
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

function url(base, path) {
  return base ? `${base.replace(/\/+$/, "")}/${path}` : path;    // "" -> relative to the page: same server
}

async function failure(response) {
  let message = `${response.status} ${response.statusText}`;
  let code = null;
  try {
    const body = await response.json();
    if (body?.error?.message) ({ message, code } = body.error);
  } catch { /* not an OpenAI error object: keep the status line */ }
  return new ApiError(response.status, message, code);
}

/** The first model of /v1/models: {id, max_model_len, ...}. */
export async function getModel(base, key) {
  const response = await fetch(url(base, "v1/models"), { headers: headers(key) });
  if (!response.ok) throw await failure(response);
  const body = await response.json();
  if (!body.data?.length) throw new ApiError(500, "the server lists no model");
  return body.data[0];
}

/**
 * POST /v1/chat/completions with stream: true; calls `onChunk(chunk)` for every chat.completion.chunk
 * (the usage chunk included) until [DONE]. Aborting `signal` ends the request (the server sees the
 * disconnect and frees the sequence) and rejects with an AbortError.
 */
export async function streamChat(base, key, body, signal, onChunk) {
  const response = await fetch(url(base, "v1/chat/completions"), {
    method: "POST", headers: headers(key), body: JSON.stringify(body), signal,
  });
  if (!response.ok) throw await failure(response);
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) throw new ApiError(0, "the stream ended before [DONE] (the server went away?)");
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n")) >= 0) {
      const line = buffer.slice(0, end).replace(/\r$/, "");
      buffer = buffer.slice(end + 1);
      if (!line.startsWith("data:")) continue;           // blank separators, `: ping` comments
      const data = line.slice(5).trim();
      if (data === "[DONE]") return;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new ApiError(chunk.error.code === "server_shutting_down" ? 503 : 500,
                                          chunk.error.message, chunk.error.code);
      onChunk(chunk);
    }
  }
}
