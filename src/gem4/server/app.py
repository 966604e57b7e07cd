"""The OpenAI-compatible HTTP server: routes, SSE streaming, OpenAI errors, disconnect -> abort.

    POST /v1/chat/completions   chat (messages, tools, thinking), stream or not
    POST /v1/completions        raw text completion, stream or not
    GET  /v1/models[/{id}]      the served model, with max_model_len
    GET  /health                200 when ready, 503 while the model loads
    GET  /version               {"version": gem4's}
    POST /tokenize, /detokenize vLLM's bodies
    GET  /metrics               Prometheus text, `gem4:*` (metrics.py)

Thread model (what runs where):

- **The event loop thread** (uvicorn's asyncio loop) runs every handler: parsing and validating
  requests, building SamplingParams, feeding generated token ids to the output parser
  (`gem4.parser`), formatting JSON and SSE, heartbeats, metrics. It never blocks on the engine.
  Rendering a chat template and tokenizing run in the default thread pool (`asyncio.to_thread`),
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

Bounded work before admission (each limit refuses before the work it bounds):

- **Body size** (`ServerConfig.max_request_body`, default 1 MiB + 64 bytes per token of
  max_model_len, see `default_body_limit`): 413 when Content-Length says more (nothing is read),
  or as soon as a chunked body passes it. Authentication (a dependency) runs before any body is
  read; `http11.py` closes a connection whose request was answered before its body arrived.
- **Characters before tokens**: no token stands for more than `Tokenizer.max_token_chars` characters (31
  for Gemma 4), so a text of n characters is at least n / 31 tokens. A completion prompt, the
  user/system/developer texts of a chat (before rendering), and the rendered chat prompt (before
  tokenizing, whatever the template did) that cannot fit max_model_len that way get the
  context-length 400 without being tokenized. The exact token check follows for the rest.

The server never sees tensors: requests go in as token ids and SamplingParams, results come back
as token ids, text and floats.

Chat output: the token ids of each event go through `Gemma4Parser` (prompt-aware, so a prompt that
leaves a thought channel open is read as reasoning). Reasoning goes to `reasoning_content` (and
`reasoning`), tool calls to `tool_calls` (only calls to declared tools; anything else stays
content), the rest to `content`. Stop strings apply to the content, server side: when one
matches, the reply ends there and the engine request is aborted. With `parallel_tool_calls=false`
the reply ends after the first complete call the same way. Streaming and non-streaming run the
same code (`ChatOutput`), so they give the same message for the same seed.

Several choices (`n`, at most the server's max_num_seqs: the engine runs a request's choices at once and
answers 400 naming `n` beyond that): one engine request, its prompt computed once; its events carry the
choice index and each choice has its own `ChatOutput` / `CompletionOutput` (stop strings, tool calls,
finish_reason, logprobs per choice). As vLLM's server does: `choices[i].index` is i; a stream opens
with a role chunk per choice, then each chunk carries one choice's delta, and each choice ends with its
own finish chunk; usage counts the prompt once and the completion tokens of every choice. A choice that
the server ends early (a stop string, a single tool call) is cut from the reply there and stopped in the
engine (`Engine.abort(request_id, index)`) while the other choices go on.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import (
    JSONResponse,
    PlainTextResponse,
    Response,
    StreamingResponse,
)
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from gem4 import __version__
from gem4.chat import ChatTemplateError, encode_prompt
from gem4.engine import EngineError, GenerationEvent
from gem4.engine.sequence import StopStrings
from gem4.parser import (
    ContentDelta,
    Gemma4Parser,
    ReasoningDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
)
from gem4.sampling import InvalidParameter, SamplingParams
from gem4.server import protocol as P
from gem4.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE, Metrics
from gem4.server.protocol import APIError, bad_request

log = logging.getLogger("gem4.server")

# names encode_prompt / the renderers take themselves: never template variables from a request
_RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "template", "tokenizer", "add_generation_prompt",
                                       "documents", "bos_token", "eos_token", "unk_token", "pad_token",
                                       "mask_token"})


class EngineLike(Protocol):
    """What the server needs of an engine (`gem4.Engine` is one). Read by /metrics when present, not
    required: `request_counts()`, `kv_cache_usage`, `num_preemptions`, `prefix_cache_counts`, `step_tokens`,
    `batch_sizes`."""

    tokenizer: Any
    max_model_len: int
    vocab_size: int

    def submit(self, prompt: list[int], params: SamplingParams, *, request_id: str, n: int = 1): ...

    def abort(self, request_id: str) -> bool: ...


@dataclass
class ServerConfig:
    served_model_name: str                     # the id /v1/models and every response report
    model_path: str | None = None              # also accepted as the request's `model`
    model_aliases: tuple[str, ...] = ()        # more ids a request's `model` may name (vLLM's extra names)
    api_key: str | None = None
    default_chat_template_kwargs: dict = field(default_factory=dict)
    max_num_seqs: int = 1                       # the engine's; splits in-flight requests into running/waiting
    max_waiting: int = 64                       # more waiting requests than this -> 503 + Retry-After
    heartbeat_s: float = 10.0                   # SSE `: ping` after this long without output
    log_interval_s: float = 10.0                # a throughput line (logger gem4.server, info) this often
    max_request_body: int | None = None         # bytes; None: default_body_limit(max_model_len)
    # CORS (vLLM's flags and defaults: any origin, method and header; no credentials)
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False


class ServerState:
    """Everything the handlers share. Only the event loop thread changes it, except `engine`, which
    the loader thread sets once (a single attribute store)."""

    def __init__(self, config: ServerConfig, engine: EngineLike | None = None):
        self.config = config
        self.engine: EngineLike | None = engine
        self.metrics = Metrics(config.served_model_name, config.max_num_seqs, engine=lambda: self.engine)
        self.created = int(time.time())
        self.generations: set[Generation] = set()   # admitted and not closed yet
        self.shutting_down = False

    def shut_down(self) -> int:
        """The server is stopping (SIGTERM, Ctrl-C): refuse new requests, and end every open one with an
        error (a stream's error event; a whole reply's 503) and its engine request aborted. -> how many."""
        self.shutting_down = True
        open_ = list(self.generations)
        for gen in open_:
            gen.fail(ServerShuttingDown("the server is shutting down"))
        return len(open_)

    def ready_engine(self) -> EngineLike:
        if self.shutting_down:
            raise APIError(503, "The server is shutting down.", type="server_error", code="server_shutting_down")
        if self.engine is None:
            raise APIError(503, "The model is still loading; retry shortly.", type="server_error",
                           code="model_loading", headers={"Retry-After": "1"})
        return self.engine

    def body_limit(self) -> int:
        """The largest request body accepted, in bytes (503 while loading if it depends on the model)."""
        if self.config.max_request_body is not None:
            return self.config.max_request_body
        return default_body_limit(self.ready_engine().max_model_len)

    def check_model(self, name: str | None) -> None:
        c = self.config
        if name is None or name in (c.served_model_name, c.model_path, *c.model_aliases):
            return
        raise APIError(404, f"The model `{name}` does not exist. This server serves "
                            f"`{c.served_model_name}`.", param="model", code="model_not_found")


# ---------------------------------------------------------------------------------------------
# One engine request, seen from the event loop
# ---------------------------------------------------------------------------------------------


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


class Generation:
    """Submit one request to the engine and receive its events on the event loop.

    Metrics are kept as events arrive (`_deliver`), whether or not the handler still reads them,
    so a request that was abandoned is still accounted for when the engine finishes it.
    """

    def __init__(self, state: ServerState, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 n: int = 1):
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
        self.cached_tokens = 0          # prompt tokens the engine found in its prefix cache

        engine, metrics, config = state.ready_engine(), state.metrics, state.config
        if metrics.in_flight >= config.max_num_seqs + config.max_waiting:
            metrics.request_rejected()
            raise APIError(503, f"The server is busy: {metrics.waiting} requests are already waiting. "
                                "Retry shortly.", type="server_error", code="server_busy",
                           headers={"Retry-After": "1"})
        try:
            stream = engine.submit(prompt_ids, params, request_id=request_id, n=n)
        except InvalidParameter as e:         # checked against the model (top_k, token ids): 400 naming it
            raise bad_request(f"Invalid '{e.param}': {e.reason}", e.param) from None
        except ValueError as e:
            raise bad_request(str(e)) from None
        metrics.request_admitted(len(prompt_ids))
        state.generations.add(self)
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
                if not self._open:
                    self._end(now, item.finish_reason)
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

    def fail(self, error: EngineError) -> None:
        """End the request here with `error` (the handler's next read raises it), before the engine has."""
        if not self.finished:
            self._deliver(error)

    def end_choice(self, index: int) -> None:
        """The server ended choice `index` before the engine did (a stop string, a single tool call): stop
        generating it; the request's other choices go on (with one choice, `close` stops the request)."""
        if self.n > 1 and not self.finished:
            self.state.engine.abort(self.request_id, index)

    def close(self, reason: str) -> None:
        """The handler is done: count how the client's reply ended; abort the engine request if it
        is still running (a stop string, a single tool call, or a client that went away)."""
        if self.closed:
            return
        self.closed = True
        self.state.generations.discard(self)
        if self._getter is not None:
            self._getter.cancel()
        if not self.finished:
            self.state.engine.abort(self.request_id)
        self.state.metrics.request_finished(reason)


# ---------------------------------------------------------------------------------------------
# Chat output: engine events -> OpenAI deltas and the final message
# ---------------------------------------------------------------------------------------------


@dataclass
class _Call:
    id: str
    name: str
    arguments: str = ""


class ChatOutput:
    """Turns one chat request's engine events into OpenAI deltas; keeps the final message.

    `feed(event)` returns the deltas the event made certain; `done` is set when the reply is
    complete (the engine finished, or the server ended it early: a stop string, or the first tool
    call with parallel_tool_calls=false).
    """

    def __init__(self, tokenizer, prompt_ids: list[int], *, tool_names: frozenset[str], stop: list[str],
                 parallel_tool_calls: bool, logprobs: bool, top_logprobs: int):
        self.tokenizer = tokenizer
        self.parser = Gemma4Parser(tokenizer, prompt_ids=prompt_ids, tool_names=tool_names)
        self.stops = StopStrings(stop)
        self.parallel = parallel_tool_calls
        self.want_logprobs = logprobs
        self.top_logprobs = top_logprobs
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls: list[_Call] = []
        self.n_tokens = 0
        self.done = False
        self.finish_reason: str | None = None
        self._early: str | None = None            # the server ended the reply: "stop" | "tool_calls"
        self._logprobs: list[P.TokenLogprob] = []  # every token's, for the final message
        self._pending = 0                          # how many of them no chunk has carried yet

    # ---- input ----

    def feed(self, event: GenerationEvent) -> list[P.ChatDelta]:
        if self.done:
            return []
        deltas: list[P.ChatDelta] = []
        if event.token_id is not None:
            self.n_tokens += 1
            if self.want_logprobs and event.logprob is not None:
                self._logprobs.append(token_logprob(self.tokenizer, event.token_id, event.logprob,
                                                    event.top_logprobs or [], self.top_logprobs))
                self._pending += 1
            deltas += self._events(self.parser.feed([event.token_id]))
        if self._early is None and event.finished:
            deltas += self._events(self.parser.finish())
        if self._early is not None or event.finished:
            deltas += self._flush_content()
            self.done = True
            self.finish_reason = self._early or self._engine_reason(event.finish_reason)
        return deltas

    def _engine_reason(self, reason: str | None) -> str:
        if reason == "length":
            return "length"
        if reason == "abort":
            return "abort"
        return "tool_calls" if self.calls else "stop"

    def _events(self, events) -> list[P.ChatDelta]:
        out: list[P.ChatDelta] = []
        for e in events:
            if self._early is not None:
                break
            if isinstance(e, ContentDelta):
                text, matched = self.stops.feed(e.text)
                out += self._content_delta(text)
                if matched is not None:
                    self._early = "stop"
                continue
            out += self._flush_content()          # stop strings do not span structure
            if isinstance(e, ReasoningDelta):
                if e.text:
                    self.reasoning.append(e.text)
                    out.append(P.ChatDelta(reasoning_content=e.text, reasoning=e.text))
            elif isinstance(e, ToolCallStart):
                self.calls.append(_Call(e.id, e.name))
                out.append(P.ChatDelta(tool_calls=[P.ToolCallOut(
                    index=e.index, id=e.id, type="function", function=P.FunctionCallOut(name=e.name, arguments=""))]))
            elif isinstance(e, ToolCallArgsDelta):
                self.calls[e.index].arguments += e.text
                out.append(P.ChatDelta(tool_calls=[P.ToolCallOut(
                    index=e.index, function=P.FunctionCallOut(arguments=e.text))]))
            elif isinstance(e, ToolCallEnd):
                self.calls[e.index].arguments = e.arguments
                if not self.parallel:
                    self._early = "tool_calls"
        return out

    def _content_delta(self, text: str) -> list[P.ChatDelta]:
        if not text:
            return []
        self.content.append(text)
        return [P.ChatDelta(content=text)]

    def _flush_content(self) -> list[P.ChatDelta]:
        return self._content_delta(self.stops.flush()) if self._early != "stop" else []

    # ---- output ----

    def take_logprobs(self) -> P.ChoiceLogprobs | None:
        """The logprobs of the tokens no chunk has carried yet (streaming)."""
        if not self.want_logprobs or not self._pending:
            return None
        items = self._logprobs[len(self._logprobs) - self._pending:]
        self._pending = 0
        return P.ChoiceLogprobs(content=items)

    def message(self) -> P.ChatMessage:
        content = "".join(self.content)
        msg = P.ChatMessage(role="assistant", content=content if content or not self.calls else None)
        reasoning = "".join(self.reasoning)
        if reasoning:
            msg.reasoning_content = reasoning
            msg.reasoning = reasoning
        if self.calls:
            msg.tool_calls = [P.ToolCallOut(id=c.id, type="function",
                                            function=P.FunctionCallOut(name=c.name, arguments=c.arguments))
                              for c in self.calls]
        return msg

    def choice_logprobs(self) -> P.ChoiceLogprobs | None:
        return P.ChoiceLogprobs(content=list(self._logprobs)) if self.want_logprobs else None


def _token_text(tokenizer, token_id: int) -> tuple[str, list[int]]:
    raw = tokenizer.piece_bytes(token_id)
    return raw.decode("utf-8", errors="replace"), list(raw)


def token_logprob(tokenizer, token_id: int, logprob: float, top: list[tuple[int, float]], n_top: int):
    text, raw = _token_text(tokenizer, token_id)
    tops = []
    for t, lp in top[:n_top]:
        t_text, t_raw = _token_text(tokenizer, t)
        tops.append(P.TopLogprob(token=t_text, logprob=lp, bytes=t_raw))
    return P.TokenLogprob(token=text, logprob=logprob, bytes=raw, top_logprobs=tops)


# ---------------------------------------------------------------------------------------------
# Requests -> prompt ids and SamplingParams
# ---------------------------------------------------------------------------------------------


def _message_dict(m) -> dict:
    """A validated message as the plain dict `gem4.chat` renders."""
    d: dict[str, Any] = {"role": m.role}
    if m.role in ("system", "developer"):
        d["content"] = P.content_text(m.content)      # the templates expect a string here
    elif m.content is not None:
        d["content"] = m.content
    if m.name is not None:
        d["name"] = m.name
    if m.role == "assistant":
        if m.tool_calls:
            d["tool_calls"] = [{"id": c.id, "type": "function",
                                "function": {"name": c.function.name, "arguments": c.function.arguments}}
                               for c in m.tool_calls]
        if m.reasoning_content is not None or m.reasoning is not None:
            d["reasoning_content"] = m.reasoning_content if m.reasoning_content is not None else m.reasoning
        if "content" not in d:
            d["content"] = None
    if m.role == "tool":
        d["tool_call_id"] = m.tool_call_id
    return d


def _template_kwargs(defaults: dict, requested: dict | None) -> tuple[bool, dict]:
    kwargs = {**defaults, **(requested or {})}
    bad = sorted(set(kwargs) & _RESERVED_TEMPLATE_KWARGS)
    if bad:
        raise bad_request(f"chat_template_kwargs may not set {', '.join(bad)}", "chat_template_kwargs")
    thinking = kwargs.pop("enable_thinking", False)
    if not isinstance(thinking, bool):
        raise bad_request("chat_template_kwargs.enable_thinking must be a boolean", "chat_template_kwargs")
    return thinking, kwargs


def render_chat(tokenizer, messages, tools, *, add_generation_prompt: bool, enable_thinking: bool,
                kwargs: dict) -> list[int]:
    """Render + tokenize (runs in the thread pool); template failures are the request's fault."""
    import jinja2

    try:
        return encode_prompt(tokenizer, messages, tools, add_generation_prompt=add_generation_prompt,
                             enable_thinking=enable_thinking, **kwargs)
    except ChatTemplateError as e:
        raise bad_request(f"The chat template rejected the messages: {e}", "messages") from None
    except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError) as e:
        raise bad_request(f"The chat template could not render the request: {type(e).__name__}: {e}",
                          "messages") from None


