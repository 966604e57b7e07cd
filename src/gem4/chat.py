"""Chat rendering: OpenAI-shaped messages -> the Gemma 4 prompt text, and the stop ids.

One renderer produces every prompt (docs/gemma4.md §7): a Jinja template, rendered the way
transformers 5.23 `apply_chat_template` renders it: a jinja2 `ImmutableSandboxedEnvironment` with
`trim_blocks`, `lstrip_blocks` and `loopcontrols`; the `raise_exception` and `strftime_now`
globals; a `tojson` filter that is plain `json.dumps` (no HTML escaping, `ensure_ascii=False`);
a restricted `dict` and `namespace`; a no-op `{% generation %}` block; `bos_token`, `eos_token`,
`unk_token`, `pad_token`, `mask_token` as variables; top-level `None` message fields dropped; and
`reasoning`/`reasoning_content`/`thinking` aliased to one another.

Which template: the checkpoint's own (GGUF `tokenizer.chat_template`, or `chat_template.jinja` /
`tokenizer_config.json` in an HF directory; `Tokenizer.chat_template`). A checkpoint that carries
none gets the official Gemma 4 template C (`google-gemma-4-31B-it.jinja`, docs/gemma4.md §7.1),
which ships in the package (`gem4/templates/`, MIT, from llama.cpp; `official_template()`).
Choice: the fallback renders that file through the same Jinja path rather than a Python
re-implementation of it. Template C then owns the Gemma 4 turn and tool syntax alone; a second
renderer would be a second owner kept equal to it only by tests. (gem4 had such a renderer; the
switch left every prompt of the tests/test_chat.py corpus unchanged, and those tests check the
fallback against transformers rendering template C.)

Before the template runs, `prepare_messages` normalises OpenAI wire shapes (ours and llama.cpp's
conventions, not transformers'; documented so that tests can reproduce them):

- `tool_calls[].function.arguments` given as a JSON *string* (the OpenAI wire format) is parsed into
  an object, since the Gemma templates format argument objects (llama.cpp `chat.cpp` does the same).
- For an older Gemma 4 template that lacks template C's OpenAI `role:"tool"` support (templates A,
  the GGUF-embedded one, and B; detected as llama.cpp does by the missing
  `{#- OpenAI Chat Completions:` marker), `assistant(tool_calls) -> tool+ -> [assistant(content)]`
  runs are folded into one assistant message with `tool_responses` (`convert_tool_messages`, the
  rewrite llama.cpp applies, docs/gemma4.md §7.1). Responses are matched to calls by `tool_call_id`,
  then by position.

The end-of-generation ids are `<eos>`, `<turn|>` and `<|tool_response>` (`SpecialIds.end_of_generation`).
`encode_prompt` renders and tokenizes in one go and applies llama.cpp's one prompt fix-up (a prompt
that ends in `<turn|>\\n` gets `<|turn>model\\n`).

Nothing here imports torch.
"""
from __future__ import annotations

import contextvars
import dataclasses
import json
import math
import threading
import time
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from importlib import resources
from typing import Any, Sequence

__all__ = [
    "ChatTemplateError",
    "RenderAborted",
    "RenderBudget",
    "TURN_TOKENS",
    "min_prompt_tokens",
    "render",
    "render_jinja",
    "check_template",
    "official_template",
    "prepare_messages",
    "convert_tool_messages",
    "encode_prompt",
    "is_gemma4_template",
    "DEFAULT_SPECIAL_TOKENS",
]

GEMMA4_TEMPLATE_MARKER = "<|tool_call>call:"  # how llama.cpp recognises a Gemma 4 template
OPENAI_TOOL_MARKER = "{#- OpenAI Chat Completions:"  # template C handles role:"tool" itself

DEFAULT_SPECIAL_TOKENS = {
    "bos_token": "<bos>",
    "eos_token": "<eos>",
    "unk_token": "<unk>",
    "pad_token": "<pad>",
    "mask_token": "<mask>",
}

# the turn markers of llama.cpp's prompt fix-up (docs/gemma4.md §7.3)
TURN_START, TURN_END = "<|turn>", "<turn|>"

