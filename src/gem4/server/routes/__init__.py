"""The endpoints, one module per endpoint family, each a `fastapi.APIRouter` of module-level handlers that
take the server's state from `request.app.state.gem4` (a `ServerState`).

    chat.py          POST /v1/chat/completions
    messages.py      POST /v1/messages, /v1/messages/count_tokens (Anthropic's Messages API, onto the chat path)
    completions.py   POST /v1/completions
    responses.py     POST /v1/responses (OpenAI's Responses API, translated onto the chat path)
    info.py          GET /health, /version, /metrics, /v1/models[/{id}]; POST /tokenize, /detokenize
    web.py           GET / and /web/...: the chat page's files (public; off with --no-web-ui)

Each module's `router` holds the routes that need the API key; `create_app` (app.py) includes it with the
key check as a dependency, which runs before a handler reads the body. `info.public` holds the routes
open to anyone (health, version; metrics unless --metrics-api-key gives it a key of its own).
"""
