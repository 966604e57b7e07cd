"""OpenAI-compatible HTTP server (FastAPI + uvicorn) over `gem4.Engine`.

    POST /v1/chat/completions   chat (messages, tools, thinking), stream or not
    POST /v1/completions        raw text completion, stream or not
    GET  /v1/models[/{id}]      the served model, with max_model_len
    GET  /health                200 when ready, 503 while the model loads
    GET  /version               {"version": gem4's}
    POST /tokenize, /detokenize vLLM's bodies
    GET  /metrics               Prometheus text, `gem4:*` (metrics.py)

The server never sees tensors: requests go in as token ids and SamplingParams, results come back
as token ids, text and floats.

The modules, one job each, in vLLM's per-endpoint layout: an endpoint family is a module of routes/
that maps its wire format onto an engine request and back with the machinery beside it (another family,
such as /v1/responses or /v1/messages, is another module there; another kind of input, such as images,
goes to inputs.py):

    protocol.py   OpenAI request/response models and error objects (the only place that knows JSON shapes)
    state.py      ServerConfig, ServerState (engine, metrics, open requests), EngineLike
    inputs.py     request -> prompt ids and SamplingParams; the body limit and the early length bounds
    media_fetch.py  a media part's bytes: data URIs, allowed files and downloads, within a byte cap
    request.py    one engine request on the event loop (ServerRequest), SSE, disconnect -> abort;
                  the thread model is in its docstring
    outputs.py    engine events -> chat deltas and messages, completion text, logprobs, usage;
                  why chat stop strings are applied in the server
    routes/       the endpoints: chat.py, completions.py, info.py (health, version, metrics, models,
                  tokenize), each an APIRouter of module-level handlers
    app.py        create_app: the routers, OpenAI error objects for every failure, CORS, the API key
    metrics.py    Prometheus text, `gem4:*`
    store.py      the Responses API's stored responses (previous_response_id), bounded, LRU
    http11.py     connection guards: header and body timeouts, a connection cap, no draining of unread bodies
    main.py       `gem4 serve` arguments, loading, uvicorn
    replicas.py   `gem4 serve --data-parallel-size N`: N `gem4 serve` processes behind SMG's router (docs/replicas.md)

ServerConfig and ServerState live in state.py rather than in app.py because the handlers and helpers
take the state and app.py imports them all: with the state in a module of its own that imports none of
them, the server's imports stay free of cycles.

Importing this package is light; `create_app` / `ServerConfig` load FastAPI on first use.
"""
from __future__ import annotations

from gem4.server.main import add_arguments, serve

__all__ = ["ServerConfig", "add_arguments", "create_app", "serve"]


def __getattr__(name: str):
    if name in ("create_app", "ServerConfig"):
        from gem4.server import app

        return getattr(app, name)
    raise AttributeError(f"module 'gem4.server' has no attribute {name!r}")