def _tools_for(req: P.ChatCompletionRequest) -> tuple[list[dict] | None, frozenset[str]]:
    """The tools the template declares and the parser accepts, from tools + tool_choice."""
    choice = req.tool_choice
    if isinstance(choice, P.NamedToolChoice) or choice == "required":
        what = f"a named tool_choice ({choice.function.name!r})" if isinstance(choice, P.NamedToolChoice) \
            else "tool_choice 'required'"
        raise bad_request(f"{what} is not supported yet: forcing a tool call needs constrained decoding. "
                          "Use 'auto' or 'none'.", "tool_choice")
    if not req.tools or choice == "none":
        return None, frozenset()
    names = [t.function.name for t in req.tools]
    if len(set(names)) != len(names):
        raise bad_request("tool function names must be unique", "tools")
    tools = [t.model_dump(exclude_none=True) for t in req.tools]
    return tools, frozenset(names)


def _sampling(req: P._SamplingRequest, vocab_size: int, *, max_tokens: int | None, stop: list[str],
              logprobs: bool, top_logprobs: int) -> SamplingParams:
    bias = {int(k): v for k, v in (req.logit_bias or {}).items()}
    for name, ids in (("logit_bias", bias), ("stop_token_ids", req.stop_token_ids or [])):
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise bad_request(f"token id {bad} in {name} is outside the vocabulary [0, {vocab_size})", name)
    try:
        return SamplingParams(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None else req.top_k,
            min_p=0.0 if req.min_p is None else req.min_p,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            logit_bias=bias,
            seed=req.seed,
            max_tokens=max_tokens,
            stop=stop,
            stop_token_ids=req.stop_token_ids or (),
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
        )
    except InvalidParameter as e:
        raise bad_request(f"Invalid '{e.param}': {e.reason}", e.param) from None


