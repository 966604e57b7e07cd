"""What every handler shares: the server's configuration and its state (engine, metrics, open requests).

The other modules take a `ServerState` (a handler reads it from `request.app.state.gem4`); this module
imports none of them, so they can all name it without an import cycle.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from gem4.sampling import SamplingParams
from gem4.server.media_fetch import MediaPolicy
from gem4.server.metrics import Metrics
from gem4.server.protocol import APIError
from gem4.server.store import DEFAULT_RESPONSES_STORE_MB, ResponseStore

DEFAULT_RENDER_SECONDS = 10.0              # --max-render-seconds: CPU seconds one chat template render may take


class EngineLike(Protocol):
    """What the server needs of an engine (`gem4.Engine` is one). Read by /metrics when present, not
    required: `request_counts()`, `kv_cache_usage`, `num_preemptions`, `prefix_cache_counts`, `step_tokens`,
    `batch_sizes`."""

    tokenizer: Any
    max_model_len: int
    vocab_size: int

    def submit(self, prompt: list[int], params: SamplingParams, *, request_id: str, n: int = 1,
               detokenize: bool = True): ...

    def abort(self, request_id: str) -> bool: ...


@dataclass
class ServerConfig:
    served_model_name: str                     # the id /v1/models and every response report
    model_path: str | None = None              # also accepted as the request's `model`
    model_aliases: tuple[str, ...] = ()        # more ids a request's `model` may name (vLLM's extra names)
    accept_any_model_name: bool = False        # any `model` is this one (an agent's second, "small" model name)
    api_key: str | None = None
    metrics_api_key: str | None = None         # /metrics is open without it (as in vLLM), takes it with it
    default_chat_template_kwargs: dict = field(default_factory=dict)
    max_num_seqs: int = 1                       # the engine's; splits in-flight requests into running/waiting
    max_waiting: int = 64                       # more waiting requests than this -> 503 + Retry-After
    heartbeat_s: float = 10.0                   # SSE `: ping` after this long without output
    log_interval_s: float = 10.0                # a throughput line (logger gem4.server, info) this often
    max_request_body: int | None = None         # bytes; None: default_body_limit(max_model_len) (inputs.py)
    max_render_s: float = DEFAULT_RENDER_SECONDS  # CPU s after which a chat template render stops, 400 (inputs.py)
    # CORS (vLLM's flags and defaults: any origin, method and header; no credentials)
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    web_ui: bool = True                         # GET / serves the chat page (routes/web.py); --no-web-ui: 404
    responses_store_bytes: int = DEFAULT_RESPONSES_STORE_MB * 2**20   # stored responses (store.py); 0: none
    media_policy: MediaPolicy = field(default_factory=MediaPolicy)  # where media URLs may lead (media_fetch.py)
    # --limit-mm-per-prompt: the most image / video / audio parts one request may carry (inputs.check_media_counts)
    limit_mm_per_prompt: dict = field(default_factory=dict)


class ServerState:
    """Everything the handlers share. Only the event loop thread changes it, except `engine`, which
    the loader thread sets once (a single attribute store)."""

    def __init__(self, config: ServerConfig, engine: EngineLike | None = None):
        self.config = config
        self.engine: EngineLike | None = engine
        self.metrics = Metrics(config.served_model_name, config.max_num_seqs, engine=lambda: self.engine)
        self.created = int(time.time())
        self.requests: set = set()          # the ServerRequests (request.py) admitted and not closed yet
        self.responses = ResponseStore(config.responses_store_bytes) if config.responses_store_bytes > 0 else None
        self.shutting_down = False

    def shut_down(self) -> int:
        """The server is stopping (SIGTERM, Ctrl-C): refuse new requests, and end every open one with an
        error (a stream's error event; a whole reply's 503) and its engine request aborted. -> how many."""
        self.shutting_down = True
        open_ = list(self.requests)
        for req in open_:
            req.shut_down()
        return len(open_)

    def ready_engine(self) -> EngineLike:
        if self.shutting_down:
            raise APIError(503, "The server is shutting down.", type="server_error", code="server_shutting_down")
        if self.engine is None:
            raise APIError(503, "The model is still loading; retry shortly.", type="server_error",
                           code="model_loading", headers={"Retry-After": "1"})
        return self.engine

    def check_model(self, name: str | None) -> None:
        c = self.config
        if name is None or c.accept_any_model_name or name in (c.served_model_name, c.model_path, *c.model_aliases):
            return
        raise APIError(404, f"The model `{name}` does not exist. This server serves "
                            f"`{c.served_model_name}`.", param="model", code="model_not_found")
