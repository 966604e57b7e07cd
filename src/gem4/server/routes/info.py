"""The endpoints around generation: health, version, metrics, the model list, tokenize / detokenize.

/tokenize and /detokenize do their per-token work (range checks, decoding, token strings, the JSON of
the reply) in the thread pool, never on the event loop: a 250K-id /detokenize held the loop, /health
included, for a quarter of a second. That work is proportional to the request, whose size the body
limit bounds.
"""
from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response

from gem4 import __version__
from gem4.server import protocol as P
from gem4.server.inputs import (chat_chars, chat_media, chat_prompt, check_chars, expand_media, parse,
                                template_kwargs, text_prompt)
from gem4.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from gem4.server.protocol import bad_request
from gem4.server.state import ServerState

public = APIRouter()          # open to anyone
metrics_router = APIRouter()  # behind --metrics-api-key, when there is one
router = APIRouter()          # behind the API key


@public.get("/health")
async def health(request: Request):
    request.app.state.gem4.ready_engine()
    return {"status": "ok"}


@public.get("/version")
async def version():
    return {"version": __version__}


@metrics_router.get("/metrics")
async def metrics(request: Request):
    return PlainTextResponse(request.app.state.gem4.metrics.render(), media_type=METRICS_CONTENT_TYPE)


def _model_card(state: ServerState) -> P.ModelCard:
    engine = state.ready_engine()
    return P.ModelCard(id=state.config.served_model_name, created=state.created, root=state.config.model_path,
                       max_model_len=engine.max_model_len)


@router.get("/v1/models")
async def list_models(request: Request):
    return P.dump(P.ModelList(data=[_model_card(request.app.state.gem4)]))


@router.get("/v1/models/{model_id:path}")
async def get_model(request: Request, model_id: str):
    state: ServerState = request.app.state.gem4
    card = _model_card(state)
    state.check_model(model_id)
    return P.dump(card)


@router.post("/tokenize")
async def tokenize(request: Request):
    state: ServerState = request.app.state.gem4
    req, engine = await parse(request, P.TokenizeRequest, state)
    tok = engine.tokenizer
    # only what cannot fit the context at all is refused (room 0): the early bound keeps
    # /tokenize from tokenizing megabytes
    token_chars = getattr(tok, "max_token_chars", None)
    if req.prompt is not None:
        check_chars(len(req.prompt), token_chars, engine.max_model_len, "prompt", room=0)
        ids = await text_prompt(tok, req.prompt, add_special_tokens=req.add_special_tokens)
    else:
        check_chars(chat_chars(req.messages), token_chars, engine.max_model_len, "messages", room=0)
        thinking, kwargs = template_kwargs(state.config.default_chat_template_kwargs, req.chat_template_kwargs)
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        items = await chat_media(engine, req, state, request)
        ids = await chat_prompt(engine, req.messages, tools, add_generation_prompt=req.add_generation_prompt,
                                enable_thinking=thinking, kwargs=kwargs, request=request,
                                max_render_s=state.config.max_render_s, room=0,
                                continue_final_message=req.continue_final_message)
        ids, _ = expand_media(ids, engine, items)            # each image and clip counts its soft tokens

    def reply() -> dict[str, Any]:
        out: dict[str, Any] = {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}
        if req.return_token_strs:
            out["token_strs"] = [tok.id_to_piece(i) for i in ids]
        return out

    return await _json_off_loop(reply)


@router.post("/detokenize")
async def detokenize(request: Request):
    req, engine = await parse(request, P.DetokenizeRequest, request.app.state.gem4)
    tok = engine.tokenizer

    def reply() -> dict[str, Any]:
        n, ids = tok.vocab_size, req.tokens
        if ids and not (min(ids) >= 0 and max(ids) < n):             # min and max loop in C: 1/10 the time
            bad = next(t for t in ids if not 0 <= t < n)
            raise bad_request(f"token id {bad} is outside the vocabulary [0, {n})", "tokens")
        return {"prompt": tok.decode(ids)}

    return await _json_off_loop(reply)


async def _json_off_loop(reply) -> Response:
    """`reply()` and its JSON, in the thread pool (written as FastAPI writes a returned dict)."""
    def body() -> bytes:
        return json.dumps(reply(), ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()

    return Response(await asyncio.to_thread(body), media_type="application/json")