def _check_length(n_prompt: int, max_tokens: int | None, max_model_len: int, where: str,
                  max_tokens_name: str = "max_tokens") -> None:
    """OpenAI's context_length_exceeded error (in vLLM's words), before the engine sees the request: a prompt
    that leaves no room for one token names the prompt (`where`), a prompt that fits with a `max_tokens` that
    does not names max_tokens, each with the context length, the prompt's tokens and the tokens requested."""
    if n_prompt >= max_model_len:
        raise bad_request(f"This model's maximum context length is {max_model_len} tokens. However, your request "
                          f"has {n_prompt} input tokens. Please reduce the length of the {where}.", where,
                          code="context_length_exceeded")
    if max_tokens is not None and n_prompt + max_tokens > max_model_len:
        raise bad_request(f"'{max_tokens_name}' is too large: {max_tokens}. This model's maximum context length is "
                          f"{max_model_len} tokens and your request has {n_prompt} input tokens ({max_tokens} > "
                          f"{max_model_len} - {n_prompt}).", max_tokens_name, code="context_length_exceeded")


# ---------------------------------------------------------------------------------------------
# Bounded work before admission: body size, characters before tokens
# ---------------------------------------------------------------------------------------------


def default_body_limit(max_model_len: int) -> int:
    """1 MiB + 64 bytes per context token. The longest Gemma 4 token is 31 characters (a run of
    newlines, tabs or spaces), which JSON writes in at most 62 bytes (`\\n` escapes); ordinary text
    takes 4-12 bytes a token, a token-id prompt at most 7. So any prompt that fits the context fits
    the body, and the MiB is room for tools and parameters: 9 MiB for a 128K context."""
    return 2**20 + 64 * max_model_len


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it is known to pass `limit` bytes: before
    reading anything when Content-Length says so, else while the chunks arrive (a chunked body is
    never held beyond the limit plus one chunk). `Connection: close` goes with the 413, so the
    server does not read the rest only to discard it."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(f"{int(declared)} bytes", limit)
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(f"more than {limit} bytes", limit)
            chunks.append(chunk)
    except ClientDisconnect:
        # nobody will read this answer; it only ends the handler (a body timeout, or the client left)
        raise bad_request("The client closed the connection before the request body was complete.") from None
    return b"".join(chunks)


