"""Requests -> prompt ids and SamplingParams, with the work before admission bounded.

Every endpoint that takes a body starts with `parse(request, Model, state)`: the body read within its
limit, validated against the protocol model, the engine ready, the model name checked.

Bounded work before admission (each limit refuses before the work it bounds):

- **Body size** (`ServerConfig.max_request_body`, default 1 MiB + 64 bytes per token of
  max_model_len, see `default_body_limit`, and IMAGE_BODY_BYTES more for a model that takes images): 413 when Content-Length says more (nothing is read),
  or as soon as a chunked body passes it. Authentication (a dependency) runs before any body is
  read; `http11.py` closes a connection whose request was answered before its body arrived.
- **Characters before tokens**: no token stands for more than `Tokenizer.max_token_chars` characters (31
  for Gemma 4), so a text of n characters is at least n / 31 tokens. A completion prompt, the
  user/system/developer texts of a chat (before rendering), and the rendered chat prompt (before
  tokenizing, whatever the template did) that cannot fit max_model_len that way get the
  context-length 400 without being tokenized. The exact token check follows for the rest.
- **Turns before rendering**: every message of a chat renders to a few tokens at least under the
  Gemma 4 templates (`gem4.chat.TURN_TOKENS`: 5 for a user, system or developer turn, 2 for an
  assistant turn, 1 charged for a tool message), so a conversation with more messages than the
  context can hold gets the context-length 400 from its message roles alone. This matters because
  the official template's cost grows with the square of the number of messages (each message looks
  back over all the earlier ones): 4,000 messages took a minute to render.
- **Render budget** (`ServerConfig.max_render_s`, `--max-render-seconds`, default 10 s of the render's
  CPU time): what the turns bound lets through (4,000 empty assistant turns fit an 8K context and
  take a minute) is stopped there, with a 400 naming `messages`, and as soon as the client
  disconnects. The template checks its `RenderBudget` at every attribute access, item access and
  call (`gem4.chat`), so the render stops where it is: no thread keeps working for a client that left.
- **Where**: chat prompts render and tokenize in their own pool of `RENDER_THREADS` threads, never on
  the event loop and never in the default pool, so renders cannot hold up text tokenization (the
  default pool). Long renders (past 20 ms of CPU) take turns in one lane, 0.2 ms of CPU at a time
  (`gem4.chat.RenderBudget`): however many there are, the event loop, the engine thread and ordinary
  chats compete with one of them, and get the GIL within a fraction of a millisecond. Text prompts
  tokenize in the default pool (`Tokenizer.encode` releases the GIL; the character bound caps its work).

Images (chat `image_url` parts) and audio clips (`input_audio` parts, base64: docs/multimodal.md §6) are read
(`media_fetch.media_bytes`: base64 data URIs; http(s) and file:// URLs only where the operator allows them, within
--media-fetch-timeout; every part within --max-media-bytes), then decoded and preprocessed in the default pool
before the render (`chat_media`); an image's decoded size is bounded by `gem4.media.image.MAX_PIXELS` and a
clip's length by `MAX_AUDIO_SECONDS`. Each becomes one `<|image|>` or `<|audio|>` in the rendered prompt, then
its soft-token block (`gem4.engine.media.media_prompt`); `usage.prompt_tokens` counts the soft tokens. Videos
(`video_url` parts, vLLM's shape, read as images are; llama-server's `input_video` with base64 data) become one
`<|video|>`, then up to 32 timestamped frames (`gem4.media.video`, its frame count bounded by `MAX_FRAMES`).

Why a budget checked inside the template rather than a process pool: a process can be killed at
any point and does not hold this process's GIL, but each render would pickle its messages across,
a killed worker must be respawned (a new interpreter, a fraction of a second of CPU, each time a
client leaves mid-render: itself work a client could buy), and each worker would hold its own
tokenizer. The checks add a few percent to a render (tests/test_chat.py bounds it) and stop it
within tens of microseconds.
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np
from fastapi import Request
from pydantic import BaseModel
from starlette.requests import ClientDisconnect

from gem4.engine.media import Item, audio_tokens, check_fits, media_prompt
from gem4.engine.sequence import MediaInput
from gem4.media.audio import MAX_DECODED_SECONDS, AudioError, decode_audio
from gem4.media.video import Video, VideoError, decode as decode_video
from gem4.media.image import BUDGETS, DEFAULT_BUDGET, ImageError, ImagePatches, decode, preprocess
from gem4.chat import (TURN_TOKENS, ChatTemplateError, RenderAborted, RenderBudget, encode_prompt,
                       is_gemma4_template, min_prompt_tokens)
from gem4.sampling import InvalidParameter, SamplingParams
from gem4.server import protocol as P
from gem4.server.media_fetch import MediaURLError, decode_base64, media_bytes
from gem4.server.protocol import APIError, bad_request
from gem4.server.state import EngineLike, ServerState
from gem4.structured.grammars import GrammarError, Lead, Plan, chat_plan, completion_plan, lead_of, validate
from gem4.structured.spec import GrammarSpec, ThoughtBudget

# names encode_prompt / the renderers take themselves: never template variables from a request
_RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "template", "tokenizer", "add_generation_prompt",
                                       "continue_final_message",
                                       "documents", "bos_token", "eos_token", "unk_token", "pad_token",
                                       "mask_token"})

Body = TypeVar("Body", bound=BaseModel)


async def parse(request: Request, model: type[Body], state: ServerState) -> tuple[Body, EngineLike]:
    """The request's body as `model` (400 if it is not one; 413 past the body limit), and the engine
    (503 while it loads or the server stops); 404 if the body names a model this server does not serve."""
    req = P.parse_request(model, await read_body(request, body_limit(state)))
    engine = state.ready_engine()
    state.check_model(req.model)
    return req, engine


# ---------------------------------------------------------------------------------------------
# Body size
# ---------------------------------------------------------------------------------------------


def body_limit(state: ServerState) -> int:
    """The largest request body accepted, in bytes (503 while loading if it depends on the model)."""
    if state.config.max_request_body is not None:
        return state.config.max_request_body
    engine = state.ready_engine()
    media = vision_config(engine) is not None or audio_config(engine) is not None
    return default_body_limit(engine.max_model_len) + (IMAGE_BODY_BYTES if media else 0)


IMAGE_BODY_BYTES = 32 * 2**20
# More room in a body for a model that takes images or audio: they come as base64, 4/3 of their bytes (a phone
# photo is 2-5 MB, 30 s of 16-bit 16 kHz WAV ~1 MB); llama-server downloads up to 10 MB an image.
MAX_AUDIO_SECONDS = MAX_DECODED_SECONDS     # longer clips are refused (400) before they are decoded whole


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


# ---------------------------------------------------------------------------------------------
# Context length: characters before tokens, then tokens
# ---------------------------------------------------------------------------------------------


def check_chars(n_chars: int, token_chars: int | None, max_model_len: int, where: str, room: int = 1) -> None:
    """The early bound: refuse a text of `n_chars` characters that cannot fit the context, leaving `room`
    tokens (1 to generate; 0 for /tokenize), even as ceil(n_chars / token_chars) tokens, without tokenizing
    it. A text that may fit is tokenized (its cost is bounded by the context) and `check_length` says
    exactly what does not fit, max_tokens included."""
    if token_chars is None:
        return
    least = -(-n_chars // token_chars)
    if least > max_model_len - room:
        raise bad_request(f"This model's maximum context length is {max_model_len} tokens. However, your {where} "
                          f"({n_chars} characters) would be at least {least} tokens (no token is longer than "
                          f"{token_chars} characters). Please reduce the length of the {where}.", where,
                          code="context_length_exceeded")


def chat_chars(messages) -> int:
    """Characters every Gemma 4 chat template renders as they are: the texts of user, system and
    developer messages, trimmed as the templates trim them. Assistant text may lose its thinking and
    tool results may be dropped, so they are not counted: this is a lower bound on the rendered
    prompt's length, checked before rendering; the rendered prompt itself is checked too
    (`_PromptTokenizer`)."""
    n = 0
    for m in messages:
        if m.role in ("user", "system", "developer") and m.content is not None:
            texts = [m.content] if isinstance(m.content, str) else [p["text"] for p in m.content if p["type"] == "text"]
            n += sum(len(t.strip()) for t in texts)
    return n


def check_length(n_prompt: int, max_tokens: int | None, max_model_len: int, where: str,
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
# Prompts: text, and chats rendered with the template
# ---------------------------------------------------------------------------------------------


async def text_prompt(tokenizer, text: str, *, add_special_tokens: bool = True) -> list[int]:
    """A text prompt's ids (special tokens parsed), tokenized in the thread pool; <bos> first unless
    `add_special_tokens` is false or the text begins with it."""
    add_bos = add_special_tokens and tokenizer.add_bos and not text.startswith("<bos>")
    return await asyncio.to_thread(tokenizer.encode, text, add_bos=add_bos, parse_special=True)


# Chat renders at once. The pool makes threads as it needs them, and a long render spends most of its time
# waiting for its turn in the long-render lane (gem4.chat.RenderBudget), using no CPU: so there are many,
# and a short render does not wait for a thread behind long ones.
RENDER_THREADS = 64
_render_pool: ThreadPoolExecutor | None = None


def render_pool() -> ThreadPoolExecutor:
    """The threads chat prompts render and tokenize in (made on first use, one per process)."""
    global _render_pool
    if _render_pool is None:
        _render_pool = ThreadPoolExecutor(RENDER_THREADS, thread_name_prefix="gem4-render")
    return _render_pool


def check_turns(messages, template: str | None, max_model_len: int, room: int = 1) -> None:
    """The turns bound: refuse a conversation whose messages render to more tokens than the context holds,
    leaving `room`, counting each at its fewest (`gem4.chat.TURN_TOKENS`), before it is rendered. Only
    for a Gemma 4 template (None is the official one); another template may render a message to nothing."""
    if template is not None and not is_gemma4_template(template):
        return
    least = min_prompt_tokens([m.role for m in messages])
    if least > max_model_len - room:
        raise bad_request(f"This model's maximum context length is {max_model_len} tokens. However, your messages "
                          f"({len(messages)} messages) would render to at least {least} tokens (each user, system "
                          f"or developer turn takes at least {TURN_TOKENS['user']} tokens, each assistant turn "
                          f"{TURN_TOKENS['assistant']}, each tool message is counted as {TURN_TOKENS['tool']}). "
                          f"Please reduce the number of messages.", "messages",
                          code="context_length_exceeded")


async def chat_prompt(engine: EngineLike, messages, tools: list[dict] | None, *, add_generation_prompt: bool,
                      enable_thinking: bool, kwargs: dict, request: Request | None, max_render_s: float | None,
                      room: int = 1, continue_final_message: bool = False) -> list[int]:
    """A chat's prompt ids: the validated `messages` held to the turns bound (`check_turns`), rendered with the
    template within `max_render_s` seconds (None: no limit) and tokenized in the render pool, the rendered text
    held to the early character bound (`check_chars`, leaving `room`) first. The render stops, with a 400, when
    its budget runs out or when `request`'s client disconnects. continue_final_message: the prompt ends inside
    the last (assistant) message's turn, which the model continues (`gem4.chat.encode_prompt`)."""
    tokenizer = engine.tokenizer
    check_turns(messages, tokenizer.chat_template, engine.max_model_len, room)
    token_chars = getattr(tokenizer, "max_token_chars", None)
    bounded = _PromptTokenizer(tokenizer, lambda n: check_chars(n, token_chars, engine.max_model_len,
                                                                "messages", room))
    budget = RenderBudget(max_render_s)
    job = functools.partial(render_chat, bounded, [_message_dict(m) for m in messages], tools,
                            add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking,
                            kwargs=kwargs, budget=budget, continue_final_message=continue_final_message)
    rendering = asyncio.get_running_loop().run_in_executor(render_pool(), job)
    watch = None if request is None else asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({rendering} if watch is None else {rendering, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not rendering.done():        # the client left (or the handler was cancelled): stop the render
            budget.cancel()
        if watch is not None:
            watch.cancel()
    if not rendering.done():
        rendering.add_done_callback(_discard)   # its RenderAborted, when the thread reaches a checkpoint
        raise bad_request("The client closed the connection while the chat template was rendering.", "messages")
    return rendering.result()


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (the body is read by now: the next ASGI message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _discard(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()              # retrieved: not logged as "never retrieved"


@dataclasses.dataclass
class RenderedChat:
    """A chat request rendered: the prompt ids, thinking on or off, the tools the parser accepts, and the grammar
    plan (`chat_plan_of`) its constrained decoding starts from."""

    ids: list[int]
    thinking: bool
    tool_names: frozenset[str]
    plan: Plan | None
    media: list[MediaInput] = dataclasses.field(default_factory=list)     # its images and clips, at their positions


async def render_request(request: Request, state: ServerState, engine: EngineLike, req: P.ChatCompletionRequest,
                         *, where: str = "messages", max_tokens: int | None = None,
                         max_tokens_name: str = "max_tokens") -> RenderedChat:
    """What the chat, Responses and Messages endpoints share before generating: tools and the grammar plan
    checked, the template variables, the early character bound, the render (`chat_prompt`) and the context
    check (`where` names the field a too-long prompt came from; `max_tokens` is checked with it when given)."""
    tools, tool_names = tools_for(req)
    plan = await chat_plan_of(req, tools)
    thinking, kwargs = template_kwargs(state.config.default_chat_template_kwargs, req.chat_template_kwargs)
    check_chars(chat_chars(req.messages), getattr(engine.tokenizer, "max_token_chars", None), engine.max_model_len,
                where)
    items = await chat_media(engine, req, state, request)
    ids = await chat_prompt(engine, req.messages, tools, add_generation_prompt=req.add_generation_prompt,
                            enable_thinking=thinking, kwargs=kwargs, request=request,
                            max_render_s=state.config.max_render_s, continue_final_message=req.continue_final_message)
    ids, media = expand_media(ids, engine, items, where)
    check_length(len(ids), max_tokens, engine.max_model_len, where, max_tokens_name)
    return RenderedChat(ids, thinking, tool_names, plan, media)


def expand_media(ids: list[int], engine: EngineLike, items: list[Item], where: str = "messages"
                 ) -> tuple[list[int], list[MediaInput]]:
    """The rendered ids with each image's and clip's placeholder expanded into its soft-token block, and the items'
    MediaInputs; 400 when the prompt does not hold one placeholder per item."""
    try:
        return media_prompt(ids, items, vision=vision_config(engine), audio=audio_config(engine),
                            tokenize=lambda text: engine.tokenizer.encode(text, add_bos=False))
    except ValueError as e:               # a template that drops media parts, or text holding a placeholder
        raise bad_request(f"The rendered prompt does not hold one placeholder per image and audio clip: {e}",
                          where) from None


def vision_config(engine: EngineLike):
    """The engine's model's vision tower config, or None (a model without one)."""
    vision = getattr(getattr(engine, "model", None), "vision", None)
    return None if vision is None else vision.config


def audio_config(engine: EngineLike):
    """The engine's model's audio config (a conformer tower or the 12B's raw frames), or None (no audio)."""
    audio = getattr(getattr(engine, "model", None), "audio", None)
    return None if audio is None else audio.config


def image_budget(req: P.ChatCompletionRequest | P.TokenizeRequest) -> int:
    """The soft-token budget of the request's images: `mm_processor_kwargs.max_soft_tokens` (vLLM's name), 280
    by default."""
    kwargs = req.mm_processor_kwargs or {}
    unknown = sorted(set(kwargs) - {"max_soft_tokens"})
    if unknown:
        raise bad_request(f"mm_processor_kwargs: unknown key {unknown[0]!r} (max_soft_tokens is the one taken)",
                          "mm_processor_kwargs")
    budget = kwargs.get("max_soft_tokens", DEFAULT_BUDGET)
    if budget not in BUDGETS or isinstance(budget, bool):
        raise bad_request(f"mm_processor_kwargs.max_soft_tokens must be one of {list(BUDGETS)}, got {budget!r}",
                          "mm_processor_kwargs")
    return budget


MEDIA_KINDS = ("image", "video", "audio")     # the chat parts a request may carry, as --limit-mm-per-prompt names them
DEFAULT_MM_LIMIT = 999                         # parts of a kind per request where --limit-mm-per-prompt is silent (vLLM's)


def parse_mm_limits(text: str) -> dict[str, int]:
    """--limit-mm-per-prompt's JSON object (vLLM's form, '{"image": 4, "video": 1, "audio": 2}') -> the most parts of
    each kind one request may carry: DEFAULT_MM_LIMIT for a kind it does not name, 0 to take none. ValueError
    naming what is wrong (not an object, an unknown kind, a count that is not an integer >= 0)."""
    try:
        given = json.loads(text)
    except ValueError as e:
        raise ValueError(f"not JSON ({e})") from None
    if not isinstance(given, dict):
        raise ValueError(f"must be a JSON object of counts by kind, such as {{\"image\": 4}}, got {text!r}")
    for kind, count in given.items():
        if kind not in MEDIA_KINDS:
            raise ValueError(f"unknown kind {kind!r} (the kinds are {', '.join(MEDIA_KINDS)})")
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"{kind}: the count must be an integer >= 0, got {count!r}")
    return {kind: given.get(kind, DEFAULT_MM_LIMIT) for kind in MEDIA_KINDS}


def check_media_counts(where: list[tuple[int, int, dict]], limits: dict[str, int]) -> None:
    """400 naming the first part (`messages[i].content[j]`) past its kind's limit (`--limit-mm-per-prompt`), before
    any part is fetched or decoded."""
    seen = dict.fromkeys(MEDIA_KINDS, 0)
    for i, j, part in where:
        kind = part["type"]
        seen[kind] += 1
        limit = limits.get(kind, DEFAULT_MM_LIMIT)
        if seen[kind] > limit:
            cause = (f"this server takes no {kind} parts" if limit == 0 else
                     f"at most {limit} {kind} part{'s' if limit > 1 else ''} may be given in one request, and this "
                     f"is {kind} part {seen[kind]}")
            raise bad_request(f"messages[{i}].content[{j}]: {cause} (--limit-mm-per-prompt)",
                              f"messages[{i}].content[{j}]")


async def chat_media(engine: EngineLike, req: P.ChatCompletionRequest | P.TokenizeRequest, state: ServerState,
                     request: Request | None = None) -> list[Item]:
    """The images, audio clips and videos of the chat's messages, in order: their bytes had as the server's media
    policy allows (data URIs, allowed files and downloads: server/media_fetch.py; the files and downloads of one
    request together no more than its body limit, so that a URL brings no more than the client could have sent
    itself), decoded and preprocessed in the thread pool;
    400 naming the part (`messages[i].content[j]`) when one cannot be used (a URL not allowed, a fetch that fails,
    times out or passes --max-media-bytes; undecodable, too long, too short, too wide), the model has no tower
    for it or the request carries more parts of its kind than --limit-mm-per-prompt allows (checked first). A fetch
    in progress stops when the client disconnects (`request`) or the handler is cancelled."""
    where = [(i, j, part) for i, m in enumerate(req.messages) if isinstance(m.content, list)
             for j, part in enumerate(m.content) if part["type"] in ("image", "audio", "video")]
    if not where:
        return []
    vision, audio = vision_config(engine), audio_config(engine)
    for i, j, part in where:
        if part["type"] == "image" and vision is None:
            raise bad_request("This model does not take images (it has no vision tower).",
                              f"messages[{i}].content[{j}]")
        if part["type"] == "video" and (vision is None or vision.video_token_id is None):
            raise bad_request("This model does not take videos (it has no vision tower or no video token).",
                              f"messages[{i}].content[{j}]")
        if part["type"] == "audio" and audio is None:
            raise bad_request("This model does not take audio (it has no audio tower).",
                              f"messages[{i}].content[{j}]")
    check_media_counts(where, state.config.limit_mm_per_prompt)
    budget = image_budget(req) if any(part["type"] == "image" for _, _, part in where) else DEFAULT_BUDGET

    def load_image(data: bytes) -> ImagePatches:
        image = preprocess(decode(data), budget, patch_size=vision.patch_size, pooling=vision.pooling,
                           processor=vision.image_processor)
        try:
            check_fits(image, vision)
        except ValueError as e:
            raise ImageError(str(e)) from None
        return image

    def load_audio(data: bytes) -> np.ndarray:
        wave = decode_audio(data, max_seconds=MAX_AUDIO_SECONDS)
        try:
            audio_tokens(audio, wave)
        except ValueError as e:
            raise AudioError(str(e), "too_short") from None
        return wave

    def load_video(data: bytes) -> Video:
        video = decode_video(data, patch_size=vision.patch_size, pooling=vision.pooling)
        try:
            for frame in video.frames:
                check_fits(frame.patches, vision)
        except ValueError as e:
            raise VideoError(str(e)) from None
        return video

    policy = state.config.media_policy

    async def read_all() -> list[Item]:
        out: list[Item] = []
        left = body_limit(state)                 # what the request's files and downloads may bring together
        for i, j, part in where:
            try:
                if part["type"] == "audio":
                    data = await asyncio.to_thread(decode_base64, part["data"], "input_audio.data",
                                                   policy.max_media_bytes)
                else:
                    data = await media_bytes(part["url"], policy, left)
                    if not part["url"].startswith("data:"):
                        left -= len(data)
                load = {"image": load_image, "video": load_video, "audio": load_audio}[part["type"]]
                out.append(await asyncio.to_thread(load, data))
            except (ImageError, AudioError, VideoError, MediaURLError) as e:
                raise bad_request(f"messages[{i}].content[{j}]: {e}", f"messages[{i}].content[{j}]") from None
        return out

    if request is None:
        return await read_all()
    reading = asyncio.ensure_future(read_all())
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({reading, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not reading.done():          # the client left (or the handler was cancelled): stop the fetches
            reading.cancel()
    if not reading.done() or reading.cancelled():
        raise bad_request("The client closed the connection while its media were read.", "messages")
    return reading.result()


async def with_grammar(engine: EngineLike, params: SamplingParams, chat: RenderedChat) -> SamplingParams:
    """`params` with the rendered request's grammar (`chat_structured`), if it has one."""
    structured = await chat_structured(engine, chat.plan, chat.ids, chat.thinking)
    return params if structured is None else dataclasses.replace(params, structured=structured)


def with_thought_budget(engine: EngineLike, params: SamplingParams, chat: RenderedChat,
                        tokens: int | None) -> SamplingParams:
    """`params` with a budget of `tokens` thought tokens (Anthropic's thinking.budget_tokens), when it has one and
    the model may think (thinking on, or a prompt that ends inside a thought): the engine closes a thought that
    reaches it (`gem4.structured.spec.ThoughtBudget`)."""
    sp = engine.tokenizer.special
    if tokens is None or sp.channel_start is None or sp.channel_end is None:
        return params
    lead = lead_of(engine.tokenizer, chat.ids, chat.thinking)
    if lead == Lead.ANSWER:
        return params
    inside = lead in (Lead.OPEN_THOUGHT, Lead.OPEN_CHANNEL)
    return dataclasses.replace(params, thought_budget=ThoughtBudget(tokens, sp.channel_start, sp.channel_end, inside))


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


def _message_dict(m) -> dict:
    """A validated message as the plain dict `gem4.chat` renders."""
    d: dict[str, Any] = {"role": m.role}
    if m.role in ("system", "developer"):
        d["content"] = P.content_text(m.content)      # the templates expect a string here
    elif isinstance(m.content, list):                 # a media part renders as its placeholder; the data stays here
        d["content"] = [{"type": p["type"]} if p["type"] in ("image", "audio", "video") else p for p in m.content]
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


def template_kwargs(defaults: dict, requested: dict | None) -> tuple[bool, dict]:
    """(enable_thinking, the other template variables): the server's defaults updated by the request's."""
    kwargs = {**defaults, **(requested or {})}
    bad = sorted(set(kwargs) & _RESERVED_TEMPLATE_KWARGS)
    if bad:
        raise bad_request(f"chat_template_kwargs may not set {', '.join(bad)}", "chat_template_kwargs")
    thinking = kwargs.pop("enable_thinking", False)
    if not isinstance(thinking, bool):
        raise bad_request("chat_template_kwargs.enable_thinking must be a boolean", "chat_template_kwargs")
    return thinking, kwargs


def render_chat(tokenizer, messages, tools, *, add_generation_prompt: bool, enable_thinking: bool,
                kwargs: dict, budget: RenderBudget | None = None, continue_final_message: bool = False) -> list[int]:
    """Render + tokenize (runs in the render pool; `budget` counts the render's CPU time); template failures
    are the request's fault."""
    import jinja2

    try:
        return encode_prompt(tokenizer, messages, tools, add_generation_prompt=add_generation_prompt,
                             enable_thinking=enable_thinking, budget=budget,
                             continue_final_message=continue_final_message, **kwargs)
    except RenderAborted as e:
        if e.reason == "cancelled":
            raise
        raise bad_request(f"Rendering the chat template took longer than this server allows ({budget.seconds:g} s, "
                          f"--max-render-seconds): the template's time grows with the square of the number of "
                          f"messages. Please reduce the number of messages.", "messages",
                          code="render_time_exceeded") from None
    except RecursionError:
        raise bad_request("The chat template could not render the request: its messages or tools are nested "
                          "too deeply.", "messages") from None
    except ChatTemplateError as e:
        raise bad_request(f"The chat template rejected the messages: {e}", "messages") from None
    except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError) as e:
        raise bad_request(f"The chat template could not render the request: {type(e).__name__}: {e}",
                          "messages") from None


def tools_for(req: P.ChatCompletionRequest) -> tuple[list[dict] | None, frozenset[str]]:
    """The tools the template declares and the parser accepts, from tools + tool_choice ("required" and a
    named choice are grammars: `chat_structured`)."""
    choice = req.tool_choice
    if not req.tools or choice == "none":
        return None, frozenset()
    names = [t.function.name for t in req.tools]
    if len(set(names)) != len(names):
        raise bad_request("tool function names must be unique", "tools")
    tools = [t.model_dump(exclude_none=True) for t in req.tools]
    return tools, frozenset(names)


# ---------------------------------------------------------------------------------------------
# Constrained decoding: the request's grammar (gem4.structured.grammars), compiled before admission
# ---------------------------------------------------------------------------------------------


async def chat_plan_of(req: P.ChatCompletionRequest, tools: list[dict] | None) -> Plan | None:
    """The grammar a chat request asks for (tool_choice required / named, strict tools, response_format,
    structured_outputs) but its lead, or None; 400 naming the parameter the compiler cannot honour. Before
    the template renders anything: a schema is checked (and bounded) before the prompt it is part of."""
    choice = req.tool_choice.model_dump() if isinstance(req.tool_choice, P.NamedToolChoice) else req.tool_choice
    if (choice == "required" or isinstance(choice, dict)) and not tools:
        raise bad_request("tool_choice 'required' or a named tool needs 'tools'", "tool_choice")
    if (choice in (None, "auto", "none") and req.structured_outputs is None
            and (req.response_format is None or req.response_format.type == "text")
            and not any(t["function"].get("strict") for t in tools or [])):
        return None                     # nothing to constrain (the common case): no trip to the thread pool
    return await _off_loop(lambda: chat_plan(
        tools=tools, tool_choice=choice, parallel_tool_calls=req.parallel_tool_calls,
        response_format=req.response_format.wire() if req.response_format else None,
        structured_outputs=req.structured_outputs.wire() if req.structured_outputs else None))


async def chat_structured(engine: EngineLike, plan: Plan | None, prompt_ids: list[int],
                          thinking: bool) -> GrammarSpec | None:
    """The plan's grammar with the lead the rendered prompt allows, compiled (`compiled`)."""
    if plan is None:
        return None
    return await compiled(engine, plan.spec(lead_of(engine.tokenizer, prompt_ids, thinking)), plan)


async def completion_structured(engine: EngineLike, req: P.CompletionRequest) -> GrammarSpec | None:
    """The grammar of a completion request's structured_outputs, compiled, or None; 400 as for chat."""
    if req.structured_outputs is None:
        return None
    plan = await _off_loop(lambda: completion_plan(req.structured_outputs.wire()))
    return await compiled(engine, plan.spec(Lead.ANSWER), plan)


async def compiled(engine: EngineLike, spec: GrammarSpec, plan: Plan) -> GrammarSpec:
    """`spec`, compiled against the engine's grammar vocabulary in the thread pool (the engine reuses that
    compile); 400 naming the plan's parameter when it does not compile."""
    vocab = getattr(engine, "grammar_vocab", None)
    stats = getattr(engine, "grammar_stats", None)
    if vocab is None:
        asked_by = "tool_choice" if plan.kind in ("tools_required", "tools_named") else plan.param.split(".")[0]
        raise bad_request("This server's engine does not support constrained decoding (it has no grammar "
                          "vocabulary).", asked_by)
    await _off_loop(lambda: validate(spec, plan.param, vocab, stats.compile if stats is not None else None))
    return spec


async def _off_loop(work: Callable[[], Any]) -> Any:
    """`work()` in the thread pool, its GrammarError as a 400."""
    try:
        return await asyncio.to_thread(work)
    except GrammarError as e:
        raise bad_request(e.message, e.param) from None


# ---------------------------------------------------------------------------------------------
# SamplingParams
# ---------------------------------------------------------------------------------------------


def sampling_params(req: P.SamplingRequest, vocab_size: int, *, max_tokens: int | None, stop: list[str],
                    logprobs: bool, top_logprobs: int) -> SamplingParams:
    """The request's sampling fields as SamplingParams; 400 naming the field the engine would refuse."""
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


def vocab_size(engine: EngineLike) -> int:
    return getattr(engine, "vocab_size", None) or engine.tokenizer.vocab_size
