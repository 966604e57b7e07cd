"""`gem4 serve`: arguments, model loading and the uvicorn server (see request.py for the thread model).

The socket is bound first and the model loads in a loader thread, so /health answers 503 while it
loads; then one line `gem4: ready at http://HOST:PORT` goes to stdout (`--port 0` picks a free
port and that line tells which). Loading progress and errors go to stderr.

This module imports nothing heavy at import time: `gem4.cli` builds its parser from
`add_arguments` without loading torch or FastAPI.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import signal
import sys
import threading
import time
from pathlib import Path

from gem4.argtypes import (CHAT_TEMPLATE_HELP, EXPERT_SLOTS_HELP, KV_CACHE_DTYPE_CHOICES, KV_CACHE_DTYPE_HELP,
                           MEMORY_LIMIT_HELP, MMPROJ_HELP, SPECULATIVE_HELP, chat_template, int_at_least,
                           non_negative_float, port, positive_float, speculative_config)
from gem4.server.media_fetch import DEFAULT_FETCH_TIMEOUT_S, DEFAULT_MAX_MEDIA_BYTES
from gem4.server.store import DEFAULT_RESPONSES_STORE_MB


# SMG's --policy values that suit replicas of one model (docs/replicas.md)
ROUTER_POLICIES = ("cache_aware", "round_robin", "power_of_two", "least_load", "random", "prefix_hash",
                   "consistent_hashing")


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object, e.g. '{\"enable_thinking\": true}'")
    return value


def _json_list(text: str) -> tuple[str, ...]:
    """vLLM's form of the CORS lists: a JSON list of strings, e.g. '["http://localhost:3000"]'."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"must be a JSON list of strings, e.g. '[\"http://localhost:3000\"]', "
                                         f"got {text!r}")
    return tuple(value)


