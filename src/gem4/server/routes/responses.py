"""POST /v1/responses: OpenAI's Responses API (what Codex CLI speaks) as a translation onto the chat path.

The request becomes the equivalent chat request (`protocol_responses.chat_body`): its prompt renders with the
chat template, its tool_choice / text.format become grammars, and `ChatOutput` parses the generated ids into
reasoning, content and tool calls, exactly as for /v1/chat/completions. `ResponseOutput` turns those chat
deltas into Responses output items and stream events; the streamed and the whole reply run the same code,
so they carry the same items.

Differences from chat, for what agents need:

- `max_output_tokens` beyond the context left after the prompt is clamped to it, and a reply cut there is
  `status: "incomplete"` (`incomplete_details.reason: "max_output_tokens"`), not a 400. Only a prompt that
  leaves no room is refused: a 400 `context_length_exceeded`, or, streamed, a `response.failed` event with
  that code (Codex compacts its history on it).
- Streaming is typed SSE: `event: <type>` lines, `sequence_number` increasing from 0, `response.created` and
  `response.in_progress` first, every output item added and done (with its content part, text and argument
  deltas between), and `response.completed` / `response.incomplete` / `response.failed` last. No `[DONE]`.
- `usage.input_tokens_details.cached_tokens` counts the prompt tokens read from the prefix cache (an agent
  that resends its whole history reuses the earlier turns); `output_tokens_details.reasoning_tokens` the
  tokens generated inside the thought channel.
- A finished response made with `store` true is kept (server/store.py, bounded, LRU) with its conversation:
  `previous_response_id` continues it, `GET /v1/responses/{id}` returns it and `DELETE` forgets it.
"""
from __future__ import annotations

import itertools
import json
import re
import secrets
import time
from collections.abc import AsyncIterator, Callable

from fastapi import APIRouter, Request
from pydantic import RootModel

from gem4.engine import EngineError
from gem4.parser import Mode
from gem4.server import protocol as P
from gem4.server import protocol_responses as R
from gem4.server.inputs import parse, render_request, sampling_params, vocab_size, with_grammar
from gem4.server.outputs import ChatOutput
from gem4.server.protocol import APIError, bad_request
from gem4.server.request import PING, EventStream, ServerRequest, whole_reply
from gem4.server.state import ServerState

router = APIRouter()

_THOUGHT = frozenset({Mode.CHANNEL_NAME, Mode.REASONING_LEAD, Mode.REASONING})


def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


@router.post("/v1/responses")
async def responses(request: Request):
    state: ServerState = request.app.state.gem4
    config = state.config
    rreq, engine = await parse(request, R.ResponsesRequest, state)
    R.check_stateless(rreq, state.responses is not None)
    history = _history(state, rreq)
    body, custom = R.chat_body(rreq, history)
    shell = _shell(rreq, _id("resp"), config.served_model_name, stored=state.responses is not None)
    try:                                   # the chat path: its errors name the Responses fields
        req = P.parse_request(P.ChatCompletionRequest, json.dumps(body).encode())
        rendered = await render_request(request, state, engine, req, where="input")
        prompt_ids = rendered.ids
        free = engine.max_model_len - len(prompt_ids)
        max_tokens = free if rreq.max_output_tokens is None else min(rreq.max_output_tokens, free)
        params = sampling_params(req, vocab_size(engine), max_tokens=max_tokens, stop=[], logprobs=req.logprobs,
                                 top_logprobs=req.top_logprobs or 0)
        params = await with_grammar(engine, params, rendered)
    except APIError as e:
        e = R.client_error(rreq, e, history)
        if rreq.stream and e.code == "context_length_exceeded":    # what Codex compacts its history on
            return EventStream(_failed(shell, e.code, e.message), on_close=lambda: None)
        raise e from None
    chat = ChatOutput(engine.tokenizer, prompt_ids, tool_names=rendered.tool_names, stop=req.stop_list(),
                      parallel_tool_calls=req.parallel_tool_calls, logprobs=req.logprobs,
                      top_logprobs=req.top_logprobs or 0, ignore_eos=params.goes_past_end)
    out = ResponseOutput(chat, custom, encrypted="reasoning.encrypted_content" in (rreq.include or []))
    gen = ServerRequest(state, shell["id"], prompt_ids, params, 1, detokenize=False, media=rendered.media)

    def keep(final: dict) -> dict:
        """The finished response, stored with its conversation (store: true, a server with a store)."""
        if rreq.store and state.responses is not None and final["status"] in ("completed", "incomplete"):
            state.responses.put(final, [*history, *R.input_items(rreq), *final["output"]])
        return final

    if rreq.stream:
        return EventStream(_stream(gen, out, shell, config.heartbeat_s, keep), on_close=lambda: gen.close("abort"))
    return await whole_reply(request, gen, [out], lambda: RootModel[dict](keep(out.response(shell, gen))))


