"""gem4 on Ray Serve (`pip install 'gem4[ray]'`): replicas of a gem4 engine behind Ray Serve's prefix-aware
request router, with an OpenAI-compatible ingress. For users who already run Ray; docs/replicas.md.

    serve run gem4.server.ray_serve:build args="MODEL --max-num-seqs 8" num_replicas=2

    client -> Ray Serve's HTTP proxy -> Ingress (FastAPI, one replica): reads the body's `messages`,
              `prompt` or `input` text -> handle.remote(Routed) -> Gem4Replica x num_replicas, chosen by
              PrefixCacheAffinityRouter (the replica whose prompts share the longest prefix with this one;
              power-of-two-choices when their queues are uneven) -> gem4's own app, called in-process
              (ASGI, no socket) -> its status, headers and body chunks streamed back

Each replica is a whole `gem4 serve` app (`args` is `gem4 serve`'s command line, parsed by its own parser)
over its own engine: every route, check, error object and stream of `gem4 serve` is the same here, and
what holds for one `gem4 serve` holds for the fleet. A reply says which replica made it in the header
`x-gem4-replica`.

The router: Ray Serve LLM's `PrefixCacheAffinityRouter`, named by its module path. Its public import
(`ray.serve.llm.request_router`) refuses to load without vLLM or SGLang installed; the class itself needs
neither. It reads the prompt from a handle call's first argument's `messages` or `prompt` attribute, and
divides by the text's length: a request with no text (GET /v1/models, a body without prompt) is sent
without that argument, and goes to a replica by power of two choices.

Ray keeps to loopback when started by `build`'s caller with `ray.init(_node_ip_address="127.0.0.1")`
(the test does); Ray Serve's HTTP proxy listens on 127.0.0.1:8000 unless told otherwise.

No `from __future__ import annotations` here: FastAPI reads the ingress handler's parameter types at run
time, through Ray Serve's class-based wrapper, which does not resolve string annotations.
"""
import argparse
import asyncio
import json
import shlex
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from ray import serve
from ray.serve.config import RequestRouterConfig

from gem4.argtypes import ArgParser, check_model_or_demo
from gem4.server.main import add_arguments

PREFIX_ROUTER = ("ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router:"
                 "PrefixCacheAffinityRouter")
_PASSED_HEADERS = ("authorization", "x-api-key", "anthropic-version", "content-type", "accept")


def serve_args(argv: list[str]) -> argparse.Namespace:
    """`gem4 serve`'s arguments from its command line (without `gem4 serve`), checked as the CLI checks them."""
    parser = ArgParser(prog="gem4 serve")
    add_arguments(parser)
    args = parser.parse_args(argv)
    check_model_or_demo(args, parser)
    return args


class Routed:
    """One request on its way to a replica: what the prefix router reads (`messages` or `prompt`) and
    what the replica's app needs (method, path, the headers it reads, the body)."""

    def __init__(self, method: str, path: str, headers: list[tuple[str, str]], body: bytes, text):
        self.method, self.path, self.headers, self.body = method, path, headers, body
        self.messages = text if isinstance(text, list) else None
        self.prompt = text if isinstance(text, str) else None


def routing_text(body: bytes):
    """The text a request's prefix is read from: chat's and Messages' `messages`, completions' `prompt`
    (a string), Responses' `input`; None when there is none (the router then picks by load)."""
    try:
        data = json.loads(body) if body else None
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    for key in ("messages", "prompt", "input"):
        value = data.get(key)
        if isinstance(value, str) and value:
            return value
        if isinstance(value, list) and value and all(isinstance(m, dict) for m in value):
            return value
    return None