def _too_large(size: str, limit: int) -> APIError:
    return APIError(413, f"The request body is {size}; this server accepts at most {limit} bytes "
                         f"({limit / 2**20:.2f} MiB, --max-request-body-mb).", code="request_too_large",
                    headers={"Connection": "close"})


def _check_chars(n_chars: int, token_chars: int | None, max_model_len: int, where: str, room: int = 1) -> None:
    """The early bound: refuse a text of `n_chars` characters that cannot fit the context, leaving `room`
    tokens (1 to generate; 0 for /tokenize), even as ceil(n_chars / token_chars) tokens, without tokenizing
    it. A text that may fit is tokenized (its cost is bounded by the context) and `_check_length` says
    exactly what does not fit, max_tokens included."""
    if token_chars is None:
        return
    least = -(-n_chars // token_chars)
    if least > max_model_len - room:
        raise bad_request(f"This model's maximum context length is {max_model_len} tokens. However, your {where} "
                          f"({n_chars} characters) would be at least {least} tokens (no token is longer than "
                          f"{token_chars} characters). Please reduce the length of the {where}.", where,
                          code="context_length_exceeded")


def _chat_chars(messages) -> int:
    """Characters every Gemma 4 chat template renders as they are: the texts of user, system and
    developer messages, trimmed as the templates trim them. Assistant text may lose its thinking and
    tool results may be dropped, so they are not counted: this is a lower bound on the rendered
    prompt's length, checked before rendering; the rendered prompt itself is checked too
    (`_PromptTokenizer`)."""
    n = 0
    for m in messages:
        if m.role in ("user", "system", "developer") and m.content is not None:
            texts = [m.content] if isinstance(m.content, str) else [p["text"] for p in m.content]
            n += sum(len(t.strip()) for t in texts)
    return n


class _PromptTokenizer:
    """The engine's tokenizer as `render_chat` passes it to `encode_prompt`: the rendered prompt is
    held to the early character bound (`check(n_chars)`) before it is tokenized, whatever the
    template rendered. Everything else is the tokenizer's own."""

    def __init__(self, tokenizer, check: Callable[[int], None]):
        self._tokenizer = tokenizer
        self._check = check

    def __getattr__(self, name: str):
        return getattr(self._tokenizer, name)

    def encode(self, text: str, **kwargs) -> list[int]:
        self._check(len(text))
        return self._tokenizer.encode(text, **kwargs)


def _vocab_size(engine: EngineLike) -> int:
    return getattr(engine, "vocab_size", None) or engine.tokenizer.vocab_size


def _usage(gen: Generation, outs) -> P.Usage:
    """The request's usage: the prompt once, the completion tokens of every choice, and the prompt tokens
    read from the prefix cache (OpenAI's prompt_tokens_details.cached_tokens)."""
    n_prompt, n_completion = len(gen.prompt_ids), sum(o.n_tokens for o in outs)
    return P.Usage(prompt_tokens=n_prompt, completion_tokens=n_completion, total_tokens=n_prompt + n_completion,
                   prompt_tokens_details=P.PromptTokensDetails(cached_tokens=gen.cached_tokens))


def _sse(model) -> str:
    return f"data: {P.dump_json(model)}\n\n"


def _engine_error(e: EngineError) -> APIError:
    if isinstance(e, ServerShuttingDown):
        return APIError(503, "The server is shutting down; this request was stopped.", type="server_error",
                        code="server_shutting_down")
    return APIError(500, f"Generation failed: {e}", type="server_error", code="engine_error")


def _sse_error(e: EngineError) -> str:
    return f"data: {json.dumps(_engine_error(e).body())}\n\n"


_DONE = "data: [DONE]\n\n"
_PING = ": ping\n\n"


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


async def _whole_reply(request: Request, gen: Generation, outs: list, build: Callable[[], Any]):
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
                gen.end_choice(ev.index)
        return build()

    try:
        result = await _unless_disconnected(request, collect())
    except EngineError as e:
        gen.close("error")
        raise _engine_error(e) from None
    if result is None:                       # nobody is listening any more
        gen.close("abort")
        return Response(status_code=499)
    gen.close(outs[0].finish_reason)
    return P.dump(result)


# ---------------------------------------------------------------------------------------------
# The app
# ---------------------------------------------------------------------------------------------


async def _log_throughput(state: ServerState) -> None:
    """Every `log_interval_s` while there is traffic: one line of prompt and generation throughput and
    the running / waiting counts (vLLM's periodic stats line)."""
    state.metrics.throughput_line(time.monotonic())      # the first interval starts now
    while True:
        await asyncio.sleep(state.config.log_interval_s)
        line = state.metrics.throughput_line(time.monotonic())
        if line is not None:
            log.info("%s", line)


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

    # ---- errors: always OpenAI error objects ----

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError):
        errs = e.errors()
        param = P._param_path(tuple(x for x in errs[0].get("loc", ()) if x != "body")) if errs else None
        msg = errs[0].get("msg", "invalid request") if errs else "invalid request"
        return JSONResponse(bad_request(msg, param).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
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

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):
        log.exception("internal error on %s %s", request.method, request.url.path)
        err = APIError(500, f"Internal server error: {type(e).__name__}: {e}", type="server_error")
        return JSONResponse(err.body(), status_code=500)

    # ---- auth ----

    async def require_key(request: Request) -> None:
        if config.api_key is None:
            return
        import hmac

        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if not header:
            raise APIError(401, "You didn't provide an API key. Provide it in the Authorization header "
                                "(Authorization: Bearer YOUR_KEY).", code="invalid_api_key")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), config.api_key.encode()):
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")

    auth = [Depends(require_key)]

    # ---- info endpoints ----

    @app.get("/health")
    async def health():
        state.ready_engine()
        return {"status": "ok"}

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(state.metrics.render(), media_type=METRICS_CONTENT_TYPE)

    def model_card() -> P.ModelCard:
        engine = state.ready_engine()
        return P.ModelCard(id=config.served_model_name, created=state.created, root=config.model_path,
                           max_model_len=engine.max_model_len)

    @app.get("/v1/models", dependencies=auth)
    async def list_models():
        return P.dump(P.ModelList(data=[model_card()]))

    @app.get("/v1/models/{model_id:path}", dependencies=auth)
    async def get_model(model_id: str):
        card = model_card()
        state.check_model(model_id)
        return P.dump(card)

    # ---- tokenize / detokenize ----

    @app.post("/tokenize", dependencies=auth)
    async def tokenize(request: Request):
        req = P.parse_request(P.TokenizeRequest, await read_body(request, state.body_limit()))
        engine = state.ready_engine()
        state.check_model(req.model)
        tok = engine.tokenizer
        # only what cannot fit the context at all is refused (room 0): the early bound keeps
        # /tokenize from tokenizing megabytes
        token_chars = getattr(tok, "max_token_chars", None)
        if req.prompt is not None:
            _check_chars(len(req.prompt), token_chars, engine.max_model_len, "prompt", room=0)
            add_bos = req.add_special_tokens and tok.add_bos and not req.prompt.startswith("<bos>")
            ids = await asyncio.to_thread(tok.encode, req.prompt, add_bos=add_bos, parse_special=True)
        else:
            _check_chars(_chat_chars(req.messages), token_chars, engine.max_model_len, "messages", room=0)
            thinking, kwargs = _template_kwargs(config.default_chat_template_kwargs, req.chat_template_kwargs)
            tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
            bounded = _PromptTokenizer(tok, lambda n: _check_chars(n, token_chars, engine.max_model_len,
                                                                   "messages", room=0))
            ids = await asyncio.to_thread(render_chat, bounded, [_message_dict(m) for m in req.messages], tools,
                                          add_generation_prompt=req.add_generation_prompt,
                                          enable_thinking=thinking, kwargs=kwargs)
        out: dict[str, Any] = {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}
        if req.return_token_strs:
            out["token_strs"] = [tok.id_to_piece(i) for i in ids]
        return out

    @app.post("/detokenize", dependencies=auth)
    async def detokenize(request: Request):
        req = P.parse_request(P.DetokenizeRequest, await read_body(request, state.body_limit()))
        engine = state.ready_engine()
        state.check_model(req.model)
        n = engine.tokenizer.vocab_size
        bad = next((t for t in req.tokens if not 0 <= t < n), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is outside the vocabulary [0, {n})", "tokens")
        return {"prompt": engine.tokenizer.decode(req.tokens)}

    # ---- chat completions ----

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(request: Request):
        req = P.parse_request(P.ChatCompletionRequest, await read_body(request, state.body_limit()))
        engine = state.ready_engine()
        state.check_model(req.model)
        if req.response_format is not None and req.response_format.type != "text":
            raise bad_request(f"response_format {req.response_format.type!r} is not supported yet "
                              "(it needs constrained decoding)", "response_format")
        if req.top_logprobs and not req.logprobs:
            raise bad_request("top_logprobs requires logprobs=true", "top_logprobs")
        tools, tool_names = _tools_for(req)
        thinking, kwargs = _template_kwargs(config.default_chat_template_kwargs, req.chat_template_kwargs)
        max_tokens = req.token_limit
        params = _sampling(req, _vocab_size(engine), max_tokens=max_tokens, stop=[], logprobs=req.logprobs,
                           top_logprobs=req.top_logprobs or 0)
        token_chars = getattr(engine.tokenizer, "max_token_chars", None)
        _check_chars(_chat_chars(req.messages), token_chars, engine.max_model_len, "messages")
        messages = [_message_dict(m) for m in req.messages]
        bounded = _PromptTokenizer(engine.tokenizer, lambda n: _check_chars(n, token_chars, engine.max_model_len,
                                                                            "messages"))
        prompt_ids = await asyncio.to_thread(render_chat, bounded, messages, tools,
                                             add_generation_prompt=req.add_generation_prompt,
                                             enable_thinking=thinking, kwargs=kwargs)
        _check_length(len(prompt_ids), max_tokens, engine.max_model_len, "messages",
                      "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens")
        outs = [ChatOutput(engine.tokenizer, prompt_ids, tool_names=tool_names, stop=req.stop_list(),
                           parallel_tool_calls=req.parallel_tool_calls, logprobs=req.logprobs,
                           top_logprobs=req.top_logprobs or 0) for _ in range(req.n)]
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        gen = Generation(state, request_id, prompt_ids, params, req.n)
        created = int(time.time())
        name = config.served_model_name

        if req.stream:
            return EventStream(_chat_stream(gen, outs, request_id, created, name, req.include_usage,
                                            config.heartbeat_s),
                               on_close=lambda: gen.close("abort"))

        return await _whole_reply(request, gen, outs, lambda: P.ChatCompletion(
            id=request_id, created=created, model=name,
            choices=[P.ChatChoice(index=i, message=out.message(), logprobs=out.choice_logprobs(),
                                  finish_reason=out.finish_reason) for i, out in enumerate(outs)],
            usage=_usage(gen, outs)))

    # ---- completions ----

    @app.post("/v1/completions", dependencies=auth)
    async def completions(request: Request):
        req = P.parse_request(P.CompletionRequest, await read_body(request, state.body_limit()))
        engine = state.ready_engine()
        state.check_model(req.model)
        if req.echo and req.logprobs is not None:
            raise bad_request("echo together with logprobs is not supported (no prompt logprobs)", "echo")
        tok = engine.tokenizer
        if isinstance(req.prompt, str):
            _check_chars(len(req.prompt), getattr(tok, "max_token_chars", None), engine.max_model_len, "prompt")
            add_bos = tok.add_bos and not req.prompt.startswith("<bos>")
            prompt_ids = await asyncio.to_thread(tok.encode, req.prompt, add_bos=add_bos, parse_special=True)
            prompt_text = req.prompt
        else:
            prompt_ids = list(req.prompt)
            bad = next((t for t in prompt_ids if not 0 <= t < _vocab_size(engine)), None)
            if bad is not None:
                raise bad_request(f"prompt token id {bad} is outside the vocabulary", "prompt")
            prompt_text = tok.decode(prompt_ids) if req.echo else ""
        n_top = req.logprobs or 0
        params = _sampling(req, _vocab_size(engine), max_tokens=req.max_tokens, stop=req.stop_list(),
                           logprobs=req.logprobs is not None, top_logprobs=n_top)
        _check_length(len(prompt_ids), req.max_tokens, engine.max_model_len, "prompt")
        request_id = f"cmpl-{uuid.uuid4().hex}"
        gen = Generation(state, request_id, prompt_ids, params, req.n)
        created = int(time.time())
        name = config.served_model_name
        outs = [CompletionOutput(tok, req.logprobs is not None, n_top, prompt_text if req.echo else "")
                for _ in range(req.n)]

        def chunk(index: int, text: str, finish: str | None, logprobs=None, usage=None) -> P.Completion:
            c = P.Completion(id=request_id, created=created, model=name, choices=[
                P.CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=finish)])
            if req.include_usage:
                c.usage = usage
            return c

        if req.stream:
            async def stream() -> AsyncIterator[str]:
                try:
                    for i, out in enumerate(outs):
                        if out.echo:
                            yield _sse(chunk(i, out.echo, None))
                    while not all(o.done for o in outs):
                        ev = await gen.next(config.heartbeat_s)
                        if ev is None:
                            yield _PING
                            continue
                        out = outs[ev.index]
                        text = out.feed(ev)
                        if ev.finished:
                            yield _sse(chunk(ev.index, text, ev.finish_reason, out.take_logprobs()))
                        elif text:
                            yield _sse(chunk(ev.index, text, None, out.take_logprobs()))
                    if req.include_usage:
                        yield _sse(P.Completion(id=request_id, created=created, model=name, choices=[],
                                                usage=_usage(gen, outs)))
                    gen.close(outs[0].finish_reason)
                except EngineError as e:
                    gen.close("error")
                    yield _sse_error(e)
                yield _DONE

            return EventStream(stream(), on_close=lambda: gen.close("abort"))

        return await _whole_reply(request, gen, outs, lambda: P.Completion(
            id=request_id, created=created, model=name,
            choices=[P.CompletionChoice(index=i, text=out.echo + "".join(out.text), logprobs=out.all_logprobs(),
                                        finish_reason=out.finish_reason) for i, out in enumerate(outs)],
            usage=_usage(gen, outs)))

    return app