def limit_mm_per_prompt(text: str) -> dict[str, int]:
    """--limit-mm-per-prompt: vLLM's JSON object of part counts by kind, checked (gem4.server.inputs.parse_mm_limits)."""
    from gem4.server.inputs import parse_mm_limits

    try:
        return parse_mm_limits(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", help="a .gguf file, an HF checkpoint directory or a hub id owner/name[:QUANT]")
    p.add_argument("--demo", action="store_true", help="serve the tiny random-weight demo checkpoint")
    p.add_argument("--tokenizer", help="tokenizer file or directory, if MODEL does not carry one")
    p.add_argument("--mmproj", metavar="FILE", help=MMPROJ_HELP)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=port, default=8000, help="port (0: pick a free one)")
    p.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` (not for /health, "
                                                   "/version and /metrics)")
    p.add_argument("--metrics-api-key", default=None, metavar="KEY",
                   help="require `Authorization: Bearer KEY` for /metrics (default: /metrics is open, as in vLLM)")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="model ids clients may use; the first is the one reported (default: MODEL's file "
                        "stem and file name, or its directory name)")
    p.add_argument("--accept-any-model-name", action="store_true",
                   help="answer a request whatever model it names (as the served model): for agents that also "
                        "ask for a second, smaller model, such as Claude Code's haiku-class one")
    p.add_argument("--max-model-len", type=int_at_least(1), default=None,
                   help="context length cap, prompt + output (default: the model's context length)")
    p.add_argument("--chat-template", type=chat_template, default=None, metavar="FILE", help=CHAT_TEMPLATE_HELP)
    p.add_argument("--default-chat-template-kwargs", type=_json_object, default={},
                   help="JSON object of chat template variables, e.g. '{\"enable_thinking\": true}'")
    p.add_argument("--allowed-origins", type=_json_list, default=("*",), metavar="JSON",
                   help='CORS: origins a browser page may call from, a JSON list (default: ["*"], any origin, as '
                        'vLLM and llama-server do; e.g. \'["http://localhost:3000"]\')')
    p.add_argument("--allowed-methods", type=_json_list, default=("*",), metavar="JSON",
                   help='CORS: allowed methods, a JSON list (default: ["*"])')
    p.add_argument("--allowed-headers", type=_json_list, default=("*",), metavar="JSON",
                   help='CORS: allowed request headers, a JSON list (default: ["*"])')
    p.add_argument("--allow-credentials", action="store_true",
                   help="CORS: allow credentials (cookies, Authorization) in cross-origin requests")
    p.add_argument("--no-web-ui", dest="web_ui", action="store_false",
                   help="do not serve the chat page at / (docs/web.md); the API is unchanged")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="auto = bfloat16, the fast mode; float32 is the reference mode")
    p.add_argument("--device", default="cpu", help="torch device")
    p.add_argument("--threads", type=int_at_least(1), default=argparse.SUPPRESS,
                   help="torch intra-op threads (default: one per core)")
    p.add_argument("--max-num-seqs", type=int_at_least(1), default=8,
                   help="requests decoded together in one pass over the weights (continuous batching)")
    p.add_argument("--max-num-batched-tokens", type=int_at_least(1), default=None,
                   help="tokens per engine step, all requests together (default: max(--prefill-chunk, "
                        "--max-num-seqs)): a long prompt is prefilled a chunk per step beside the decodes")
    p.add_argument("--kv-cache-memory", type=positive_float, default=None, metavar="GB",
                   help="KV cache pool size in GiB (default: room for --max-num-seqs requests of "
                        "--max-model-len, capped at half the available memory); when it is full the newest "
                        "request is preempted and recomputed later")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPE_CHOICES, help=KV_CACHE_DTYPE_HELP)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV cache of the longest cached prefix of each prompt (finished, aborted and "
                        "running requests'), computing only the rest; exact on every layer")
    p.add_argument("--speculative-config", type=speculative_config, default=None, metavar="JSON", help=SPECULATIVE_HELP)
    p.add_argument("--max-waiting", type=int_at_least(0), default=64,
                   help="queued requests beyond which new ones get 503")
    p.add_argument("--prefill-chunk", type=int_at_least(1), default=256, help="prompt tokens per forward pass")
    p.add_argument("--expert-cache-slots", type=int_at_least(1), default=None, metavar="N", help=EXPERT_SLOTS_HELP)
    p.add_argument("--memory-limit", type=positive_float, default=None, metavar="GB", help=MEMORY_LIMIT_HELP)
    p.add_argument("--heartbeat-interval", type=positive_float, default=10.0,
                   help="seconds without output after which a stream gets an SSE `: ping` comment")
    p.add_argument("--max-request-body-mb", type=positive_float, default=None, metavar="MIB",
                   help="largest request body in MiB; a larger one gets 413 before it is read (default: 1 MiB + "
                        "64 bytes per token of max_model_len: the longest Gemma 4 token is 31 characters, a run of "
                        "newlines JSON writes in 62 bytes, and ordinary text takes 4-12 bytes a token, so any "
                        "prompt that fits the context fits the body; 9 MiB for a 128K context)")
    p.add_argument("--max-render-seconds", type=positive_float, default=10.0, metavar="S",
                   help="CPU seconds a chat template render may take; then it stops with a 400 (the official "
                        "template's time grows with the square of the number of messages). A render also stops "
                        "when its client disconnects")
    p.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                   help="take file:// media URLs of files under DIR (symlinks and .. resolved first, so none "
                        "escape it; default: no file URLs)")
    p.add_argument("--allowed-media-domains", nargs="+", default=(), metavar="HOST",
                   help="fetch http(s) media URLs of these hosts (exact names; redirects followed only to them; "
                        "default: no URL is fetched, media come as base64 data URIs)")
    p.add_argument("--allow-media-urls", action="store_true",
                   help="fetch http(s) media URLs of any host (for a trusted network only: the server fetches "
                        "what anonymous clients name)")
    p.add_argument("--media-fetch-timeout", type=positive_float, default=DEFAULT_FETCH_TIMEOUT_S, metavar="S",
                   help="seconds a media URL's whole fetch may take, redirects included; then a 400")
    p.add_argument("--max-media-bytes", type=int_at_least(1), default=DEFAULT_MAX_MEDIA_BYTES, metavar="N",
                   help="bytes one media part may bring (downloaded, read or decoded from base64); a download "
                        "stops as soon as it passes them (default: 20 MiB)")
    p.add_argument("--limit-mm-per-prompt", type=limit_mm_per_prompt, default=None, metavar="JSON",
                   help='the most media parts of each kind one request may carry, vLLM\'s form: \'{"image": 4, '
                        '"video": 1, "audio": 2}\' (a kind left out: 999; 0: none taken); a request with more gets '
                        'a 400 naming the first part past the limit, before any part is fetched or decoded')
    p.add_argument("--responses-store-mb", type=non_negative_float, default=DEFAULT_RESPONSES_STORE_MB, metavar="MIB",
                   help="MiB of memory for the Responses API's stored responses (what previous_response_id and "
                        "GET /v1/responses/{id} read; a request with store: false is not kept), the least "
                        "recently used evicted first; 0: none kept, previous_response_id is a 400")
    p.add_argument("--header-timeout", type=positive_float, default=10.0,
                   help="seconds a connection has to send its request headers, counted from its first byte "
                        "(a new connection: from its opening); then 408 and close")
    p.add_argument("--body-timeout", type=positive_float, default=30.0,
                   help="seconds a request body may go without a byte arriving; then 408 and close")
    p.add_argument("--write-timeout", type=positive_float, default=30.0,
                   help="seconds a response may wait without any of it being sent (the client does not read); "
                        "then the connection is aborted and its request stopped")
    p.add_argument("--shutdown-timeout", type=positive_float, default=2.0,
                   help="on SIGTERM or Ctrl-C, seconds to wait for connections to close after every open "
                        "request has been ended; then the rest are aborted and the process exits")
    p.add_argument("--max-connections", type=int_at_least(1), default=None,
                   help="open connections beyond which a new one gets 503 and is closed (default: --max-num-seqs "
                        "+ --max-waiting + 128: every request the engine may hold, plus idle keep-alive "
                        "connections, /health and /metrics)")
    p.add_argument("--data-parallel-size", "-dp", type=int_at_least(1), default=1, metavar="N",
                   help="N replicas of the engine, each a process on its own share of the cores (and its own GPU "
                        "with --device cuda), behind SMG's cache-aware router on --host/--port: pip install "
                        "'gem4[router]' (docs/replicas.md)")
    p.add_argument("--router-policy", default="cache_aware", choices=ROUTER_POLICIES,
                   help="with --data-parallel-size: how the router picks a replica (SMG's --policy); cache_aware "
                        "sends a prompt where its prefix was last seen")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="info: a line per request and a throughput line every --log-interval seconds")
    p.add_argument("--log-interval", type=positive_float, default=10.0,
                   help="seconds between throughput lines (only while there is traffic)")


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def configure_logging(level: str) -> None:
    """gem4's loggers (`gem4.*`) to stderr at `level`, in one format; uvicorn keeps its own handlers."""
    logger = logging.getLogger("gem4")
    logger.setLevel(level.upper())
    if not any(getattr(h, "gem4", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s", "%m-%d %H:%M:%S"))
        handler.gem4 = True
        logger.addHandler(handler)
        logger.propagate = False


class _NoEarlyReadiness(logging.Filter):
    """Drops uvicorn's start-up lines ("Uvicorn running on ...", "Application startup complete"): they
    come before the model has loaded; gem4's own ready line comes after."""

    EARLY = ("Uvicorn running on", "Application startup complete", "Waiting for application startup",
             "Started server process")

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.EARLY)


def model_ids(args: argparse.Namespace, path: str) -> list[str]:
    """The ids a client may ask for: --served-model-name (the first is reported), else the file's stem and
    name (`gemma-4-E2B-it-Q4_0`, `gemma-4-E2B-it-Q4_0.gguf`), the directory's name, or a hub name as typed
    (`owner/name:TAG`, as vLLM reports a repo id); MODEL as typed too."""
    p = Path(path.rstrip("/"))
    if args.served_model_name:
        names = list(args.served_model_name)
    elif args.demo:
        names = ["gem4-demo"]
    elif p.is_file():
        names = [p.stem, p.name]
    else:
        names = [p.name] if p.is_dir() else [path]
    if args.model is not None and args.model not in names:
        names.append(args.model)
    return list(dict.fromkeys(names))


def max_connections(args: argparse.Namespace) -> int:
    """--max-connections, or room for every request the engine may hold (running + waiting) plus 128
    more: idle keep-alive connections of clients' pools, /health and /metrics."""
    if args.max_connections is not None:
        return args.max_connections
    return args.max_num_seqs + args.max_waiting + 128


def model_path(args: argparse.Namespace) -> str:
    """MODEL as given, or the demo checkpoint's directory (built on first use) with its notice on stderr."""
    if not args.demo:
        return args.model
    from gem4.demo import NOTICE, ensure_demo

    _log(NOTICE)
    return str(ensure_demo(_log))


def server_config(args: argparse.Namespace, names: list[str]):
    """The app's ServerConfig from `gem4 serve`'s arguments; `names` from model_ids."""
    from gem4.server.media_fetch import MediaPolicy
    from gem4.server.state import ServerConfig

    return ServerConfig(served_model_name=names[0], model_aliases=tuple(names[1:]),
                        accept_any_model_name=args.accept_any_model_name, api_key=args.api_key,
                        metrics_api_key=args.metrics_api_key,
                        default_chat_template_kwargs=args.default_chat_template_kwargs,
                        max_num_seqs=args.max_num_seqs, max_waiting=args.max_waiting,
                        heartbeat_s=args.heartbeat_interval, log_interval_s=args.log_interval,
                        max_request_body=None if args.max_request_body_mb is None
                        else int(args.max_request_body_mb * 2**20), max_render_s=args.max_render_seconds,
                        allowed_origins=args.allowed_origins, allowed_methods=args.allowed_methods,
                        allowed_headers=args.allowed_headers, allow_credentials=args.allow_credentials,
                        web_ui=args.web_ui, responses_store_bytes=int(args.responses_store_mb * 2**20),
                        media_policy=MediaPolicy(allowed_local_media_path=args.allowed_local_media_path,
                                                 allowed_media_domains=tuple(args.allowed_media_domains),
                                                 allow_media_urls=args.allow_media_urls,
                                                 fetch_timeout_s=args.media_fetch_timeout,
                                                 max_media_bytes=args.max_media_bytes),
                        limit_mm_per_prompt=args.limit_mm_per_prompt or {})


def load_engine(args: argparse.Namespace, path: str):
    """-> a gem4.Engine for the checkpoint at `path` (`gem4 serve` runs it in its loader thread)."""
    from gem4.launch import open_engine
    from gem4.weights.hub import resolve

    path = str(resolve(path, _log))                     # a local path as is; owner/name[:TAG] from the hub
    return open_engine(args, path, _log, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens,
                       kv_cache_bytes=None if args.kv_cache_memory is None else int(args.kv_cache_memory * 2**30))


def bind(host: str, port_: int):
    """The listening socket, bound before anything loads; an address that cannot be had is one ValueError
    naming it and the way out (uvicorn would log a traceback-like line and its shutdown steps)."""
    import errno
    import socket

    try:
        infos = socket.getaddrinfo(host, port_, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"cannot serve on {host}: {e.strerror} (--host takes an address or a host name)") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as uvicorn: a restart reuses the port at once
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        where = f"{host}:{port_}" if ":" not in host else f"[{host}]:{port_}"
        if e.errno == errno.EADDRINUSE:
            raise ValueError(f"port {port_} on {host} is already in use (another server?): stop it, or pass "
                             f"--port N (--port 0 picks a free port)") from None
        if e.errno == errno.EACCES:
            raise ValueError(f"no permission to listen on {where} (ports below 1024 need privileges): "
                             f"pass --port N with N >= 1024") from None
        raise ValueError(f"cannot listen on {where}: {e.strerror}") from None
    sock.set_inheritable(True)
    return sock


def startup_summary(name: str, engine) -> str:
    """One line: model, variant, dtype, kernels, threads, context and the KV pool."""
    import torch

    from gem4.kv_cache import kv_dtype_name

    model, config, pool = engine.model, engine.model.config, engine.pool_size
    dtype = str(model.dtype).removeprefix("torch.")
    return (f"gem4: model {name}: Gemma 4 {config.variant}, {config.num_layers} layers, {dtype}, compiled kernels "
            f"{'on' if model.backend == 'cpu' else 'off'}, {torch.get_num_threads()} threads, max_model_len "
            f"{engine.max_model_len}, KV cache {pool.total_bytes / 2**30:.2f} GiB "
            f"{kv_dtype_name(engine.kv_cache_dtype)} ({pool.tokens} tokens, {pool.num_seqs} sequences), prefix caching {'on' if engine.prefix_caching else 'off'}"
            + ("" if engine.speculative_config is None else
               f", speculative {engine.speculative_config.method} K={engine.speculative_config.num_speculative_tokens}"))


def serve(args: argparse.Namespace) -> int:
    """Run the server until interrupted. Returns the process exit code."""
    if args.api_key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        _log(f"gem4: warning: serving on {args.host} without --api-key: anyone who can reach it can use it")
    if args.data_parallel_size > 1:
        from gem4.server.replicas import serve_replicas

        return serve_replicas(args)
    if getattr(args, "threads", None) is not None:
        import torch

        torch.set_num_threads(args.threads)
    configure_logging(args.log_level)
    sock = bind(args.host, args.port)                  # first: a busy port is said before anything loads

    import uvicorn

    from gem4.server.app import create_app
    from gem4.server.http11 import guarded_protocol

    path = model_path(args)
    names = model_ids(args, path)
    app = create_app(server_config(args, names))
    http = guarded_protocol(header_timeout=args.header_timeout, body_timeout=args.body_timeout,
                            write_timeout=args.write_timeout, max_connections=max_connections(args))
    # loop="asyncio": the same event loop whatever else is installed (uvicorn's default takes uvloop when it is
    # there, and the gem4[ray] extra brings it)
    server = _uvicorn_server(uvicorn.Config(app, log_level=args.log_level, access_log=args.log_level == "debug",
                                            timeout_graceful_shutdown=args.shutdown_timeout + _CANCEL_AFTER_S,
                                            http=http, loop="asyncio"),
                             app.state.gem4, args.shutdown_timeout)
    logging.getLogger("uvicorn.error").addFilter(_NoEarlyReadiness())
    _log(f"gem4: loading {path} ...")
    failure: list[BaseException] = []
    loaded: list = []

    def loader() -> None:
        try:
            engine = load_engine(args, path)
        except BaseException as e:  # noqa: BLE001 - reported, then the server stops
            failure.append(e)
            _log(f"gem4: error: {e}")
            server.should_exit = True
            return
        loaded.append(engine)
        while not server.started and not server.should_exit:
            time.sleep(0.02)
        if server.should_exit:
            return
        app.state.gem4.engine = engine
        host, port_ = server.servers[0].sockets[0].getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        _log(startup_summary(names[0], engine))
        print(f"gem4: serving {', '.join(names)}; ready at http://{shown}:{port_}", flush=True)

    thread = threading.Thread(target=loader, name="gem4-loader", daemon=True)
    thread.start()
    server.run(sockets=[sock])
    for engine in loaded:                               # the engine thread ends before the process does
        engine.shutdown()
    if failure:
        return 1
    return 130 if server.signal == signal.SIGINT else 0


_CANCEL_AFTER_S = 2.0     # after the shutdown timeout: for the handlers of the connections it aborted to end


def _uvicorn_server(config, state, shutdown_timeout: float):
    """uvicorn's Server, with gem4's shutdown: on SIGTERM or Ctrl-C every open request ends at once (a stream
    with an error event, then [DONE]; its engine request aborted) instead of uvicorn waiting for it and
    then cutting it; the server then waits up to `shutdown_timeout` (--shutdown-timeout) for the connections
    to close and aborts the ones still open (a client that does not read, whose last bytes cannot be
    flushed) rather than leaving them to the process's end. Their handlers see the client gone and end as on
    any disconnect, a stream's too while it waits to write: uvicorn's own timeout (`config`'s, set
    `_CANCEL_AFTER_S` later) cancels only a handler that still runs after that, and logs each one it cancels
    as an exception in the application. The process exits 0 (130 after Ctrl-C) rather than dying of the
    signal again. `.signal` is the signal that stopped it."""
    import uvicorn

    class Server(uvicorn.Server):
        signal: int | None = None

        @contextlib.contextmanager
        def capture_signals(self):                      # uvicorn's re-raises the signal after the shutdown
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

        def handle_exit(self, sig: int, frame) -> None:
            if self.signal is None:
                self.signal = sig
                _log(f"gem4: {signal.Signals(sig).name}: shutting down")
            super().handle_exit(sig, frame)

        async def shutdown(self, sockets=None) -> None:
            stopped = state.shut_down()
            if stopped:
                _log(f"gem4: stopped {stopped} running request{'s' if stopped != 1 else ''}")
            cut = asyncio.get_running_loop().call_later(shutdown_timeout, self._abort_open)
            try:
                await super().shutdown(sockets)
            finally:
                cut.cancel()
                self._abort_open()

        def _abort_open(self) -> None:
            left = list(self.server_state.connections)
            for connection in left:
                connection.transport.abort()
            if left:
                _log(f"gem4: aborted {len(left)} connection{'s' if len(left) != 1 else ''} that did not "
                     f"close within {shutdown_timeout:g} s (--shutdown-timeout)")

    return Server(config)
