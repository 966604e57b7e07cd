"""POST /v1/chat/completions: messages (and tools) -> the chat template -> the engine -> `ChatOutput`.

A forced tool call, a strict tool, a response_format document or structured_outputs becomes a grammar over
the generated tokens (`inputs.with_grammar`, docs/structured.md); the output parser reads the constrained ids
as it reads any others."""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request

from gem4.engine import EngineError
from gem4.server import protocol as P
from gem4.server.inputs import parse, render_request, sampling_params, vocab_size, with_grammar
from gem4.server.outputs import ChatOutput, usage_of
from gem4.server.protocol import bad_request
from gem4.server.request import DONE, PING, EventStream, ServerRequest, sse, sse_error, whole_reply
from gem4.server.state import ServerState

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    state: ServerState = request.app.state.gem4
    config = state.config
    req, engine = await parse(request, P.ChatCompletionRequest, state)
    if req.top_logprobs and not req.logprobs:
        raise bad_request("top_logprobs requires logprobs=true", "top_logprobs")
    max_tokens = req.token_limit
    params = sampling_params(req, vocab_size(engine), max_tokens=max_tokens, stop=[], logprobs=req.logprobs,
                             top_logprobs=req.top_logprobs or 0)
    chat = await render_request(request, state, engine, req, max_tokens=max_tokens, max_tokens_name=(
        "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"))
    prompt_ids = chat.ids
    params = await with_grammar(engine, params, chat)
    outs = [ChatOutput(engine.tokenizer, prompt_ids, tool_names=chat.tool_names, stop=req.stop_list(),
                       parallel_tool_calls=req.parallel_tool_calls, logprobs=req.logprobs,
                       top_logprobs=req.top_logprobs or 0, ignore_eos=params.goes_past_end) for _ in range(req.n)]
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    gen = ServerRequest(state, request_id, prompt_ids, params, req.n, detokenize=False,   # the parser reads the ids
                        media=chat.media)
    created = int(time.time())
    name = config.served_model_name

    if req.stream:
        return EventStream(_chat_stream(gen, outs, request_id, created, name, req.include_usage, config.heartbeat_s),
                           on_close=lambda: gen.close("abort"))

    return await whole_reply(request, gen, outs, lambda: P.ChatCompletion(
        id=request_id, created=created, model=name,
        choices=[P.ChatChoice(index=i, message=out.message(), logprobs=out.choice_logprobs(),
                              finish_reason=out.finish_reason) for i, out in enumerate(outs)],
        usage=usage_of(gen, outs)))


async def _chat_stream(gen: ServerRequest, outs: list[ChatOutput], request_id: str, created: int, name: str,
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
            yield sse(chunk(i, P.ChatDelta(role="assistant", content="")))
        while not all(o.done for o in outs):
            ev = await gen.next(heartbeat_s)
            if ev is None:
                yield PING                        # nothing yet (a long prefill): keep the connection alive
                continue
            out = outs[ev.index]
            if out.done:                          # ended by the server (a stop string): the rest is cut
                continue
            for delta in out.feed(ev):
                yield sse(chunk(ev.index, delta, logprobs=out.take_logprobs()))
            if out.done:
                if not ev.finished:               # ended here: the engine stops it now, logged with our reason
                    gen.end_choice(ev.index, out.finish_reason)
                yield sse(chunk(ev.index, P.ChatDelta(), out.finish_reason, out.take_logprobs()))
        gen.close(outs[0].finish_reason)
        if include_usage:
            final = P.ChatCompletionChunk(id=request_id, created=created, model=name, choices=[],
                                          usage=usage_of(gen, outs))
            yield sse(final)
    except EngineError as e:
        gen.close("error")
        yield sse_error(e)
    yield DONE
