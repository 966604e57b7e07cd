"""One engine request seen from the event loop: admission, the relay thread, SSE, disconnect -> abort.

Thread model (what runs where):

- **The event loop thread** (uvicorn's asyncio loop) runs every handler: parsing and validating
  requests, building SamplingParams, feeding generated token ids to the output parser
  (`gem4.parser`), formatting JSON and SSE, heartbeats, metrics. It never blocks on the engine.
  Rendering a chat template runs in its own threads (`inputs.render_pool`, bounded in time and
  cancelled when the client leaves), tokenizing text in the default thread pool (`asyncio.to_thread`),
  and `Tokenizer.encode` releases the GIL while it works (4M characters once kept the loop, /health
  included, from running for 15 s). Parsing a body's JSON
  holds the GIL wherever it runs, so it stays on the loop: 1.5 ms (ASCII) to 12 ms (CJK) per MiB,
  0.2 s at most at the largest default body limit (17 MiB, a 256K context).
- **The engine thread** (owned by `gem4.Engine`) is the only one that touches the model. A handler
  calls `engine.submit(prompt_ids, params, request_id=...)` (a short lock, no model work) and gets
  a `Stream`, a per-request queue of `GenerationEvent`s.
- **One relay thread per request** blocks on that Stream and hands each event (or the engine's
  error) to the event loop with `loop.call_soon_threadsafe`; it ends after the request's final
  event, which the engine always sends (finish, abort or error).
- **Disconnects**: a streaming response listens for `http.disconnect` beside the stream, and a
  non-streaming handler races its generation against it. When the client goes away the handler
  calls `engine.abort(request_id)`; the engine checks aborts between steps, so the request stops
  within one step and its KV cache is freed.
- **Loading**: `serve()` (main.py) binds the socket first and loads the model in a loader thread;
  until `ServerState.engine` is set, /health and every model endpoint answer 503 with Retry-After.
"""
from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from gem4.engine import EngineError, GenerationEvent
from gem4.sampling import InvalidParameter, SamplingParams
from gem4.server import protocol as P
from gem4.server.protocol import APIError, bad_request
from gem4.server.state import ServerState

log = logging.getLogger("gem4.server")


def _relay(stream, loop: asyncio.AbstractEventLoop, deliver: Callable[[object], None]) -> None:
    """Relay thread body: engine Stream -> event loop, until the final event or an error."""
    while True:
        try:
            item: object = stream.get()
        except EngineError as e:
            item = e
        except BaseException as e:  # noqa: BLE001 - reported to the request, never lost
            item = EngineError(f"generation failed: {e!r}")
        try:
            loop.call_soon_threadsafe(deliver, item)
        except RuntimeError:        # the loop is closed: the server is shutting down
            return
        if isinstance(item, BaseException) or stream.finished:    # every choice's final event
            return


class ServerShuttingDown(EngineError):
    """Ends a request the engine was still running when the server stopped."""


