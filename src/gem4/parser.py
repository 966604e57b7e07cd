"""Streaming parser of Gemma 4 model output: token ids -> reasoning, content and tool calls.

One incremental state machine over the generated token ids (docs/gemma4.md §7.2-7.5). Structural tokens
are recognised by id (`<|channel>` 100, `<channel|>` 101, `<|tool_call>` 48, `<tool_call|>` 49,
`<|"|>` 52, the stop tokens 1 / 106 / 50 ...), so a delimiter can never be half-seen and never
leaks into text; ordinary tokens go through the incremental detokenizer, so text is only ever
emitted as complete UTF-8.

    output  := [<|turn>model\\n] (thought | text | call)* [stop]
    thought := <|channel> "thought" ws* REASONING <channel|>
    call    := <|tool_call> "call:" NAME "{" ARGS "}" <tool_call|>
    stop    := <turn|> | <eos> | <|tool_response>

`feed(ids)` returns events as they become certain:

- `ReasoningDelta(text)`, `ContentDelta(text)`
- `ToolCallStart(index, id, name)` once `call:NAME{` is complete
- `ToolCallArgsDelta(index, text)`: a fragment of the call's arguments as JSON text; the Gemma
  value syntax (`<|"|>` strings, bare keys, numbers, booleans, null, nested `{}` / `[]`) is
  converted on the fly by `ArgumentDecoder`
- `ToolCallEnd(index, arguments, complete)`

and `finish()` returns the last events; `result` is the `ParseResult` (content, reasoning_content,
tool_calls=[ToolCall(id, name, arguments)], stop token, flags, `finish_reason`). Events are grouped
differently depending on how the ids are chunked, but the result and the concatenation of each kind
of delta do not depend on it: ids are processed one at a time and held text (a partial channel name
or tool-call header) is decided by what follows, never by chunk boundaries.

JSON is emitted so that every prefix can be closed: separators and keys are held until the next
value begins, and a number or literal is emitted when it ends. So a call that is cut off
(`max_tokens`) or malformed is closed by appending the missing `"`, `]` and `}`: the concatenated
`ToolCallArgsDelta`s of every call always parse as JSON and equal `ToolCall.arguments`.

Malformed output never raises:
- a bad tool-call header (`<|tool_call>` not followed by `call:NAME{`) is emitted as plain content
  (without the `<|tool_call>` token); a header cut off by the end of generation is dropped;
- bad arguments after the call was announced close the call (`complete=False`) and the rest of the
  text becomes content;
- stray structural tokens outside their place (`<channel|>` in content, `<|"|>` in text, `<bos>`,
  `<|think|>`, ...) are dropped;
each sets `ParseResult.malformed` (with a message in `errors`), except dropped stray tokens.

With `ignore_eos` (the engine was asked to generate on past its end ids) nothing ends the output: the
stop tokens and a `<|turn>` after the first token are dropped like other stray structural tokens and
the text after them is read on, as vLLM's text goes on past the EOS its detokenizer skips. Otherwise
the parser would read nothing more of what the engine goes on generating.

Where the parser starts: by default in content, with an optional leading `<|turn>model\\n` skipped.
Given the prompt ids, it starts in the state the prompt tail implies: if the prompt ends inside an
open `<|channel>` (thinking, or a continued reasoning prefill), the tail is replayed silently so
that the output is read as reasoning. Prefilled text is not repeated in the result.

For a grammar-constrained decoder (later), the states are explicit: `Gemma4Parser.mode` (a `Mode`),
`ArgumentDecoder.expects()` (what the argument syntax allows next), and `copy()`.
"""
from __future__ import annotations

import codecs
import copy as _copy
import enum
import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Collection, Iterable, Union

__all__ = [
    "Gemma4Parser",
    "ArgumentDecoder",
    "Mode",
    "Expect",
    "ContentDelta",
    "ReasoningDelta",
    "ToolCallStart",
    "ToolCallArgsDelta",
    "ToolCallEnd",
    "Event",
    "ToolCall",
    "ParseResult",
    "parse",
    "gemma_args_to_json",
]


