"""`gem4 serve`: arguments, model loading and the uvicorn server (see app.py for the thread model).

The socket is bound first and the model loads in a loader thread, so /health answers 503 while it
loads; then one line `gem4: ready at http://HOST:PORT` goes to stdout (`--port 0` picks a free
port and that line tells which). Loading progress and errors go to stderr.

This module imports nothing heavy at import time: `gem4.cli` builds its parser from
`add_arguments` without loading torch or FastAPI.
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object, e.g. '{\"enable_thinking\": true}'")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", help="a .gguf file or an HF checkpoint directory")
    p.add_argument("--demo", action="store_true", help="serve the tiny random-weight demo checkpoint")
    p.add_argument("--tokenizer", help="tokenizer file or directory, if MODEL does not carry one")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000, help="port (0: pick a free one)")
    p.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY`")
    p.add_argument("--served-model-name", default=None, help="the model id clients use (default: MODEL's name)")
    p.add_argument("--max-model-len", type=int, default=None, help="context length cap (prompt + output)")
    p.add_argument("--default-chat-template-kwargs", type=_json_object, default={},
                   help="JSON object of chat template variables, e.g. '{\"enable_thinking\": true}'")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"], help="weight / compute dtype")
    p.add_argument("--device", default="cpu", help="torch device")
    p.add_argument("--max-num-seqs", type=int, default=4, help="requests the engine runs at once")
    p.add_argument("--max-waiting", type=int, default=64, help="queued requests beyond which new ones get 503")
    p.add_argument("--prefill-chunk", type=int, default=256, help="prompt tokens per forward pass")
    p.add_argument("--heartbeat-interval", type=float, default=10.0,
                   help="seconds without output after which a stream gets an SSE `: ping` comment")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _load(args: argparse.Namespace, path: str):
    """-> a gem4.Engine for the checkpoint at `path` (runs in the loader thread)."""
    import gem4

    tokenizer = gem4.Tokenizer.from_file(args.tokenizer or path)
    model = gem4.load(path, dtype=args.dtype, device=args.device, progress=True)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} tokens, the model only "
                         f"{model.config.vocab_size}: they do not belong together")
    return gem4.Engine(model, tokenizer, prefill_chunk=args.prefill_chunk, max_model_len=args.max_model_len,
                       max_num_seqs=args.max_num_seqs)


def serve(args: argparse.Namespace) -> int:
    """Run the server until interrupted. Returns the process exit code."""
    if args.demo == (args.model is not None):
        raise ValueError("give a MODEL (a .gguf file or an HF directory) or --demo, not both" if args.demo
                         else "MODEL is required (a .gguf file or an HF directory), or use --demo")
    for name in ("max_num_seqs", "prefill_chunk"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if args.max_waiting < 0 or args.heartbeat_interval <= 0:
        raise ValueError("--max-waiting must be >= 0 and --heartbeat-interval > 0")

    if args.api_key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        _log(f"gem4: warning: serving on {args.host} without --api-key: anyone who can reach it can use it")

    import uvicorn

    from gem4.server.app import ServerConfig, create_app

    path = args.model
    if args.demo:
        from gem4.demo import NOTICE, ensure_demo

        _log(NOTICE)
        path = str(ensure_demo(_log))
    name = args.served_model_name or ("gem4-demo" if args.demo else Path(path.rstrip("/")).name)
    config = ServerConfig(served_model_name=name, model_path=args.model, api_key=args.api_key,
                          default_chat_template_kwargs=args.default_chat_template_kwargs,
                          max_num_seqs=args.max_num_seqs, max_waiting=args.max_waiting,
                          heartbeat_s=args.heartbeat_interval)
    app = create_app(config)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           timeout_graceful_shutdown=2))
    failure: list[BaseException] = []

    def loader() -> None:
        try:
            engine = _load(args, path)
        except BaseException as e:  # noqa: BLE001 - reported, then the server stops
            failure.append(e)
            _log(f"gem4: error: {e}")
            server.should_exit = True
            return
        while not server.started and not server.should_exit:
            time.sleep(0.02)
        if server.should_exit:
            return
        app.state.gem4.engine = engine
        host, port = server.servers[0].sockets[0].getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        print(f"gem4: serving {name} (max_model_len {engine.max_model_len}); ready at http://{shown}:{port}",
              flush=True)

    threading.Thread(target=loader, name="gem4-loader", daemon=True).start()
    server.run()
    return 1 if failure else 0


def main(argv: list[str] | None = None) -> int:
    """`python -m gem4.server MODEL ...` (the same as `gem4 serve`)."""
    parser = argparse.ArgumentParser(prog="gem4 serve", description="OpenAI-compatible server")
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return serve(args)
    except ValueError as e:
        print(f"gem4: error: {e}", file=sys.stderr)
        return 2