OFFICIAL_TEMPLATE = "google-gemma-4-31B-it.jinja"  # template C, package data in gem4/templates/

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(ValueError):
    """The messages cannot be rendered (raised by a template's `raise_exception`, or by bad input)."""


class RenderAborted(ChatTemplateError):
    """A render stopped at a checkpoint: its `RenderBudget` ran out (`reason` "budget") or was cancelled
    (`reason` "cancelled": the client went away); `seconds`: the CPU time it had taken."""

    def __init__(self, reason: str, seconds: float):
        super().__init__(f"rendering {'ran past its budget' if reason == 'budget' else 'was cancelled'} "
                         f"after {seconds:.2f} s")
        self.reason = reason
        self.seconds = seconds


class RenderBudget:
    """How much CPU time one render may take, and a flag another thread sets to stop it (`cancel()`).

    A template cannot be interrupted from outside its thread, so it is stopped from inside: the
    sandbox routes every attribute access, item access and call of the template through its
    `getattr` / `getitem` / `call` methods, and gem4's environment checks the budget of the render
    in progress there (`check`), raising `RenderAborted`. Every loop of the Gemma 4 templates reads
    a message or a namespace attribute in its body, so a render stops within tens of microseconds of
    its deadline or its cancellation. (A loop that touches no attribute, item or call is not checked
    inside; the sandbox caps each `range()` at 100,000 items.)

    The budget counts the rendering thread's CPU time (`time.thread_time`), not the wall clock, so that a
    render does not run out of time while others hold the GIL. Long renders take turns: once a render
    has used `LONG` s of CPU it renders only while it holds the one long-render lane (`_LANE`), a slice of
    `SLICE` s at a time, giving the lane and the GIL away between slices (a render waiting for the
    lane uses no CPU, and sees a cancellation within `WAIT` s). However many long renders run, the
    event loop, the engine thread and every short render (an ordinary chat renders in a few
    milliseconds) compete with one of them at a time, and wait for the GIL a fraction of a millisecond
    rather than a whole switch interval (5 ms) each time they need it. Measured: a thread that sleeps
    0.5 ms and computes 50 us, 200 times, ran 1.2-1.4x slower beside one long render, 1.3-2.2x beside
    two and 1.8-3x beside six; without the lane and the turns, 10x, 10-23x and 75x. The turns cost a
    long render about 9 % more CPU.
    """

    EVERY = 32              # checkpoints between clock reads: tens of microseconds of template work
    LONG = 0.02             # s of CPU after which a render is long: it renders in the lane
    SLICE = 0.0002          # s of CPU a long render does per turn in the lane
    WAIT = 0.25             # s between two looks at `cancelled` while waiting for the lane

    def __init__(self, seconds: float | None):
        self.seconds = seconds
        self.cancelled = False
        self._in_lane = False
        self.begin()

    def begin(self) -> None:
        """Start counting (in the thread that renders: the CPU time counted is that thread's)."""
        self.start = time.thread_time()
        self.deadline = math.inf if self.seconds is None else self.start + self.seconds
        self._turn_at = self.start + self.LONG
        self._ticks = 0

    def cancel(self) -> None:
        """Stop the render at its next checkpoint (safe from any thread)."""
        self.cancelled = True

    def check(self) -> None:
        self._ticks -= 1
        if self._ticks > 0:
            return
        self._ticks = self.EVERY
        now = time.thread_time()
        if self.cancelled:
            raise RenderAborted("cancelled", now - self.start)
        if now > self.deadline:
            raise RenderAborted("budget", now - self.start)
        if now >= self._turn_at:
            self._next_turn()
            self._turn_at = time.thread_time() + self.SLICE

    def _next_turn(self) -> None:
        """Give the lane (if held) and the GIL away, then wait for the lane (still cancellable)."""
        if self._in_lane:
            self._in_lane = False
            _LANE.release()
        time.sleep(0)
        while not _LANE.acquire(timeout=self.WAIT):
            if self.cancelled:
                raise RenderAborted("cancelled", time.thread_time() - self.start)
        self._in_lane = True

    def end(self) -> None:
        """The render is over (finished or stopped): give the lane back if it holds it."""
        if self._in_lane:
            self._in_lane = False
            _LANE.release()