async def call_asgi(app, method: str, path: str, headers: list[tuple[str, str]], body: bytes
                    ) -> AsyncIterator[dict]:
    """Run one HTTP request through an ASGI app in this process; yields the app's `http.response.start`
    and `http.response.body` messages as it sends them. Closing the iterator early is the client
    disconnecting (the app's receive() says so, then its task is cancelled)."""
    raw_path, _, query = path.partition("?")
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": method, "scheme": "http", "path": raw_path, "raw_path": raw_path.encode(),
             "query_string": query.encode(), "root_path": "", "client": ("127.0.0.1", 0),
             "server": ("127.0.0.1", 0),
             "headers": [(k.encode(), v.encode()) for k, v in headers] + [(b"content-length", str(len(body)).encode())]}
    sent: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    first = True

    async def receive() -> dict:
        nonlocal first
        if first:
            first = False
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await sent.put(message)

    async def run() -> None:
        try:
            await app(scope, receive, send)
        finally:
            await sent.put(None)

    task = asyncio.create_task(run())
    try:
        while (message := await sent.get()) is not None:
            yield message
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                break
        await task
    finally:
        gone.set()
        if not task.done():
            task.cancel()


@serve.deployment
class Gem4Replica:
    """One `gem4 serve` app and its engine, loaded when the replica starts."""

    def __init__(self, argv: list[str]):
        from gem4.server.app import create_app
        from gem4.server.main import configure_logging, load_engine, model_ids, model_path, server_config

        args = serve_args(argv)
        if getattr(args, "threads", None) is not None:
            import torch

            torch.set_num_threads(args.threads)
        configure_logging(args.log_level)
        path = model_path(args)
        self.app = create_app(server_config(args, model_ids(args, path)), load_engine(args, path))
        self.replica = serve.get_replica_context().replica_id.unique_id

    async def handle(self, request: Routed | None = None, **call) -> AsyncIterator:
        """The app's reply to `request` (or to the keyword form, for requests the router may not read):
        first (status, headers), then the body's chunks."""
        r = request if request is not None else Routed(**call, text=None)
        async for message in call_asgi(self.app, r.method, r.path, r.headers, r.body):
            if message["type"] == "http.response.start":
                headers = [(k.decode(), v.decode()) for k, v in message.get("headers", [])
                           if k.lower() not in (b"content-length", b"transfer-encoding")]
                yield message["status"], headers + [("x-gem4-replica", self.replica)]
            elif message.get("body"):
                yield message["body"]


ingress_app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)


@serve.deployment(ray_actor_options={"num_cpus": 0})     # it only forwards: the replicas get the cores
@serve.ingress(ingress_app)
class Ingress:
    """Every path goes to a replica; a request with prompt text goes through the prefix-aware router."""

    def __init__(self, replicas):
        self.replicas = replicas.options(stream=True)

    @ingress_app.api_route("/{path:path}", methods=["GET", "POST", "DELETE", "OPTIONS"])
    async def forward(self, path: str, request: Request):
        body = await request.body()
        headers = [(k, v) for k, v in request.headers.items() if k.lower() in _PASSED_HEADERS]
        target = "/" + path + (f"?{request.url.query}" if request.url.query else "")
        text = routing_text(body) if request.method == "POST" else None
        if text is not None:
            stream = self.replicas.handle.remote(Routed(request.method, target, headers, body, text))
        else:                                          # nothing for the prefix router to read
            stream = self.replicas.handle.remote(method=request.method, path=target, headers=headers, body=body)
        status, reply_headers = await stream.__anext__()
        media = dict((k.lower(), v) for k, v in reply_headers).get("content-type")
        return StreamingResponse(stream, status_code=status, headers=dict(reply_headers), media_type=media)


def build(config: dict) -> serve.Application:
    """The application `serve run gem4.server.ray_serve:build` starts. `config` (`serve run`'s key=value
    arguments): `args`, `gem4 serve`'s command line for each replica (default "--demo"); `num_replicas`
    (default 2); `num_cpus` per replica (default: --threads, else 1; Ray sets each replica's thread count
    to it)."""
    argv = shlex.split(str(config.get("args", "--demo")))
    args = serve_args(argv)                  # a mistake is said here, before Ray starts anything
    num_cpus = float(config.get("num_cpus", getattr(args, "threads", None) or 1))
    replicas = Gem4Replica.options(
        num_replicas=int(config.get("num_replicas", 2)), ray_actor_options={"num_cpus": num_cpus},
        request_router_config=RequestRouterConfig(request_router_class=PREFIX_ROUTER),
    ).bind(argv)
    return Ingress.bind(replicas)