async def _chat_stream(gen: Generation, outs: list[ChatOutput], request_id: str, created: int, name: str,
                       include_usage: bool, heartbeat_s: float) -> AsyncIterator[str]:
    """The SSE body of a chat request: a role chunk per choice, then each choice's deltas as its events
    come (one choice per chunk), each choice's finish chunk when it is complete, the usage, [DONE]."""
    def chunk(index: int, delta: P.ChatDelta, finish: str | None = None, logprobs=None) -> P.ChatCompletionChunk:
        c = P.ChatCompletionChunk(id=request_id, created=created, model=name, choices=[
            P.ChatChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish)])
        if include_usage:
            c.usage = None
        return c

    try:
        for i in range(len(outs)):
            yield _sse(chunk(i, P.ChatDelta(role="assistant", content="")))
        while not all(o.done for o in outs):
            ev = await gen.next(heartbeat_s)
            if ev is None:
                yield _PING                       # nothing yet (a long prefill): keep the connection alive
                continue
            out = outs[ev.index]
            if out.done:                          # ended by the server (a stop string): the rest is cut
                continue
            for delta in out.feed(ev):
                yield _sse(chunk(ev.index, delta, logprobs=out.take_logprobs()))
            if out.done:
                yield _sse(chunk(ev.index, P.ChatDelta(), out.finish_reason, out.take_logprobs()))
                if not ev.finished:
                    gen.end_choice(ev.index)
        gen.close(outs[0].finish_reason)
        if include_usage:
            final = P.ChatCompletionChunk(id=request_id, created=created, model=name, choices=[],
                                          usage=_usage(gen, outs))
            yield _sse(final)
    except EngineError as e:
        gen.close("error")
        yield _sse_error(e)
    yield _DONE


