"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API (what Claude Code speaks), as a
translation onto the chat path.

A Messages request becomes its chat completion request (`protocol_messages.to_chat`), which renders, is
constrained (tool_choice any / tool, output_config.format) and is parsed exactly as a chat is; the chat
output (`ChatOutput`) becomes Anthropic's content blocks. What differs from the chat API:

- `max_tokens` beyond the free context is clamped to it (the reply then ends as a `max_tokens` stop):
  agents ask for 32,000 whatever the context. A prompt that does not fit is still a 400.
- usage splits the prompt into `input_tokens` (computed) and `cache_read_input_tokens` (prefix-cache
  hits); `count_tokens` answers their sum for the same request, without generating.
- errors are Anthropic's envelope, 529 `overloaded_error` for the chat API's 503 (`MessagesRoute`).
- a stream is Anthropic's named events (every frame has its `event:` line, which Anthropic's SDKs
  require): message_start, then per content block content_block_start / _delta / _stop (thinking_delta
  and a signature_delta, text_delta, input_json_delta), message_delta with the stop_reason and usage,
  message_stop; `event: ping` while nothing comes; no `[DONE]`. message_start waits for the prefill (its
  usage is exact).
"""
from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator, Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute

from gem4.engine import EngineError
from gem4.server import protocol as P
from gem4.server import protocol_messages as M
from gem4.server.inputs import (RenderedChat, parse, render_request, sampling_params, vocab_size, with_grammar,
                               with_thought_budget)
from gem4.server.outputs import ChatOutput
from gem4.server.protocol import APIError
from gem4.server.request import EventStream, ServerRequest, engine_error, whole_reply
from gem4.server.state import EngineLike, ServerState

log = logging.getLogger("gem4.server")


class MessagesRoute(APIRoute):
    """A route whose errors (the key check, the body, the engine) are Anthropic's envelope."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def anthropic_errors(request: Request):
            try:
                return await handler(request)
            except APIError as e:
                status = M.error_status(e.status)   # the envelope has no param: the message names the field
                message = e.message if e.param is None or e.param in e.message else f"{e.param}: {e.message}"
                return JSONResponse(M.error_body(status, message), status_code=status, headers=e.headers)
            except Exception as e:      # noqa: BLE001 - a bug: logged, and answered as Anthropic's api_error
                log.exception("internal error on %s %s", request.method, request.url.path)
                return JSONResponse(M.error_body(500, f"Internal server error: {type(e).__name__}: {e}"),
                                    status_code=500)

        return anthropic_errors


router = APIRouter(route_class=MessagesRoute)


async def _prompt(request: Request, state: ServerState, engine: EngineLike,
                  req: M.CountTokensRequest) -> tuple[P.ChatCompletionRequest, RenderedChat]:
    """The request as its chat request, rendered: what /v1/messages generates from and count_tokens counts.
    Errors name the Messages fields (`client_error`)."""
    chat = M.to_chat(req)
    try:
        return chat, await render_request(request, state, engine, chat)
    except APIError as e:
        raise M.client_error(req, e) from None


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request):
    state: ServerState = request.app.state.gem4
    req, engine = await parse(request, M.CountTokensRequest, state)
    _, prompt = await _prompt(request, state, engine, req)
    return {"input_tokens": len(prompt.ids)}


@router.post("/v1/messages")
async def messages(request: Request):
    state: ServerState = request.app.state.gem4
    config = state.config
    req, engine = await parse(request, M.MessagesRequest, state)
    chat, prompt = await _prompt(request, state, engine, req)
    max_tokens = min(req.max_tokens, engine.max_model_len - len(prompt.ids))   # clamped: a max_tokens stop
    try:
        params = sampling_params(chat, vocab_size(engine), max_tokens=max_tokens, stop=[], logprobs=False,
                                 top_logprobs=0)
        params = await with_grammar(engine, params, prompt)
    except APIError as e:
        raise M.client_error(req, e) from None
    params = with_thought_budget(engine, params, prompt, M.budget_of(req))
    out = ChatOutput(engine.tokenizer, prompt.ids, tool_names=prompt.tool_names, stop=chat.stop_list(),
                     parallel_tool_calls=chat.parallel_tool_calls, logprobs=False, top_logprobs=0,
                     ignore_eos=params.goes_past_end)
    message_id = f"msg_{uuid.uuid4().hex}"
    gen = ServerRequest(state, message_id, prompt.ids, params, 1, detokenize=False, media=prompt.media)
    name = config.served_model_name

    if req.stream:
        return EventStream(_stream(gen, out, message_id, name, config.heartbeat_s),
                           on_close=lambda: gen.close("abort"))
    return await whole_reply(request, gen, [out], lambda: M.Message(
        id=message_id, model=name, content=_blocks(out), stop_reason=M.stop_reason(out.finish_reason,
                                                                                   out.stop_sequence),
        stop_sequence=out.stop_sequence, usage=_usage(gen, out)))