# ---------------------------------------------------------------------------------------------
# Events and result
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArgsDelta:
    index: int
    text: str  # a fragment of JSON text


@dataclass(frozen=True)
class ToolCallEnd:
    index: int
    arguments: str  # the whole arguments JSON (= the concatenated deltas)
    complete: bool  # False: cut off or malformed, closed by the parser


Event = Union[ContentDelta, ReasoningDelta, ToolCallStart, ToolCallArgsDelta, ToolCallEnd]


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of an object
    complete: bool = True


@dataclass(frozen=True)
class ParseResult:
    content: str
    reasoning_content: str | None  # None when the output opened no thought channel
    tool_calls: tuple[ToolCall, ...]
    stop_token_id: int | None  # the end token seen (<turn|>, <eos>, <|tool_response>), or None
    truncated: bool  # ended (finish() without a stop token) inside reasoning or a tool call
    malformed: bool  # some output did not follow the format; see errors
    errors: tuple[str, ...] = ()

    @property
    def finish_reason(self) -> str:
        """OpenAI finish_reason hint: 'tool_calls' if calls were made and the output ended with a
        stop token, 'stop' for a stop token, else 'length' (the engine may know better)."""
        if self.stop_token_id is None:
            return "length"
        return "tool_calls" if self.tool_calls else "stop"


class Mode(enum.Enum):
    TURN_HEADER = "turn_header"  # after a leading <|turn>: the role name up to '\n'
    CONTENT = "content"
    CHANNEL_NAME = "channel_name"  # after <|channel>: expecting "thought"
    REASONING_LEAD = "reasoning_lead"  # after "thought": skipping whitespace
    REASONING = "reasoning"
    CALL_HEADER = "call_header"  # after <|tool_call>: "call:NAME{"
    CALL_ARGS = "call_args"  # inside the argument object (ArgumentDecoder)
    CALL_END = "call_end"  # arguments closed, expecting <tool_call|>
    DONE = "done"  # a stop token was seen; later ids are ignored


# ---------------------------------------------------------------------------------------------
# Gemma 4 argument syntax -> JSON
# ---------------------------------------------------------------------------------------------


class Malformed(Exception):
    def __init__(self, message: str, position: int = 0):
        super().__init__(message)
        self.position = position  # index in the text being fed where it went wrong
        self.held = ""  # text read before that point but not converted (a bad literal or key)


class Expect(enum.Flag):
    """What the argument syntax allows next (for constrained decoding)."""

    NOTHING = 0
    KEY = enum.auto()  # a bare key's first character, or <|"|> opening a quoted key
    KEY_BODY = enum.auto()  # more key characters, ':' (bare) or <|"|> (quoted)
    COLON = enum.auto()
    VALUE = enum.auto()  # <|"|>, '{', '[', a number, true, false, null
    STRING_BODY = enum.auto()  # any text, or <|"|> to close
    LITERAL_BODY = enum.auto()  # more number/literal characters, or what may follow a value
    COMMA = enum.auto()
    CLOSE = enum.auto()  # '}' or ']' closing the innermost container
    WHITESPACE = enum.auto()


_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_LITERALS = {"true": "true", "false": "false", "null": "null", "True": "true", "False": "false", "None": "null"}
_LITERAL_CHAR = re.compile(r"[0-9A-Za-z.+\-_]")
_MAX_KEY = 1024


@dataclass
class _Frame:
    kind: str  # 'dict' | 'list'
    phase: str  # dict: key_or_close, key, colon, value, after_value; list: value_or_close, value, after_value
    n: int = 0  # values started in this container


