"""OpenAI-compatible HTTP server (FastAPI + uvicorn) over `gem4.Engine`.

    protocol.py   OpenAI request/response models and error objects (the only place that knows JSON shapes)
    app.py        routes, SSE, errors, disconnect -> abort; the thread model is in its docstring
    metrics.py    Prometheus text, `gem4:*`
    main.py       `gem4 serve` arguments, loading, uvicorn

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
