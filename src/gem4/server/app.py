"""The FastAPI app: the routers of routes/, OpenAI error objects for every failure, CORS, the API keys,
and the periodic throughput line.

Who may call what: /health and /version are open; /metrics is open too (as in vLLM: a Prometheus
scraper carries no key) unless `metrics_api_key` is set, then it takes that key; everything else
takes `api_key` when there is one (Anthropic's /v1/messages also from `x-api-key`)."""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from gem4.server.protocol import APIError, bad_request, param_path
from gem4.server.routes import chat, completions, info, messages, responses, web
from gem4.server.state import EngineLike, ServerConfig, ServerState

__all__ = ["ServerConfig", "ServerState", "create_app"]

log = logging.getLogger("gem4.server")


def create_app(config: ServerConfig, engine: EngineLike | None = None) -> FastAPI:
    """The FastAPI app. Without an engine it answers 503 until `app.state.gem4.engine` is set."""
    state = ServerState(config, engine)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        task = asyncio.create_task(_log_throughput(state))
        try:
            yield
        finally:
            task.cancel()

    app = FastAPI(title="gem4", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.gem4 = state
    # CORS: a browser page on another origin may call the server (preflights are answered here, before auth)
    app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins),
                       allow_methods=list(config.allowed_methods), allow_headers=list(config.allowed_headers),
                       allow_credentials=config.allow_credentials)
    for error, handler in _ERROR_HANDLERS.items():
        app.add_exception_handler(error, handler)
    app.include_router(info.public)
    app.include_router(info.metrics_router, dependencies=[Depends(require_metrics_key)])
    if config.web_ui:                       # the chat page: public files, its API calls carry the key
        app.include_router(web.router)
    # the key is checked as a dependency of each route, so before its handler reads the body
    for routes in (info.router, chat.router, completions.router, responses.router):
        app.include_router(routes, dependencies=[Depends(require_key)])
    app.include_router(messages.router, dependencies=[Depends(require_anthropic_key)])
    return app


async def require_key(request: Request) -> None:
    """`Authorization: Bearer KEY` when the server has an API key; 401 otherwise."""
    _check_bearer(request, request.app.state.gem4.config.api_key)


async def require_anthropic_key(request: Request) -> None:
    """/v1/messages: the key in `x-api-key` (Anthropic's header) or, without one, `Authorization: Bearer`."""
    key = request.app.state.gem4.config.api_key
    given = request.headers.get("x-api-key")
    if key is None or given is None:
        _check_bearer(request, key)
    elif not hmac.compare_digest(given.strip().encode(), key.encode()):
        raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")


async def require_metrics_key(request: Request) -> None:
    """/metrics: `Authorization: Bearer KEY` when the server has a metrics key (--metrics-api-key)."""
    _check_bearer(request, request.app.state.gem4.config.metrics_api_key)


def _check_bearer(request: Request, key: str | None) -> None:
    if key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if not header:
        raise APIError(401, "You didn't provide an API key. Provide it in the Authorization header "
                            "(Authorization: Bearer YOUR_KEY).", code="invalid_api_key")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")


# ---------------------------------------------------------------------------------------------
# Errors: always OpenAI error objects
# ---------------------------------------------------------------------------------------------


async def _api_error(request: Request, e: APIError):
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def _validation(request: Request, e: RequestValidationError):
    errs = e.errors()
    param = param_path(tuple(x for x in errs[0].get("loc", ()) if x != "body")) if errs else None
    msg = errs[0].get("msg", "invalid request") if errs else "invalid request"
    return JSONResponse(bad_request(msg, param).body(), status_code=400)


async def _http(request: Request, e: StarletteHTTPException):
    if e.status_code == 404:
        err = APIError(404, f"Unknown request URL: {request.method} {request.url.path}. "
                            "Please check the URL for typos.", code="unknown_url")
    elif e.status_code == 405:
        err = APIError(405, f"Method {request.method} is not allowed for {request.url.path}.",
                       code="method_not_allowed")
    else:
        err = APIError(e.status_code, str(e.detail))
    return JSONResponse(err.body(), status_code=err.status, headers=getattr(e, "headers", None))


async def _internal(request: Request, e: Exception):
    log.exception("internal error on %s %s", request.method, request.url.path)
    err = APIError(500, f"Internal server error: {type(e).__name__}: {e}", type="server_error")
    return JSONResponse(err.body(), status_code=500)


_ERROR_HANDLERS = {APIError: _api_error, RequestValidationError: _validation, StarletteHTTPException: _http,
                   Exception: _internal}


async def _log_throughput(state: ServerState) -> None:
    """Every `log_interval_s` while there is traffic: one line of prompt and generation throughput and
    the running / waiting counts (vLLM's periodic stats line)."""
    state.metrics.throughput_line(time.monotonic())      # the first interval starts now
    while True:
        await asyncio.sleep(state.config.log_interval_s)
        line = state.metrics.throughput_line(time.monotonic())
        if line is not None:
            log.info("%s", line)