class ArgumentDecoder:
    """Incremental converter of one Gemma 4 argument object (`{key:value,...}`) to JSON text.

    Feed it text with `feed_text` and the string delimiter token with `feed_quote`; collect the
    JSON fragments with `take()`. Raises `Malformed` (with the position in the fed text) on input
    that cannot be arguments; `close()` then closes what was emitted into valid JSON.
    """

    def __init__(self):
        self.stack: list[_Frame] = []
        self.scalar: str | None = None  # None | 'bare_key' | 'quoted_key' | 'string' | 'literal'
        self.started = False
        self.done = False
        self._key: list[str] = []
        self._literal: list[str] = []
        self._pending = ""  # separator and key held until the next value starts
        self._out: list[str] = []

    # -- output
    def take(self) -> str:
        s = "".join(self._out)
        self._out.clear()
        return s

    def _emit(self, s: str) -> None:
        if s:
            self._out.append(s)

    # -- input
    def feed_text(self, text: str) -> int:
        """Consume text; returns how many characters were used (fewer once the object closes)."""
        i, n = 0, len(text)
        while i < n:
            if self.done:
                return i
            if self.scalar == "string":
                # everything up to the next delimiter token is string content
                self._emit(json.dumps(text[i:], ensure_ascii=False)[1:-1])
                return n
            try:
                self._char(text[i])
            except Malformed as e:
                e.position = i
                e.held = self._held_text()
                raise
            i += 1
        return n

    def feed_quote(self) -> None:
        """The `<|"|>` token."""
        if self.done:
            raise Malformed("string delimiter after the arguments closed")
        s = self.scalar
        if s == "string":
            self._emit('"')
            self.scalar = None
            return
        if s == "quoted_key":
            self._set_key("".join(self._key))
            self.scalar = None
            self.stack[-1].phase = "colon"
            return
        if s is not None:
            e = Malformed(f"string delimiter inside a {s.replace('_', ' ')}")
            e.held = self._held_text()
            raise e
        if not self.stack:
            raise Malformed("arguments must be an object")
        f = self.stack[-1]
        if f.kind == "dict" and f.phase in ("key_or_close", "key"):
            self.scalar = "quoted_key"
            self._key = []
        elif f.phase in ("value", "value_or_close"):
            self._start_value()
            self._emit('"')
            self.scalar = "string"
        else:
            raise Malformed(f"unexpected string in {f.kind} ({f.phase})")

    def close(self) -> None:
        """Close everything open so that the emitted JSON is complete (cut-off or bad input)."""
        if self.done:
            return
        if self.scalar == "string":
            self._emit('"')
        elif self.scalar == "literal":
            try:
                self._finish_literal()
            except Malformed:
                pass
        self.scalar = None
        while self.stack:
            self._emit("}" if self.stack.pop().kind == "dict" else "]")
        if not self.started:
            self._emit("{}")
            self.started = True
        self.done = True

    def expects(self) -> Expect:
        """What may come next (see `Expect`)."""
        if self.done:
            return Expect.NOTHING
        if not self.stack:
            return Expect.WHITESPACE | Expect.VALUE
        if self.scalar == "string":
            return Expect.STRING_BODY
        if self.scalar in ("bare_key", "quoted_key"):
            return Expect.KEY_BODY
        f = self.stack[-1]
        after_value = Expect.WHITESPACE | Expect.COMMA | Expect.CLOSE
        if self.scalar == "literal":
            return Expect.LITERAL_BODY | after_value
        if f.phase == "key_or_close":
            return Expect.WHITESPACE | Expect.KEY | Expect.CLOSE
        if f.phase == "key":
            return Expect.WHITESPACE | Expect.KEY
        if f.phase == "colon":
            return Expect.WHITESPACE | Expect.COLON
        if f.phase == "value":
            return Expect.WHITESPACE | Expect.VALUE
        if f.phase == "value_or_close":
            return Expect.WHITESPACE | Expect.VALUE | Expect.CLOSE
        return after_value

    # -- internals
    def _held_text(self) -> str:
        if self.scalar == "literal":
            return "".join(self._literal)
        if self.scalar in ("bare_key", "quoted_key"):
            return "".join(self._key)
        return ""

    def _char(self, c: str) -> None:
        s = self.scalar
        if s == "quoted_key":
            self._key.append(c)
            if len(self._key) > _MAX_KEY:
                raise Malformed("key too long")
            return
        if s == "bare_key":
            if c == ":":
                key = "".join(self._key).strip()
                if len(key) >= 2 and key[0] == key[-1] == '"':  # a JSON-style "key"
                    key = key[1:-1]
                self._set_key(key)
                self.scalar = None
                self.stack[-1].phase = "value"
                return
            if c in "{}[],":
                raise Malformed(f"unexpected {c!r} in a key")
            self._key.append(c)
            if len(self._key) > _MAX_KEY:
                raise Malformed("key too long")
            return
        if s == "literal":
            if _LITERAL_CHAR.match(c):
                self._literal.append(c)
                return
            self._finish_literal()  # then c is read in the container context below
        if not self.stack:
            if c.isspace():
                return
            if c != "{":
                raise Malformed("arguments must be an object")
            self._open("dict")
            return
        if c.isspace():
            return
        f = self.stack[-1]
        if f.kind == "dict":
            if f.phase in ("key_or_close", "key"):
                if c == "}":  # (a trailing comma is tolerated)
                    self._close()
                    return
                if c in ":{}[],":
                    raise Malformed(f"expected a key, got {c!r}")
                self.scalar = "bare_key"
                self._key = [c]
                return
            if f.phase == "colon":
                if c != ":":
                    raise Malformed(f"expected ':' after a key, got {c!r}")
                f.phase = "value"
                return
            if f.phase == "value":
                self._value_char(c)
                return
            if c == ",":
                f.phase = "key"
            elif c == "}":
                self._close()
            else:
                raise Malformed(f"expected ',' or '}}', got {c!r}")
            return
        # list
        if f.phase in ("value_or_close", "value"):
            if c == "]":  # (a trailing comma is tolerated)
                self._close()
                return
            self._value_char(c)
            return
        if c == ",":
            f.phase = "value"
        elif c == "]":
            self._close()
        else:
            raise Malformed(f"expected ',' or ']', got {c!r}")

    def _set_key(self, key: str) -> None:
        if not key:
            raise Malformed("empty key")
        f = self.stack[-1]
        self._pending = ("," if f.n else "") + json.dumps(key, ensure_ascii=False) + ":"

    def _start_value(self) -> None:
        # the innermost container gets a value: emit what was held for it
        f = self.stack[-1]
        if f.kind == "list":
            self._pending = "," if f.n else ""
        f.n += 1
        f.phase = "after_value"
        self._emit(self._pending)
        self._pending = ""

    def _value_char(self, c: str) -> None:
        if c == "{" or c == "[":
            self._start_value()
            self._open("dict" if c == "{" else "list")
        elif _LITERAL_CHAR.match(c):
            self.scalar = "literal"
            self._literal = [c]
        else:
            raise Malformed(f"expected a value, got {c!r}")

    def _finish_literal(self) -> None:
        text = "".join(self._literal)
        if text in _LITERALS:
            value = _LITERALS[text]
        elif _NUMBER.fullmatch(text):
            value = text
        else:
            raise Malformed(f"not a number, boolean or null: {text!r}")
        self.scalar = None
        self._literal = []
        self._start_value()
        self._emit(value)

    def _open(self, kind: str) -> None:
        self.started = True
        self._emit("{" if kind == "dict" else "[")
        self.stack.append(_Frame(kind, "key_or_close" if kind == "dict" else "value_or_close"))

    def _close(self) -> None:
        f = self.stack.pop()
        self._pending = ""
        self._emit("}" if f.kind == "dict" else "]")
        if not self.stack:
            self.done = True


