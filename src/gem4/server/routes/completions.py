"""POST /v1/completions: a text or token-id prompt -> the engine -> `CompletionOutput`."""
from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request

from gem4.engine import EngineError
from gem4.server import protocol as P
from gem4.server.inputs import (
    check_chars,
    check_length,
    completion_structured,
    parse,
    sampling_params,
    text_prompt,
    vocab_size,
)
from gem4.server.outputs import CompletionOutput, usage_of
from gem4.server.protocol import bad_request
from gem4.server.request import DONE, PING, EventStream, ServerRequest, sse, sse_error, whole_reply
from gem4.server.state import ServerState

router = APIRouter()


@router.post("/v1/completions")
async def completions(request: Request):
    state: ServerState = request.app.state.gem4
    config = state.config
    req, engine = await parse(request, P.CompletionRequest, state)
    if req.echo and req.logprobs is not None:
        raise bad_request("echo together with logprobs is not supported (no prompt logprobs)", "echo")
    tok = engine.tokenizer
    if isinstance(req.prompt, str):
        check_chars(len(req.prompt), getattr(tok, "max_token_chars", None), engine.max_model_len, "prompt")
        prompt_ids = await text_prompt(tok, req.prompt)
        prompt_text = req.prompt
    else:
        prompt_ids = list(req.prompt)
        bad = next((t for t in prompt_ids if not 0 <= t < vocab_size(engine)), None)
        if bad is not None:
            raise bad_request(f"prompt token id {bad} is outside the vocabulary", "prompt")
        prompt_text = await asyncio.to_thread(tok.decode, prompt_ids) if req.echo else ""
    n_top = req.logprobs or 0
    params = sampling_params(req, vocab_size(engine), max_tokens=req.max_tokens, stop=req.stop_list(),
                             logprobs=req.logprobs is not None, top_logprobs=n_top)
    check_length(len(prompt_ids), req.max_tokens, engine.max_model_len, "prompt")
    structured = await completion_structured(engine, req)
    if structured is not None:
        params = dataclasses.replace(params, structured=structured)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    gen = ServerRequest(state, request_id, prompt_ids, params, req.n)
    created = int(time.time())
    name = config.served_model_name
    outs = [CompletionOutput(tok, req.logprobs is not None, n_top, prompt_text if req.echo else "")
            for _ in range(req.n)]

    if req.stream:
        return EventStream(_completion_stream(gen, outs, request_id, created, name, req.include_usage,
                                              config.heartbeat_s),
                           on_close=lambda: gen.close("abort"))

    return await whole_reply(request, gen, outs, lambda: P.Completion(
        id=request_id, created=created, model=name,
        choices=[P.CompletionChoice(index=i, text=out.echo + "".join(out.text), logprobs=out.all_logprobs(),
                                    finish_reason=out.finish_reason) for i, out in enumerate(outs)],
        usage=usage_of(gen, outs)))


async def _completion_stream(gen: ServerRequest, outs: list[CompletionOutput], request_id: str, created: int,
                             name: str, include_usage: bool, heartbeat_s: float) -> AsyncIterator[str]:
    """The SSE body of a completion request: each choice's echoed prompt, then each choice's text as its
    events come (one choice per chunk, its finish_reason on its last), the usage, [DONE]."""
    def chunk(index: int, text: str, finish: str | None, logprobs=None) -> P.Completion:
        c = P.Completion(id=request_id, created=created, model=name, choices=[
            P.CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=finish)])
        if include_usage:
            c.usage = None
        return c

    try:
        for i, out in enumerate(outs):
            if out.echo:
                yield sse(chunk(i, out.echo, None))
        while not all(o.done for o in outs):
            ev = await gen.next(heartbeat_s)
            if ev is None:
                yield PING
                continue
            out = outs[ev.index]
            text = out.feed(ev)
            if ev.finished:
                yield sse(chunk(ev.index, text, ev.finish_reason, out.take_logprobs()))
            elif text:
                yield sse(chunk(ev.index, text, None, out.take_logprobs()))
        if include_usage:
            yield sse(P.Completion(id=request_id, created=created, model=name, choices=[],
                                   usage=usage_of(gen, outs)))
        gen.close(outs[0].finish_reason)
    except EngineError as e:
        gen.close("error")
        yield sse_error(e)
    yield DONE