_LANE = threading.Lock()    # held by the one long render that may run now (RenderBudget)

# The budget of the render running in this thread (None: unbounded), read at every checkpoint.
_BUDGET: contextvars.ContextVar[RenderBudget | None] = contextvars.ContextVar("gem4_render_budget", default=None)


# The fewest tokens one message renders to under the Gemma 4 templates (A, B and C, docs/gemma4.md §7.1),
# measured with the real tokenizer and empty content (tests/test_chat.py checks every shape): a user,
# system or developer turn is `<|turn>ROLE\n` + text + `<turn|>\n` (5 tokens); an assistant turn that
# continues an assistant turn is `<turn|>\n` alone under template C (2). A tool message renders as a
# tool response of 10 or more tokens after the call it answers, and template C drops one that answers
# no call: it is charged 1, so that no conversation is free to walk over.
TURN_TOKENS = {"user": 5, "system": 5, "developer": 5, "assistant": 2, "tool": 1}


def min_prompt_tokens(roles: Sequence[str]) -> int:
    """A lower bound on the tokens a conversation with these message roles renders to under a Gemma 4
    template, whatever the messages say (`TURN_TOKENS`, plus `<bos>`): known before rendering."""
    return 1 + sum(TURN_TOKENS.get(r, 1) for r in roles)


# ---------------------------------------------------------------------------------------------
# Public entry points
# ---------------------------------------------------------------------------------------------


def render(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    *,
    add_generation_prompt: bool = True,
    enable_thinking: bool = False,
    template: str | None = None,
    budget: RenderBudget | None = None,
    **kwargs: Any,
) -> str:
    """Render a conversation to the prompt text (it starts with `<bos>`; tokenize it with
    `tokenizer.encode(text, add_bos=False, parse_special=True)`).

    template: Jinja source (typically `tokenizer.chat_template`); None uses the official template C
    shipped in the package (`official_template()`).
    budget: stops the render (`RenderAborted`) when it runs out or is cancelled; None: no limit.
    kwargs: extra template variables (e.g. `bos_token=...` to override the special token strings).
    """
    if template is None:
        template = official_template()
    prepared = prepare_messages(messages, template)
    return render_jinja(
        template,
        prepared,
        tools,
        add_generation_prompt=add_generation_prompt,
        enable_thinking=enable_thinking,
        budget=budget,
        **kwargs,
    )


def encode_prompt(
    tokenizer,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    *,
    add_generation_prompt: bool = True,
    enable_thinking: bool = False,
    template: str | None | bool = True,
    budget: RenderBudget | None = None,
    continue_final_message: bool = False,
    **kwargs: Any,
) -> list[int]:
    """Render with the tokenizer's template and tokenize: the ids to prefill.

    template: True uses `tokenizer.chat_template` (the official template C if it has none), a string
    is Jinja source, None or False forces the official template C. The special token strings come from the
    tokenizer. If a generation prompt was asked for and the rendered text ends with `<turn|>\\n`
    (template C after a model turn that has tool responses and content), `<|turn>model\\n` is
    appended, as llama.cpp does (docs/gemma4.md §7.3). budget: see `render`.
    continue_final_message: the last message is an assistant turn to continue (a prefill, as vLLM's option
    and Anthropic's last assistant message mean it): it renders without a generation prompt and without the
    `<turn|>\\n` that closes it, so the prompt ends inside the model's turn, after its text.
    `ChatTemplateError` if the last message is not the assistant's or the rendering does not end with its
    turn's end.
    """
    if template is True:
        template = tokenizer.chat_template
    elif template is False:
        template = None
    specials = {**DEFAULT_SPECIAL_TOKENS, **tokenizer.special_token_strings(), **kwargs}
    if continue_final_message and (not messages or messages[-1].get("role") != "assistant"):
        raise ChatTemplateError("continuing the final message needs an assistant message last")
    text = render(
        messages,
        tools,
        add_generation_prompt=add_generation_prompt and not continue_final_message,
        enable_thinking=enable_thinking,
        template=template,
        budget=budget,
        **specials,
    )
    if continue_final_message:
        closed = next((end for end in (TURN_END + "\n", TURN_END) if text.endswith(end)), None)
        if closed is None:
            raise ChatTemplateError(f"the template did not end the final assistant message with {TURN_END}, so it "
                                    f"cannot be continued")
        text = text[:-len(closed)]
    elif add_generation_prompt and text.endswith(TURN_END + "\n"):
        text += TURN_START + "model\n"
    bos = specials.get("bos_token")
    add_bos = tokenizer.add_bos and not (bos and text.startswith(bos))
    return tokenizer.encode(text, add_bos=add_bos, parse_special=True)