def gemma_args_to_json(text: str, quote: str = '<|"|>') -> str:
    """Convert a complete Gemma 4 argument object given as text (with `quote` as the string
    delimiter) to JSON. Raises ValueError if it is malformed. (Convenience for tests and tools.)"""
    d = ArgumentDecoder()
    parts = text.split(quote)
    try:
        for k, part in enumerate(parts):
            if k:
                d.feed_quote()
            used = d.feed_text(part)
            if used < len(part) and part[used:].strip():
                raise Malformed("text after the arguments")
            if d.done and k < len(parts) - 1:
                raise Malformed("text after the arguments")
    except Malformed as e:
        raise ValueError(str(e)) from None
    if not d.done:
        raise ValueError("unterminated arguments")
    return d.take()


# ---------------------------------------------------------------------------------------------
# The output parser
# ---------------------------------------------------------------------------------------------

_NAME_CHAR = re.compile(r"[\w.\-/]")
_MAX_NAME = 256
_MAX_HEADER = 64
_THOUGHT = "thought"
_CALL = "call:"


@dataclass
class _Call:
    id: str
    name: str
    parts: list[str] = field(default_factory=list)
    complete: bool = False


class Gemma4Parser:
    """Incremental Gemma 4 output parser (see the module docstring).

    tokenizer: a `gem4.Tokenizer` (its special ids and piece table are used).
    prompt_ids: the prompt, to start in the state its tail implies (e.g. an open thought channel).
    initial_mode: start in this mode instead (CONTENT or REASONING), for callers that know.
    call_id_prefix: tool call ids are `prefix + index`; default `call_<random hex>_`.
    tool_names: if given, a call to another name is malformed (emitted as content).
    ignore_eos: no token ends the output (see the module docstring).
    """

    def __init__(
        self,
        tokenizer,
        *,
        prompt_ids: Iterable[int] | None = None,
        initial_mode: Mode | None = None,
        call_id_prefix: str | None = None,
        tool_names: Collection[str] | None = None,
        ignore_eos: bool = False,
    ):
        sp = tokenizer.special
        self._pieces = tokenizer.piece_table()
        self._structural = tokenizer.structural_ids
        self._sp = sp
        self._stops = sp.end_of_generation
        self._call_prefix = call_id_prefix if call_id_prefix is not None else f"call_{secrets.token_hex(8)}_"
        self._tool_names = None if tool_names is None else frozenset(tool_names)
        self._ignore_eos = ignore_eos
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

        self.mode = Mode.CONTENT
        self._buf = ""  # held header text (TURN_HEADER, CHANNEL_NAME, CALL_HEADER)
        self._content: list[str] = []
        self._reasoning: list[str] | None = None
        self._calls: list[_Call] = []
        self._args: ArgumentDecoder | None = None
        self._events: list[Event] = []
        self._silent = False
        self._seen = 0  # ids processed
        self.stop_token_id: int | None = None
        self.truncated = False
        self.errors: list[str] = []
        self._finished = False

        if prompt_ids is not None:
            self._prime(list(prompt_ids))
        elif initial_mode is not None:
            if initial_mode == Mode.REASONING:
                self._reasoning = []
            elif initial_mode != Mode.CONTENT:
                raise ValueError(f"initial_mode must be CONTENT or REASONING, got {initial_mode}")
            self.mode = initial_mode

    # ---- public API ---------------------------------------------------------------------------

    def feed(self, ids: Iterable[int]) -> list[Event]:
        """Process generated ids; returns the events they make certain (adjacent deltas merged)."""
        if self._finished:
            raise RuntimeError("feed() after finish()")
        for i in ids:
            self._step(int(i))
        return self._drain()

    def finish(self) -> list[Event]:
        """End of generation: flush held text, close an unfinished call. Returns the last events."""
        if not self._finished:
            self._finished = True
            tail = self._utf8.decode(b"", final=True)
            if tail:
                self._text(tail)
            if self.mode != Mode.DONE:
                self._end_structures(stopped=False)
        return self._drain()

    @property
    def result(self) -> ParseResult:
        """The message so far (final after `finish()`)."""
        return ParseResult(
            content="".join(self._content),
            reasoning_content=None if self._reasoning is None else "".join(self._reasoning),
            tool_calls=tuple(ToolCall(c.id, c.name, "".join(c.parts), c.complete) for c in self._calls),
            stop_token_id=self.stop_token_id,
            truncated=self.truncated,
            malformed=bool(self.errors),
            errors=tuple(self.errors),
        )

    @property
    def args_decoder(self) -> ArgumentDecoder | None:
        """The argument decoder of the call being read (mode CALL_ARGS), else None."""
        return self._args if self.mode == Mode.CALL_ARGS else None

    def copy(self) -> "Gemma4Parser":
        """An independent copy of the whole state (to try a continuation without committing)."""
        return _copy.deepcopy(self)

    def __deepcopy__(self, memo):
        new = object.__new__(Gemma4Parser)
        for k, v in self.__dict__.items():
            if k in ("_pieces", "_structural", "_sp", "_stops", "_tool_names"):
                setattr(new, k, v)  # immutable / shared tables
            elif k == "_utf8":
                d = codecs.getincrementaldecoder("utf-8")(errors="replace")
                d.setstate(v.getstate())
                new._utf8 = d
            else:
                setattr(new, k, _copy.deepcopy(v, memo))
        return new

    # ---- plumbing -------------------------------------------------------------------------------

    def _prime(self, prompt: list[int]) -> None:
        sp = self._sp
        marks = {sp.turn_start, sp.turn_end, sp.channel_start, sp.channel_end, sp.tool_call_start,
                 sp.tool_call_end, sp.tool_response_start, sp.tool_response_end} - {None}
        last = next((k for k in range(len(prompt) - 1, -1, -1) if prompt[k] in marks), None)
        if last is None or prompt[last] != sp.channel_start:
            return  # the output starts a message: content, with an optional <|turn>model\n
        self._silent = True
        for i in prompt[last:]:
            self._step(i)
        self._silent = False
        # what the prompt already said is not part of the answer
        self._content = []
        if self._reasoning is not None:
            self._reasoning = []
        self._events = []

    def _drain(self) -> list[Event]:
        merged: list[Event] = []
        for e in self._events:
            if merged and type(e) is type(merged[-1]):
                last = merged[-1]
                if isinstance(e, (ContentDelta, ReasoningDelta)):
                    merged[-1] = type(e)(last.text + e.text)
                    continue
                if isinstance(e, ToolCallArgsDelta) and e.index == last.index:
                    merged[-1] = ToolCallArgsDelta(e.index, last.text + e.text)
                    continue
            merged.append(e)
        self._events = []
        return merged

    def _error(self, message: str) -> None:
        self.errors.append(message)

    def _emit_content(self, text: str) -> None:
        if text:
            self._content.append(text)
            if not self._silent:
                self._events.append(ContentDelta(text))

    def _emit_reasoning(self, text: str) -> None:
        if text:
            self._reasoning.append(text)
            if not self._silent:
                self._events.append(ReasoningDelta(text))

    def _emit_args(self) -> None:
        frag = self._args.take()
        if frag:
            call = self._calls[-1]
            call.parts.append(frag)
            self._events.append(ToolCallArgsDelta(len(self._calls) - 1, frag))

    # ---- one token ----------------------------------------------------------------------------

    def _step(self, tid: int) -> None:
        self._seen += 1
        if self.mode == Mode.DONE:
            return
        if not 0 <= tid < len(self._pieces):
            self._error(f"token id {tid} outside the vocabulary")
            return
        if tid in self._structural:  # CONTROL / USER_DEFINED: structure, never text
            held = self._utf8.decode(b"", final=True)  # a byte sequence cut by a token
            if held:
                self._text(held)
            self._token(tid)
        else:
            text = self._utf8.decode(self._pieces[tid])
            if text:
                self._text(text)

    def _token(self, tid: int) -> None:
        sp, mode = self._sp, self.mode
        opening = tid == sp.turn_start and self._seen == 1 and mode == Mode.CONTENT
        if not self._ignore_eos and (tid in self._stops or (tid == sp.turn_start and not opening)):
            self._end_structures(stopped=True)
            self.stop_token_id = tid
            self.mode = Mode.DONE
            return
        if opening:  # the output opens with <|turn>model\n
            self.mode = Mode.TURN_HEADER
            self._buf = ""
            return
        if mode == Mode.CONTENT:
            if tid == sp.channel_start:
                self.mode = Mode.CHANNEL_NAME
                self._buf = ""
            elif tid == sp.tool_call_start:
                self._begin_call()
            # anything else here (<channel|>, <tool_call|>, <|"|>, <bos>, ...) is dropped
        elif mode in (Mode.TURN_HEADER, Mode.CHANNEL_NAME):
            self._buf = ""  # an unfinished header is dropped
            self.mode = Mode.CONTENT
            if tid != sp.channel_end:
                self._token(tid)
        elif mode in (Mode.REASONING_LEAD, Mode.REASONING):
            if tid == sp.channel_end:
                self.mode = Mode.CONTENT
            elif tid == sp.tool_call_start:  # a call closes an unclosed thought
                self._begin_call()
        elif mode == Mode.CALL_HEADER:
            self._header_fallback(f"tool call header {self._buf!r} ended by a special token")
            self._token(tid)
        elif mode == Mode.CALL_ARGS:
            if tid == sp.string_delim:
                try:
                    self._args.feed_quote()
                except Malformed as e:
                    self._emit_args()
                    self._abort_call(str(e))
                    self._emit_content(e.held)
                    return
                self._emit_args()
            else:
                self._abort_call(f"arguments not closed before {'<tool_call|>' if tid == sp.tool_call_end else 'a special token'}")
                if tid != sp.tool_call_end:
                    self._token(tid)
        elif mode == Mode.CALL_END:
            self.mode = Mode.CONTENT
            if tid != sp.tool_call_end:  # a missing <tool_call|> is tolerated
                self._token(tid)

    def _end_structures(self, stopped: bool) -> None:
        """The output ends (stop token, or finish() without one) in the current mode."""
        mode = self.mode
        if mode == Mode.CALL_HEADER:
            if stopped:
                self._header_fallback("tool call header ended by a stop token")
            else:  # cut off: a half-written call header is not content
                self.truncated = True
        elif mode == Mode.CALL_ARGS:
            if not stopped:
                self.truncated = True
                self._abort_call(None)
            else:
                self._abort_call("tool call ended by a stop token")
        elif mode in (Mode.REASONING, Mode.REASONING_LEAD, Mode.CHANNEL_NAME) and not stopped:
            self.truncated = True
        self._buf = ""

    # ---- text -----------------------------------------------------------------------------------

    def _text(self, text: str) -> None:
        while text:
            mode = self.mode
            if mode == Mode.CONTENT:
                self._emit_content(text)
                return
            if mode == Mode.REASONING:
                self._emit_reasoning(text)
                return
            if mode == Mode.REASONING_LEAD:
                stripped = text.lstrip()
                if stripped:
                    self.mode = Mode.REASONING
                text = stripped
                continue
            if mode == Mode.TURN_HEADER:
                cut = text.find("\n")
                if cut < 0:
                    self._buf += text
                    if len(self._buf) > _MAX_HEADER:
                        self._error("a turn header without a newline")
                        self.mode = Mode.CONTENT
                        text, self._buf = self._buf, ""
                        continue
                    return
                self._buf = ""
                self.mode = Mode.CONTENT
                text = text[cut + 1 :]
                continue
            if mode == Mode.CHANNEL_NAME:
                text = self._channel_name(text)
                continue
            if mode == Mode.CALL_HEADER:
                text = self._call_header(text)
                continue
            if mode == Mode.CALL_ARGS:
                try:
                    used = self._args.feed_text(text)
                except Malformed as e:
                    self._emit_args()
                    self._abort_call(str(e))
                    text = e.held + text[e.position :]
                    continue
                self._emit_args()
                text = text[used:]
                if self._args.done:
                    self._end_call(complete=True)
                    self.mode = Mode.CALL_END
                continue
            if mode == Mode.CALL_END:
                stripped = text.lstrip()
                if stripped:
                    self._error("text after a tool call's arguments, before <tool_call|>")
                    self.mode = Mode.CONTENT
                text = stripped
                continue
            return  # DONE

    def _channel_name(self, text: str) -> str:
        for k, c in enumerate(text):
            self._buf += c
            if self._buf == _THOUGHT:
                self._buf = ""
                self.mode = Mode.REASONING_LEAD
                if self._reasoning is None:
                    self._reasoning = []
                return text[k + 1 :]
            if not _THOUGHT.startswith(self._buf):
                # not a thought channel: like llama.cpp, drop the <|channel> and keep the text
                held, self._buf = self._buf, ""
                self.mode = Mode.CONTENT
                return held + text[k + 1 :]
        return ""

    def _call_header(self, text: str) -> str:
        for k, c in enumerate(text):
            self._buf += c
            n = len(self._buf)
            if n <= len(_CALL):
                if not _CALL.startswith(self._buf):
                    return self._header_fallback(f"tool call does not start with 'call:': {self._buf!r}", text[k + 1 :])
                continue
            if c == "{":
                name = self._buf[len(_CALL) : -1]
                if not name:
                    return self._header_fallback("tool call without a name", text[k + 1 :])
                if self._tool_names is not None and name not in self._tool_names:
                    return self._header_fallback(f"call to an undeclared tool {name!r}", text[k + 1 :])
                self._start_call(name)
                return text[k + 1 :]
            if not _NAME_CHAR.match(c) or n - len(_CALL) > _MAX_NAME:
                return self._header_fallback(f"bad tool name {self._buf[len(_CALL):]!r}", text[k + 1 :])
        return ""

    # ---- tool calls -----------------------------------------------------------------------------

    def _begin_call(self) -> None:
        self.mode = Mode.CALL_HEADER
        self._buf = ""

    def _header_fallback(self, message: str, rest: str = "") -> str:
        """A call header that is not one: its text is content. Returns the text still to read."""
        self._error(message)
        held, self._buf = self._buf, ""
        self.mode = Mode.CONTENT
        self._emit_content(held)
        return rest

    def _start_call(self, name: str) -> None:
        index = len(self._calls)
        call = _Call(id=f"{self._call_prefix}{index}", name=name)
        self._calls.append(call)
        self._buf = ""
        self._events.append(ToolCallStart(index, call.id, name))
        self._args = ArgumentDecoder()
        self._args.feed_text("{")
        self.mode = Mode.CALL_ARGS
        self._emit_args()

    def _end_call(self, complete: bool) -> None:
        call = self._calls[-1]
        call.complete = complete
        self._events.append(ToolCallEnd(len(self._calls) - 1, "".join(call.parts), complete))
        self._args = None

    def _abort_call(self, message: str | None) -> None:
        """Close the current call's JSON as it stands; message None means cut off (not malformed)."""
        if message is not None:
            self._error(message)
        self._args.close()
        self._emit_args()
        self._end_call(complete=False)
        self.mode = Mode.CONTENT


def parse(tokenizer, ids: Iterable[int], **kwargs) -> ParseResult:
    """Parse a whole output at once (`Gemma4Parser(tokenizer, **kwargs)`, feed, finish)."""
    p = Gemma4Parser(tokenizer, **kwargs)
    p.feed(ids)
    p.finish()
    return p.result