@router.get("/v1/responses/{response_id}")
async def get_response(request: Request, response_id: str):
    return _stored(request.app.state.gem4, response_id).response


@router.delete("/v1/responses/{response_id}")
async def delete_response(request: Request, response_id: str):
    state: ServerState = request.app.state.gem4
    _stored(state, response_id)
    state.responses.delete(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


def _stored(state: ServerState, response_id: str):
    """A stored response; 404 if the server has no store or no such response."""
    stored = None if state.responses is None else state.responses.get(response_id)
    if stored is None:
        raise APIError(404, f"Response with id '{response_id}' not found.", param="response_id")
    return stored


def _history(state: ServerState, req: R.ResponsesRequest) -> list[dict]:
    """The conversation `previous_response_id` continues (none without it); 400 naming it when the store does
    not hold it (never stored, stored with store: false, or evicted)."""
    if req.previous_response_id is None:
        return []
    stored = state.responses.get(req.previous_response_id)
    if stored is None:
        raise bad_request(f"Previous response with id '{req.previous_response_id}' not found (responses are kept "
                          f"in memory, at most --responses-store-mb, the least recently used evicted first; one "
                          f"made with store: false is not kept).", "previous_response_id",
                          code="previous_response_not_found")
    return stored.items


def _shell(req: R.ResponsesRequest, response_id: str, model: str, *, stored: bool) -> dict:
    """The response object before any output: the request's settings echoed, as OpenAI echoes them."""
    text = req.text.model_dump(by_alias=True, exclude_none=True) if req.text else {}
    text.setdefault("format", {"type": "text"})
    return {"id": response_id, "object": "response", "created_at": int(time.time()), "status": "in_progress",
            "model": model, "output": [], "error": None, "incomplete_details": None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "parallel_tool_calls": req.parallel_tool_calls, "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": req.reasoning.effort if req.reasoning else None, "summary": None},
            "store": req.store and stored, "temperature": req.temperature, "text": text,
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": req.tools or [], "top_p": req.top_p, "top_logprobs": req.top_logprobs,
            "truncation": "disabled", "metadata": {}, "usage": None}