def _usage(gen: ServerRequest, out: ChatOutput) -> M.MessagesUsage:
    return M.MessagesUsage(input_tokens=len(gen.prompt_ids) - gen.cached_tokens,
                           cache_read_input_tokens=gen.cached_tokens, output_tokens=out.n_tokens)


def _tool_id(call_id: str) -> str:
    """Anthropic's tool_use ids start with toolu_ (the parser's start with call_)."""
    return "toolu_" + call_id.removeprefix("call_")


def _input(arguments: str) -> dict:
    """A call's arguments as tool_use `input` (an object); {} for what the parser closed as no object."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _blocks(out: ChatOutput) -> list[dict]:
    """A finished reply's content blocks: thinking, text, then each tool_use."""
    blocks: list[dict] = []
    if out.reasoning:
        blocks.append({"type": "thinking", "thinking": "".join(out.reasoning), "signature": M.SIGNATURE})
    if out.content:
        blocks.append({"type": "text", "text": "".join(out.content)})
    blocks += [{"type": "tool_use", "id": _tool_id(c.id), "name": c.name, "input": _input(c.arguments)}
               for c in out.calls]
    return blocks


# ---------------------------------------------------------------------------------------------
# Streaming: chat deltas -> Anthropic's content block events
# ---------------------------------------------------------------------------------------------


def _event(data: dict) -> str:
    return f"event: {data['type']}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


PING = _event({"type": "ping"})


class _Blocks:
    """Opens, fills and closes content blocks as the chat deltas come: a thinking, text or tool_use block
    starts where the delta's kind changes (each call is its own block), indexes counting up."""

    def __init__(self):
        self.index = -1
        self.kind: str | None = None          # the open block's type, None when none is open

    def _open(self, block: dict) -> list[str]:
        events = self.close()
        self.index += 1
        self.kind = block["type"]
        return events + [_event({"type": "content_block_start", "index": self.index, "content_block": block})]

    def _delta(self, delta: dict) -> str:
        return _event({"type": "content_block_delta", "index": self.index, "delta": delta})

    def close(self) -> list[str]:
        if self.kind is None:
            return []
        events = []
        if self.kind == "thinking":
            events.append(self._delta({"type": "signature_delta", "signature": M.SIGNATURE}))
        self.kind = None
        return events + [_event({"type": "content_block_stop", "index": self.index})]

    def feed(self, d: P.ChatDelta) -> list[str]:
        events: list[str] = []
        if d.reasoning_content:
            if self.kind != "thinking":
                events += self._open({"type": "thinking", "thinking": "", "signature": ""})
            events.append(self._delta({"type": "thinking_delta", "thinking": d.reasoning_content}))
        if d.content:
            if self.kind != "text":
                events += self._open({"type": "text", "text": ""})
            events.append(self._delta({"type": "text_delta", "text": d.content}))
        for call in d.tool_calls or []:
            if call.id is not None:
                events += self._open({"type": "tool_use", "id": _tool_id(call.id), "name": call.function.name,
                                      "input": {}})
            if call.function.arguments:
                events.append(self._delta({"type": "input_json_delta", "partial_json": call.function.arguments}))
        return events


async def _stream(gen: ServerRequest, out: ChatOutput, message_id: str, name: str,
                  heartbeat_s: float) -> AsyncIterator[str]:
    blocks = _Blocks()
    started = False
    try:
        while not out.done:
            ev = await gen.next(heartbeat_s)
            if ev is None:
                yield PING                        # nothing yet (a long prefill): keep the connection alive
                continue
            if not started:                       # the prefill is done: the usage is known
                started = True
                start = M.Message(id=message_id, model=name, content=[], usage=_usage(gen, out))
                yield _event({"type": "message_start", "message": start.model_dump()})
            for delta in out.feed(ev):
                for frame in blocks.feed(delta):
                    yield frame
            if out.done and not ev.finished:      # ended here (a stop string, one call): stop the engine
                gen.end_choice(ev.index, out.finish_reason)
        for frame in blocks.close():
            yield frame
        gen.close(out.finish_reason)
        yield _event({"type": "message_delta",
                      "delta": {"stop_reason": M.stop_reason(out.finish_reason, out.stop_sequence),
                                "stop_sequence": out.stop_sequence},
                      "usage": _usage(gen, out).model_dump()})
        yield _event({"type": "message_stop"})
    except EngineError as e:
        gen.close("error")
        err = engine_error(e)
        yield _event(M.error_body(M.error_status(err.status), err.message))