class CompletionOutput:
    """Engine events of one /v1/completions request -> text pieces and legacy logprobs."""

    def __init__(self, tokenizer, logprobs: bool, n_top: int, echo: str):
        self.tokenizer = tokenizer
        self.want_logprobs = logprobs
        self.n_top = n_top
        self.echo = echo
        self.text: list[str] = []
        self.n_tokens = 0
        self.done = False
        self.finish_reason: str | None = None
        self._offset = len(echo)
        self._lp = P.CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        self._taken = 0

    def feed(self, ev: GenerationEvent) -> str:
        if ev.token_id is not None:
            self.n_tokens += 1
            if self.want_logprobs and ev.logprob is not None:
                text, _ = _token_text(self.tokenizer, ev.token_id)
                self._lp.tokens.append(text)
                self._lp.token_logprobs.append(ev.logprob)
                top: dict[str, float] = {}
                for t, lp in (ev.top_logprobs or [])[:self.n_top]:
                    top.setdefault(_token_text(self.tokenizer, t)[0], lp)
                self._lp.top_logprobs.append(top)
                self._lp.text_offset.append(self._offset)
        if ev.text:
            self.text.append(ev.text)
            self._offset += len(ev.text)
        if ev.finished:
            self.done = True
            self.finish_reason = ev.finish_reason
        return ev.text

    def take_logprobs(self) -> P.CompletionLogprobs | None:
        if not self.want_logprobs:
            return None
        lp, start = self._lp, self._taken
        self._taken = len(lp.tokens)
        return P.CompletionLogprobs(tokens=lp.tokens[start:], token_logprobs=lp.token_logprobs[start:],
                                    top_logprobs=lp.top_logprobs[start:], text_offset=lp.text_offset[start:])

    def all_logprobs(self) -> P.CompletionLogprobs | None:
        return self._lp if self.want_logprobs else None