class ResponseOutput:
    """One response's output items, built from `ChatOutput`'s deltas. `feed(event)` returns the stream events
    (type, fields) the engine event made certain; `items` holds every item (open or done) in output order."""

    def __init__(self, chat: ChatOutput, custom: frozenset[str], *, encrypted: bool):
        self.chat = chat
        self.custom = custom                  # custom tools: their calls are custom_tool_call items
        self.encrypted = encrypted            # include=["reasoning.encrypted_content"]
        self.items: list[dict] = []
        self.reasoning_tokens = 0
        self._open: dict | None = None        # the item being generated
        self._text = ""                       # its text (reasoning or message) or arguments so far
        self._logprobs: list[dict] = []       # its message logprobs
        self._pending: list[dict] = []        # logprobs of the tokens since the last text delta
        self._calls: dict[int, dict] = {}     # chat tool call index -> its item
        self._input = _InputStream()          # the open custom tool call's input, streamed

    @property
    def done(self) -> bool:
        return self.chat.done

    @property
    def finish_reason(self) -> str | None:
        return self.chat.finish_reason

    @property
    def n_tokens(self) -> int:
        return self.chat.n_tokens

    def feed(self, ev) -> list[tuple[str, dict]]:
        before = self.chat.parser.mode
        deltas = self.chat.feed(ev)
        if ev.token_id is not None and (before in _THOUGHT or self.chat.parser.mode in _THOUGHT):
            self.reasoning_tokens += 1
        lp = self.chat.take_logprobs()
        if lp is not None:
            self._pending += [P.dump(t) for t in lp.content]
        events: list[tuple[str, dict]] = []
        for d in deltas:
            if d.reasoning_content:
                events += self._delta("reasoning", d.reasoning_content)
            if d.content:
                events += self._delta("message", d.content)
            for tc in d.tool_calls or []:
                if tc.id is not None:
                    events += self._start_call(tc.index, tc.id, tc.function.name)
                elif tc.function.arguments:
                    events += self._delta("call", tc.function.arguments)
        if self.chat.done:
            events += self._close()
        return events

    # ---- items ----

    def _delta(self, kind: str, text: str) -> list[tuple[str, dict]]:
        events = []
        if kind != "call" and (self._open is None or self._open["type"] != kind):
            events += self._close()
            events += self._add(kind)
        item, where = self._open, {"item_id": self._open["id"], "output_index": len(self.items) - 1}
        self._text += text
        if kind == "reasoning":
            self._pending = []                    # the thought's tokens: no output_text logprobs
            events.append(("response.reasoning_text.delta", {**where, "content_index": 0, "delta": text}))
        elif kind == "message":
            logprobs, self._pending = self._pending, []
            self._logprobs += logprobs
            events.append(("response.output_text.delta", {**where, "content_index": 0, "delta": text,
                                                           "logprobs": logprobs}))
        elif item["type"] == "function_call":
            events.append(("response.function_call_arguments.delta", {**where, "delta": text}))
        else:                                      # a custom tool's input, decoded from its JSON arguments
            delta = self._input.feed(text)
            if delta:
                events.append(("response.custom_tool_call_input.delta", {**where, "delta": delta}))
        return events

    def _add(self, kind: str) -> list[tuple[str, dict]]:
        if kind == "reasoning":
            item, part = {"type": "reasoning", "id": _id("rs"), "summary": [], "status": "in_progress"}, \
                {"type": "reasoning_text", "text": ""}
        else:
            item, part = {"type": "message", "id": _id("msg"), "status": "in_progress", "role": "assistant",
                          "content": []}, {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self._open, self._text, self._logprobs = item, "", []
        self.items.append(item)
        where = {"item_id": item["id"], "output_index": len(self.items) - 1}
        return [("response.output_item.added", {"output_index": len(self.items) - 1, "item": dict(item)}),
                ("response.content_part.added", {**where, "content_index": 0, "part": part})]

    def _start_call(self, index: int, call_id: str, name: str) -> list[tuple[str, dict]]:
        events = self._close()
        if name in self.custom:
            item = {"type": "custom_tool_call", "id": _id("ctc"), "call_id": call_id, "name": name, "input": "",
                    "status": "in_progress"}
        else:
            item = {"type": "function_call", "id": _id("fc"), "call_id": call_id, "name": name, "arguments": "",
                    "status": "in_progress"}
        self._open, self._text, self._pending = item, "", []     # the call's tokens: no output_text logprobs
        self._input = _InputStream()
        self._calls[index] = item
        self.items.append(item)
        return events + [("response.output_item.added", {"output_index": len(self.items) - 1, "item": dict(item)})]

    def _close(self) -> list[tuple[str, dict]]:
        """Finish the open item: its done events, its final form in `items`."""
        item = self._open
        if item is None:
            return []
        self._open = None
        index = len(self.items) - 1
        where = {"item_id": item["id"], "output_index": index}
        events = []
        text = self._text
        if item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            item.update(content=[part], status="completed")
            if self.encrypted:
                item["encrypted_content"] = text       # plain text: gem4 reads it back as it is
            events += [("response.reasoning_text.done", {**where, "content_index": 0, "text": text}),
                       ("response.content_part.done", {**where, "content_index": 0, "part": part})]
        elif item["type"] == "message":
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": self._logprobs}
            item.update(content=[part], status="completed")
            events += [("response.output_text.done", {**where, "content_index": 0, "text": text,
                                                      "logprobs": self._logprobs}),
                       ("response.content_part.done", {**where, "content_index": 0, "part": part})]
        else:
            call = next(c for i, c in enumerate(self.chat.calls) if self._calls.get(i) is item)
            item["status"] = "completed"
            if item["type"] == "function_call":
                item["arguments"] = call.arguments
                events.append(("response.function_call_arguments.done", {**where, "name": item["name"],
                                                                         "arguments": call.arguments}))
            else:
                item["input"] = _custom_input(call.arguments)
                streamed = self._input.sent
                rest = item["input"][len(streamed):] if item["input"].startswith(streamed) else ""
                if rest:                           # what the stream held back (or all of an input not in form)
                    events.append(("response.custom_tool_call_input.delta", {**where, "delta": rest}))
                events.append(("response.custom_tool_call_input.done", {**where, "input": item["input"]}))
        events.append(("response.output_item.done", {"output_index": index, "item": item}))
        return events

    # ---- the response ----

    def response(self, shell: dict, gen: ServerRequest) -> dict:
        """The finished response object: `shell` with the output items, status and usage."""
        incomplete = self.finish_reason == "length"
        n_in, n_out = len(gen.prompt_ids), self.n_tokens
        return {**shell, "status": "incomplete" if incomplete else "completed", "output": self.items,
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "usage": {"input_tokens": n_in, "input_tokens_details": {"cached_tokens": gen.cached_tokens},
                          "output_tokens": n_out,
                          "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
                          "total_tokens": n_in + n_out}}


def _custom_input(arguments: str) -> str:
    """A custom tool's input: the `input` string of its call's arguments (the parser's JSON)."""
    try:
        value = json.loads(arguments).get("input", "")
    except (ValueError, AttributeError):
        return arguments
    return value if isinstance(value, str) else json.dumps(value)


_INPUT_PREFIX = '{"input":"'
_STRING_BODY = re.compile(r'(?:[^"\\]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*')   # whole characters and escapes
_HIGH_SURROGATE = re.compile(r'\\u[dD][89abAB][0-9a-fA-F]{2}$')


class _InputStream:
    """A custom tool call's input, decoded as its JSON arguments arrive, so that it streams: the parser writes a
    call of the function `{"input": string}` as `{"input":"` and then the string's body, each escape whole.
    Arguments of another form (a model that wrote other keys) stream nothing; the input then comes whole when
    the call is done (`ResponseOutput._close`)."""

    def __init__(self):
        self._raw = ""                        # the arguments so far
        self._at = 0                          # where their undecoded part starts (0: before the string)
        self.sent = ""                        # the input decoded (and streamed) so far
        self._off = False                     # not of the form: stream nothing

    def feed(self, text: str) -> str:
        """The input's text the arguments' new `text` completes."""
        if self._off:
            return ""
        self._raw += text
        if not self._at:
            if not self._raw.startswith(_INPUT_PREFIX):
                self._off = not _INPUT_PREFIX.startswith(self._raw)
                return ""
            self._at = len(_INPUT_PREFIX)
        body = _STRING_BODY.match(self._raw, self._at).group()
        high = _HIGH_SURROGATE.search(body)
        head = body if high is None else body[:high.start()]
        if high is not None and (len(head) - len(head.rstrip("\\"))) % 2 == 0:
            body = head                        # half a surrogate pair (an escape, not `\\` + "u..."): wait
        if not body:
            return ""
        new = json.loads(f'"{body}"', strict=False)
        self._at += len(body)
        self.sent += new
        return new


class _Events:
    """Typed SSE frames with `sequence_number` counting from 0."""

    def __init__(self):
        self._seq = itertools.count()

    def __call__(self, kind: str, fields: dict) -> str:
        data = {"type": kind, "sequence_number": next(self._seq), **fields}
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


async def _stream(gen: ServerRequest, out: ResponseOutput, shell: dict, heartbeat_s: float,
                  keep: Callable[[dict], dict]) -> AsyncIterator[str]:
    event = _Events()
    yield event("response.created", {"response": shell})
    yield event("response.in_progress", {"response": shell})
    try:
        while not out.done:
            ev = await gen.next(heartbeat_s)
            if ev is None:
                yield PING                        # nothing yet (a long prefill): keep the connection alive
                continue
            for kind, fields in out.feed(ev):
                yield event(kind, fields)
            if out.done and not ev.finished:      # ended here (a stop string, one call): stop the engine
                gen.end_choice(0, out.finish_reason)
        gen.close(out.finish_reason)
        final = keep(out.response(shell, gen))
        yield event(f"response.{final['status']}", {"response": final})
    except EngineError as e:
        gen.close("error")
        yield event("response.failed", {"response": {**shell, "status": "failed", "output": out.items,
                                                     "error": {"code": "server_error",
                                                               "message": f"Generation failed: {e}"}}})


async def _failed(shell: dict, code: str, message: str) -> AsyncIterator[str]:
    """A streamed request refused before generation: created, in_progress, failed with the error's code."""
    event = _Events()
    yield event("response.created", {"response": shell})
    yield event("response.in_progress", {"response": shell})
    yield event("response.failed", {"response": {**shell, "status": "failed",
                                                 "error": {"code": code, "message": message}}})