class ServerRequest:
    """Submit one request to the engine and receive its events on the event loop.

    Metrics are kept as events arrive (`_deliver`), whether or not the handler still reads them,
    so a request that was abandoned is still accounted for when the engine finishes it.
    """

    def __init__(self, state: ServerState, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 n: int = 1, detokenize: bool = True, media=()):
        self.state = state
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.n = n
        self._open = n                  # choices without their final event yet
        self.finished = False           # the engine sent every choice's final event (or failed)
        self.closed = False             # the handler is done with it
        self._queue: asyncio.Queue = asyncio.Queue()
        self._getter: asyncio.Future | None = None
        self._start = time.perf_counter()
        self._first_token: float | None = None
        self._last_token: float | None = None
        self._last_of: dict[int, float] = {}          # choice -> its last token's time (inter-token latency)
        self._n_tokens = 0
        self._ended: dict[int, str] = {}   # choice -> why the server ended it before the engine ("stop", ...)
        self.cached_tokens = 0          # prompt tokens the engine found in its prefix cache

        engine, metrics, config = state.ready_engine(), state.metrics, state.config
        if metrics.in_flight >= config.max_num_seqs + config.max_waiting:
            metrics.request_rejected()
            raise APIError(503, f"The server is busy: {metrics.waiting} requests are already waiting. "
                                "Retry shortly.", type="server_error", code="server_busy",
                           headers={"Retry-After": "1"})
        try:
            stream = engine.submit(prompt_ids, params, request_id=request_id, n=n, detokenize=detokenize,
                                   **({"media": list(media)} if media else {}))
        except InvalidParameter as e:         # checked against the model (top_k, token ids): 400 naming it
            raise bad_request(f"Invalid '{e.param}': {e.reason}", e.param) from None
        except ValueError as e:
            raise bad_request(str(e)) from None
        metrics.request_admitted(len(prompt_ids))
        state.requests.add(self)
        loop = asyncio.get_running_loop()
        threading.Thread(target=_relay, args=(stream, loop, self._deliver), daemon=True,
                         name=f"gem4-relay-{request_id}").start()

    def _deliver(self, item: object) -> None:
        m = self.state.metrics
        if isinstance(item, GenerationEvent):
            now = time.perf_counter()
            self.cached_tokens = max(self.cached_tokens, item.cached_tokens)
            if item.token_id is not None:
                m.generation_tokens += 1
                self._n_tokens += 1
                if self._last_token is None:
                    self._first_token = now
                    m.ttft.observe(now - self._start)
                elif item.index in self._last_of:
                    m.itl.observe(now - self._last_of[item.index])
                self._last_token = self._last_of[item.index] = now
            if item.finished:
                self._open -= 1
                if not self._open:     # a choice the server ended: its reason, not the engine's "abort"
                    self._end(now, self._ended.get(item.index, item.finish_reason))
        else:
            self._end(time.perf_counter(), "error")
        self._queue.put_nowait(item)

    def _end(self, now: float, reason: str | None) -> None:
        if not self.finished:
            self.finished = True
            self.state.metrics.request_ended(now - self._start)
            log.info("%s", self._summary(now, reason))

    def _summary(self, now: float, reason: str | None) -> str:
        """The request's log line: prompt and output tokens, time to first token, decode rate, finish."""
        ttft = "-" if self._first_token is None else f"{(self._first_token - self._start) * 1000:.0f} ms"
        decode = self._n_tokens - 1
        rate = (f"{decode / (now - self._first_token):.1f} tok/s"
                if decode > 0 and now > self._first_token else "-")
        return (f"request {self.request_id}: prompt {len(self.prompt_ids)} tokens ({self.cached_tokens} cached), "
                f"output {self._n_tokens} tokens, TTFT {ttft}, decode {rate}, finish {reason}")

    async def next(self, timeout: float | None = None) -> GenerationEvent | None:
        """The next event; None if `timeout` seconds pass first. Raises EngineError."""
        if self._getter is None:
            self._getter = asyncio.ensure_future(self._queue.get())
        done, _ = await asyncio.wait({self._getter}, timeout=timeout)
        if not done:
            return None
        item, self._getter = self._getter.result(), None
        if isinstance(item, BaseException):
            raise item
        return item

    def shut_down(self) -> None:
        """The server is stopping: end the request here with ServerShuttingDown (the handler's next read
        raises it), before the engine has, and stop its engine request now (not when the engine shuts down)."""
        if not self.finished:
            self._deliver(ServerShuttingDown("the server is shutting down"))   # first: read before the abort's event
            self.state.engine.abort(self.request_id)

    def end_choice(self, index: int, reason: str) -> None:
        """The server ended choice `index` before the engine did, for `reason` (a stop string: "stop", a
        single tool call: "tool_calls"): stop generating it; the request's other choices go on (with one
        choice, `close` stops the request). The request's log line gives `reason`, not the engine's "abort"."""
        self._ended[index] = reason
        if self.n > 1 and not self.finished:
            self.state.engine.abort(self.request_id, index)

    def close(self, reason: str) -> None:
        """The handler is done: count how the client's reply ended; abort the engine request if it
        is still running (a stop string, a single tool call, or a client that went away)."""
        if self.closed:
            return
        self.closed = True
        self.state.requests.discard(self)
        if self._getter is not None:
            self._getter.cancel()
        if not self.finished:
            self.state.engine.abort(self.request_id)
        self.state.metrics.request_finished(reason)


# ---------------------------------------------------------------------------------------------
# Engine errors and SSE
# ---------------------------------------------------------------------------------------------


def engine_error(e: EngineError) -> APIError:
    if isinstance(e, ServerShuttingDown):
        return APIError(503, "The server is shutting down; this request was stopped.", type="server_error",
                        code="server_shutting_down")
    return APIError(500, f"Generation failed: {e}", type="server_error", code="engine_error")


def sse(model) -> str:
    return f"data: {P.dump_json(model)}\n\n"


def sse_error(e: EngineError) -> str:
    return f"data: {json.dumps(engine_error(e).body())}\n\n"


DONE = "data: [DONE]\n\n"
PING = ": ping\n\n"


class EventStream(StreamingResponse):
    """An SSE response that watches for the client going away whatever the ASGI spec version:
    the body iterator is cancelled and `on_close` runs (it aborts the engine request)."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as tg:
                async def body() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:           # the client went away while we wrote
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(body)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            self.on_close()


# ---------------------------------------------------------------------------------------------
# A non-streaming reply, raced against the client's disconnect
# ---------------------------------------------------------------------------------------------


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work) -> Any:
    """Run `work` (a coroutine); if the client disconnects first, cancel it and return None."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:             # the server is shutting down
        task.cancel()
        raise
    finally:
        watch.cancel()
    if task.done():
        return task.result()
    task.cancel()
    return None


async def whole_reply(request: Request, gen: ServerRequest, outs: list, build: Callable[[], Any]):
    """A non-streaming reply: feed each choice's `outs[i]` (ChatOutput / CompletionOutput) until every one
    is done, racing the client's disconnect (-> abort), then `build()` the response object."""
    async def collect():
        while not all(o.done for o in outs):
            ev = await gen.next()
            out = outs[ev.index]
            if out.done:                          # ended by the server: its stop is on the way
                continue
            out.feed(ev)
            if out.done and not ev.finished:
                gen.end_choice(ev.index, out.finish_reason)
        return build()

    try:
        result = await _unless_disconnected(request, collect())
    except EngineError as e:
        gen.close("error")
        raise engine_error(e) from None
    if result is None:                       # nobody is listening any more
        gen.close("abort")
        return Response(status_code=499)
    gen.close(outs[0].finish_reason)
    return P.dump(result)