def is_gemma4_template(template: str | None) -> bool:
    return template is not None and GEMMA4_TEMPLATE_MARKER in template


@lru_cache(maxsize=1)
def official_template() -> str:
    """The official Gemma 4 chat template (template C), read once from the package data."""
    path = resources.files("gem4") / "templates" / OFFICIAL_TEMPLATE
    try:
        return path.read_text(encoding="utf-8")
    except OSError as e:
        raise ChatTemplateError(f"the packaged chat template {OFFICIAL_TEMPLATE} cannot be read: {e}") from e


# ---------------------------------------------------------------------------------------------
# Message preparation
# ---------------------------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    """Deep copy into plain JSON-like Python data (dicts, lists, str, numbers, bools, None)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, str):  # subclasses (enums...) become plain values
        return str.__str__(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):  # pydantic
        return _plain(value.model_dump())
    if callable(getattr(value, "item", None)):  # numpy scalars
        return _plain(value.item())
    raise ChatTemplateError(f"cannot render a value of type {type(value).__name__} in a chat message")


def _alias_reasoning(message: dict) -> dict:
    # transformers: whichever of the three names is set fills `reasoning_content` and `thinking`.
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


def _parse_arguments(message: dict) -> dict:
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return message
    new_calls = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            try:
                parsed = json.loads(fn["arguments"])
            except ValueError:
                parsed = None
            if isinstance(parsed, dict):
                call = {**call, "function": {**fn, "arguments": parsed}}
        new_calls.append(call)
    return {**message, "tool_calls": new_calls}


def prepare_messages(messages: Sequence[Mapping[str, Any]], template: str | None = None) -> list[dict]:
    """The message normalisation both renderers see (see the module docstring)."""
    if not messages:
        raise ChatTemplateError("cannot render an empty conversation")
    out = []
    for m in _plain(list(messages)):
        if not isinstance(m, dict):
            raise ChatTemplateError(f"a chat message must be a mapping, got {type(m).__name__}")
        m = {k: v for k, v in m.items() if v is not None}
        out.append(_alias_reasoning(_parse_arguments(m)))
    if template is not None and is_gemma4_template(template) and OPENAI_TOOL_MARKER not in template:
        out = convert_tool_messages(out)
    return out


def _has_tool_calls(m: dict) -> bool:
    return isinstance(m.get("tool_calls"), list) and len(m["tool_calls"]) > 0


def _has_content(m: dict) -> bool:
    c = m.get("content")
    return isinstance(c, (str, list)) and len(c) > 0


