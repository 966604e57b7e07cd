"""Engine events -> OpenAI output: chat deltas and messages, completion text, logprobs, usage.

Why chat stop strings apply here, to the content, and not in the engine: the engine matches stop
strings against all the text it generates, so one would also end the reply inside the reasoning or
inside a tool call's arguments; only the output parser knows which text is content, and it reads the
token ids of the engine's events, after the engine. So a chat request reaches the engine without its
stop strings (`SamplingParams.stop` is empty) and `ChatOutput` applies them to the content the parser
yields: when one matches, the reply ends there and the engine request is aborted. A completion has no
such structure; its stop strings go to the engine.

The parser and the engine end a reply at the same tokens: with `ignore_eos` (`SamplingParams.goes_past_end`)
the parser reads on past the end ids as the engine generates on past them, so the text after them is
streamed too (as vLLM's is); and where the parser still reads an end the engine does not stop at (a
`<|turn>` opening another turn), the reply ends there, as at a stop string, and the engine stops it.
Otherwise every token after it would be generated for nothing, up to max_tokens, and a stream would
send nothing all that time (its logprobs piling up for the last chunk).

Chat output: the token ids of each event go through `Gemma4Parser` (prompt-aware, so a prompt that
leaves a thought channel open is read as reasoning). Reasoning goes to `reasoning_content` (and
`reasoning`), tool calls to `tool_calls` (only calls to declared tools; anything else stays
content), the rest to `content`. With `parallel_tool_calls=false` the reply ends after the first
complete call the way it ends at a stop string. Streaming and non-streaming run the same code
(`ChatOutput`), so they give the same message for the same seed.

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

from dataclasses import dataclass

from gem4.engine import GenerationEvent
from gem4.parser import (
    ContentDelta,
    Gemma4Parser,
    Mode,
    ReasoningDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
)
from gem4.server import protocol as P
from gem4.server.request import ServerRequest
from gem4.stops import StopStrings

# ---------------------------------------------------------------------------------------------
# Chat: engine events -> OpenAI deltas and the final message
# ---------------------------------------------------------------------------------------------


@dataclass
class _Call:
    id: str
    name: str
    arguments: str = ""


class ChatOutput:
    """Turns one chat request's engine events into OpenAI deltas; keeps the final message.

    `feed(event)` returns the deltas the event made certain; `done` is set when the reply is
    complete (the engine finished, or the server ended it early: a stop string, the first tool
    call with parallel_tool_calls=false, or an end token the engine does not stop at).
    """

    def __init__(self, tokenizer, prompt_ids: list[int], *, tool_names: frozenset[str], stop: list[str],
                 parallel_tool_calls: bool, logprobs: bool, top_logprobs: int, ignore_eos: bool):
        self.tokenizer = tokenizer
        self.parser = Gemma4Parser(tokenizer, prompt_ids=prompt_ids, tool_names=tool_names, ignore_eos=ignore_eos)
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
        self.stop_sequence: str | None = None     # the stop string that ended it, if one did
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
            if self._early is None and not event.finished and self.parser.mode is Mode.DONE:
                self._early = "stop"              # an end the engine does not stop at: the reply ends here
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
                    self.stop_sequence = matched
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
        return self._content_delta(self.stops.flush()) if self.stop_sequence is None else []

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


# ---------------------------------------------------------------------------------------------
# Completions: engine events -> text pieces and legacy logprobs
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# Tokens and usage
# ---------------------------------------------------------------------------------------------


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


def usage_of(gen: ServerRequest, outs) -> P.Usage:
    """The request's usage: the prompt once, the completion tokens of every choice, and the prompt tokens
    read from the prefix cache (OpenAI's prompt_tokens_details.cached_tokens)."""
    n_prompt, n_completion = len(gen.prompt_ids), sum(o.n_tokens for o in outs)
    return P.Usage(prompt_tokens=n_prompt, completion_tokens=n_completion, total_tokens=n_prompt + n_completion,
                   prompt_tokens_details=P.PromptTokensDetails(cached_tokens=gen.cached_tokens))