def convert_tool_messages(messages: list[dict]) -> list[dict]:
    """Fold OpenAI `role:"tool"` messages into the assistant message that made the calls.

    `assistant(tool_calls) -> tool+ -> [assistant(content, no tool_calls)]` becomes one
    `assistant` message with `tool_calls`, `tool_responses=[{name, response}]` (a string response
    that parses as JSON is parsed), the final `content` and the first message's `reasoning_content`
    (docs/gemma4.md §7.1; same result as llama.cpp's `convert_tool_responses_gemma4`, except that a
    response is matched to its call by `tool_call_id` first, position second).
    """
    result: list[dict] = []
    i = 0
    while i < len(messages):
        m = messages[i]
        if m.get("role") != "assistant" or not _has_tool_calls(m):
            result.append(m)
            i += 1
            continue
        calls = list(m["tool_calls"])
        by_id = {}
        for c in calls:
            if isinstance(c, dict) and c.get("id") is not None:
                by_id.setdefault(c["id"], c)
        responses = []
        i += 1
        while i < len(messages) and messages[i].get("role") == "tool":
            t = messages[i]
            body = t.get("content")
            if isinstance(body, str):
                try:
                    body = json.loads(body)
                except ValueError:
                    pass
            call = by_id.get(t.get("tool_call_id"))
            if call is None and len(responses) < len(calls):
                call = calls[len(responses)]
            name = ""
            if isinstance(call, dict) and isinstance(call.get("function"), dict):
                name = call["function"].get("name") or ""
            if not name:
                name = t.get("name") or t.get("tool_call_id") or ""
            responses.append({"name": name, "response": body})
            i += 1
        merged: dict[str, Any] = {"role": "assistant", "tool_calls": calls}
        if responses:
            merged["tool_responses"] = responses
        if i < len(messages) and messages[i].get("role") == "assistant":
            nxt = messages[i]
            if not _has_tool_calls(nxt) and _has_content(nxt):
                merged["content"] = nxt["content"]
                i += 1
        if isinstance(m.get("reasoning_content"), str):
            merged["reasoning_content"] = m["reasoning_content"]
            merged = _alias_reasoning(merged)
        result.append(merged)
    return result


# ---------------------------------------------------------------------------------------------
# Jinja rendering, transformers-compatible
# ---------------------------------------------------------------------------------------------


@lru_cache(maxsize=16)
def _compile(template: str):
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    import jinja2.utils
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(jinja2.ext.Extension):
        # `{% generation %}...{% endgeneration %}` marks assistant text for training masks in
        # transformers; for rendering it is the identity.
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    def raise_exception(message):
        raise ChatTemplateError(str(message))

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    class TemplateDict:
        # `dict(...)` without exposing the dict type itself
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        # Namespaces refuse underscore attributes, as in transformers
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")

    sandbox_getattr = ImmutableSandboxedEnvironment.getattr
    sandbox_getitem = ImmutableSandboxedEnvironment.getitem
    sandbox_call = ImmutableSandboxedEnvironment.call
    get_budget = _BUDGET.get

    class BudgetedEnvironment(ImmutableSandboxedEnvironment):
        # every attribute access, item access and call of the template is a checkpoint (RenderBudget)
        def getattr(self, obj, attribute):
            budget = get_budget()
            if budget is not None:
                budget.check()
            return sandbox_getattr(self, obj, attribute)

        def getitem(self, obj, argument):
            budget = get_budget()
            if budget is not None:
                budget.check()
            return sandbox_getitem(self, obj, argument)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja2's own signature
            budget = get_budget()
            if budget is not None:
                budget.check()
            return sandbox_call(__self, __context, __obj, *args, **kwargs)

    env = BudgetedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env.from_string(template)


def check_template(template: str) -> None:
    """Raise ChatTemplateError if `template` is not valid Jinja (a syntax error, with its line)."""
    import jinja2

    try:
        _compile(template)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template syntax error on line {e.lineno}: {e.message}") from None


def render_jinja(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    *,
    add_generation_prompt: bool = True,
    enable_thinking: bool = False,
    budget: RenderBudget | None = None,
    **kwargs: Any,
) -> str:
    """Render already-prepared messages with a Jinja template, as transformers does (budget: see `render`)."""
    import jinja2

    variables = {**DEFAULT_SPECIAL_TOKENS, **_plain(kwargs)}
    compiled = _compile(template)
    token = _BUDGET.set(budget)
    try:
        if budget is not None:
            budget.begin()
            budget.check()                  # cancelled before it started
        return compiled.render(
            messages=[_alias_reasoning({k: v for k, v in m.items() if v is not None}) for m in _plain(list(messages))],
            tools=_plain(list(tools)) if tools is not None else None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            enable_thinking=enable_thinking,
            **variables,
        )
    except ChatTemplateError:
        raise
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"chat template error: {e}") from e
    except (TypeError, KeyError, AttributeError, IndexError) as e:
        raise ChatTemplateError(f"chat template failed on these messages: {e!r}") from e
    finally:
        _BUDGET.reset(token)
        if budget is not None:
            budget.end()
