"""Chat rendering: OpenAI-shaped messages -> the Gemma 4 prompt text, and the stop ids.

Two renderers produce the prompt (GEMMA4.md §7):

1. **The checkpoint's own Jinja template** (GGUF `tokenizer.chat_template`, or `chat_template.jinja`
   / `tokenizer_config.json` in an HF directory; `Tokenizer.chat_template`), rendered the way
   transformers 5.23 `apply_chat_template` renders it: a jinja2 `ImmutableSandboxedEnvironment` with
   `trim_blocks`, `lstrip_blocks` and `loopcontrols`; the `raise_exception` and `strftime_now`
   globals; a `tojson` filter that is plain `json.dumps` (no HTML escaping, `ensure_ascii=False`);
   a restricted `dict` and `namespace`; a no-op `{% generation %}` block; `bos_token`, `eos_token`,
   `unk_token`, `pad_token`, `mask_token` as variables; top-level `None` message fields dropped; and
   `reasoning`/`reasoning_content`/`thinking` aliased to one another.
2. **A built-in renderer** (`render_builtin`, our own code) of the Gemma 4 turn format. It produces
   the same text as the official template C (`google-gemma-4-31B-it.jinja`, GEMMA4.md §7.1); the
   tests check this on the whole corpus. It is used when a checkpoint carries no template
   (`render(..., template=None)`).

Before either renderer runs, `prepare_messages` normalises OpenAI wire shapes (ours and llama.cpp's
conventions, not transformers'; documented so that tests can reproduce them):

- `tool_calls[].function.arguments` given as a JSON *string* (the OpenAI wire format) is parsed into
  an object, since the Gemma templates format argument objects (llama.cpp `chat.cpp` does the same).
- For an older Gemma 4 template that lacks template C's OpenAI `role:"tool"` support (templates A,
  the GGUF-embedded one, and B; detected as llama.cpp does by the missing
  `{#- OpenAI Chat Completions:` marker), `assistant(tool_calls) -> tool+ -> [assistant(content)]`
  runs are folded into one assistant message with `tool_responses` (`convert_tool_messages`, the
  rewrite llama.cpp applies, GEMMA4.md §7.1). Responses are matched to calls by `tool_call_id`,
  then by position.

The stop / end-of-generation ids are `<eos>`, `<turn|>` and `<|tool_response>` (`stop_token_ids`).
`encode_prompt` renders and tokenizes in one go and applies llama.cpp's one prompt fix-up (a prompt
that ends in `<turn|>\\n` gets `<|turn>model\\n`).

Nothing here imports torch.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any, Sequence

__all__ = [
    "ChatTemplateError",
    "render",
    "render_jinja",
    "render_builtin",
    "prepare_messages",
    "convert_tool_messages",
    "stop_token_ids",
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

# Gemma 4 format pieces (GEMMA4.md §7.2-7.3)
BOS = "<bos>"
TURN_START, TURN_END = "<|turn>", "<turn|>"
CHANNEL_START, CHANNEL_END = "<|channel>", "<channel|>"
TOOL_START, TOOL_END = "<|tool>", "<tool|>"
CALL_START, CALL_END = "<|tool_call>", "<tool_call|>"
RESPONSE_START, RESPONSE_END = "<|tool_response>", "<tool_response|>"
QUOTE = '<|"|>'
THINK = "<|think|>"

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(ValueError):
    """The messages cannot be rendered (raised by a template's `raise_exception`, or by bad input)."""


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
    **kwargs: Any,
) -> str:
    """Render a conversation to the prompt text (it starts with `<bos>`; tokenize it with
    `tokenizer.encode(text, add_bos=False, parse_special=True)`).

    template: Jinja source (typically `tokenizer.chat_template`); None uses the built-in renderer.
    kwargs: extra template variables (e.g. `bos_token=...` to override the special token strings).
    """
    prepared = prepare_messages(messages, template)
    if template is None:
        specials = {**DEFAULT_SPECIAL_TOKENS, **{k: v for k, v in kwargs.items() if k in DEFAULT_SPECIAL_TOKENS}}
        return render_builtin(
            prepared,
            tools,
            add_generation_prompt=add_generation_prompt,
            enable_thinking=enable_thinking,
            bos_token=specials["bos_token"],
        )
    return render_jinja(
        template,
        prepared,
        tools,
        add_generation_prompt=add_generation_prompt,
        enable_thinking=enable_thinking,
        **kwargs,
    )


def stop_token_ids(tokenizer) -> frozenset[int]:
    """End-of-generation ids: `<eos>` (1), `<turn|>` (106) and `<|tool_response>` (50): the model
    emits the last one right after its tool calls to hand control back (GEMMA4.md §6.1, §7.2)."""
    s = tokenizer.special
    return frozenset(i for i in (s.eos, s.turn_end, s.tool_response_start) if i is not None)


def encode_prompt(
    tokenizer,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    *,
    add_generation_prompt: bool = True,
    enable_thinking: bool = False,
    template: str | None | bool = True,
    **kwargs: Any,
) -> list[int]:
    """Render with the tokenizer's template and tokenize: the ids to prefill.

    template: True uses `tokenizer.chat_template` (the built-in renderer if it has none), a string
    is Jinja source, None forces the built-in renderer. The special token strings come from the
    tokenizer. If a generation prompt was asked for and the rendered text ends with `<turn|>\\n`
    (template C after a model turn that has tool responses and content), `<|turn>model\\n` is
    appended, as llama.cpp does (GEMMA4.md §7.3).
    """
    if template is True:
        template = tokenizer.chat_template
    elif template is False:
        template = None
    specials = {**DEFAULT_SPECIAL_TOKENS, **tokenizer.special_token_strings(), **kwargs}
    text = render(
        messages,
        tools,
        add_generation_prompt=add_generation_prompt,
        enable_thinking=enable_thinking,
        template=template,
        **specials,
    )
    if add_generation_prompt and text.endswith(TURN_END + "\n"):
        text += TURN_START + "model\n"
    bos = specials.get("bos_token")
    add_bos = tokenizer.add_bos and not (bos and text.startswith(bos))
    return tokenizer.encode(text, add_bos=add_bos, parse_special=True)


def is_gemma4_template(template: str | None) -> bool:
    return template is not None and GEMMA4_TEMPLATE_MARKER in template


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
    (GEMMA4.md §7.1; same result as llama.cpp's `convert_tool_responses_gemma4`, except that a
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

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env.from_string(template)


def render_jinja(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    *,
    add_generation_prompt: bool = True,
    enable_thinking: bool = False,
    **kwargs: Any,
) -> str:
    """Render already-prepared messages with a Jinja template, as transformers does."""
    import jinja2

    variables = {**DEFAULT_SPECIAL_TOKENS, **_plain(kwargs)}
    try:
        return _compile(template).render(
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


# ---------------------------------------------------------------------------------------------
# Built-in renderer: the Gemma 4 turn format (template C semantics), our own code
# ---------------------------------------------------------------------------------------------

_MISSING = object()  # a key the template would see as undefined


def _get(d: Any, key: str) -> Any:
    return d.get(key, _MISSING) if isinstance(d, Mapping) else _MISSING


def _truthy(v: Any) -> bool:
    return v is not _MISSING and bool(v)


def _text(v: Any) -> str:
    # Jinja's `{{ v }}`: undefined prints nothing, everything else is str()
    return "" if v is _MISSING else str(v)


def _upper(v: Any) -> str:
    return _text(v).upper()


def _sorted_items(d: Mapping) -> list:
    # Jinja's `dictsort`: by key, case-insensitively; stable for equal keys
    return sorted(d.items(), key=lambda kv: kv[0].lower() if isinstance(kv[0], str) else kv[0])


def _concat(*parts: Any) -> str:
    # Jinja `+` on strings: a non-string operand is an error in the template, and here too
    for p in parts:
        if not isinstance(p, str):
            raise ChatTemplateError(f"expected a string in the chat format, got {p!r}")
    return "".join(parts)


def format_value(value: Any, escape_keys: bool = True) -> str:
    """Gemma 4 value syntax (GEMMA4.md §7.3): `<|"|>`-quoted strings, bare numbers and booleans,
    `[a,b]` lists, `{key:value}` maps with keys sorted case-insensitively (quoted if escape_keys)."""
    if isinstance(value, str):
        return QUOTE + value + QUOTE
    if value is True or value is False:
        return "true" if value else "false"
    if isinstance(value, Mapping):
        parts = []
        for k, v in _sorted_items(value):
            key = _concat(QUOTE, k, QUOTE) if escape_keys else _text(k)
            parts.append(key + ":" + format_value(v, escape_keys))
        return "{" + ",".join(parts) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(format_value(v, escape_keys) for v in value) + "]"
    return _text(value)  # numbers; None prints as 'None', as in the template


def _quoted_list(items: Any) -> str:
    return "[" + ",".join(QUOTE + _text(x) + QUOTE for x in items) + "]"


def _format_parameters(properties: Mapping) -> str:
    """Template C's `format_parameters`: the properties of an OBJECT schema, keys sorted."""
    standard = ("description", "type", "properties", "required", "nullable")
    out = []
    first = True
    for key, value in _sorted_items(properties):
        if key in standard:
            continue
        if not first:
            out.append(",")
        first = False
        fields = []  # joined with ',' (the template's add_comma logic)
        description = _get(value, "description")
        if _truthy(description):
            fields.append("description:" + QUOTE + _text(description) + QUOTE)
        vtype = _upper(_get(value, "type"))
        if vtype == "STRING":
            enum = _get(value, "enum")
            if _truthy(enum):
                fields.append("enum:" + format_value(enum))
        elif vtype == "ARRAY":
            items = _get(value, "items")
            if isinstance(items, Mapping) and items:
                parts = []
                for ikey, ivalue in _sorted_items(items):
                    if ivalue is None:
                        continue
                    if ikey == "properties":
                        inner = _format_parameters(ivalue) if isinstance(ivalue, Mapping) else ""
                        parts.append("properties:{" + inner + "}")
                    elif ikey == "required":
                        parts.append("required:" + _quoted_list(ivalue))
                    elif ikey == "type":
                        if isinstance(ivalue, str):
                            parts.append("type:" + format_value(ivalue.upper()))
                        else:
                            parts.append("type:" + format_value([_upper(x) for x in ivalue]))
                    else:
                        parts.append(_text(ikey) + ":" + format_value(ivalue))
                fields.append("items:{" + ",".join(parts) + "}")
        if _truthy(_get(value, "nullable")):
            fields.append("nullable:true")
        if vtype == "OBJECT":
            props = _get(value, "properties")
            if props is not _MISSING and isinstance(props, Mapping):
                fields.append("properties:{" + _format_parameters(props) + "}")
            elif isinstance(value, Mapping):
                fields.append("properties:{" + _format_parameters(value) + "}")
            required = _get(value, "required")
            if _truthy(required):
                fields.append("required:" + _quoted_list(required))
        fields.append("type:" + QUOTE + vtype + QUOTE)
        out.append(_text(key) + ":{" + ",".join(fields) + "}")
    return "".join(out)


def _format_declaration(tool: Mapping) -> str:
    """Template C's `format_function_declaration` (GEMMA4.md §7.3)."""
    fn = _get(tool, "function")
    if not isinstance(fn, Mapping):
        raise ChatTemplateError(f"a tool must be {{'type': 'function', 'function': {{...}}}}, got {tool!r}")
    out = ["declaration:", _text(_get(fn, "name")), "{description:", QUOTE, _text(_get(fn, "description")), QUOTE]
    params = _get(fn, "parameters")
    if _truthy(params):
        out.append(",parameters:{")
        props = _get(params, "properties")
        if _truthy(props):
            out.append("properties:{" + _format_parameters(props) + "},")
        required = _get(params, "required")
        if _truthy(required):
            out.append("required:" + _quoted_list(required) + ",")
        ptype = _get(params, "type")
        if _truthy(ptype):
            # (the template leaves `parameters:{` unclosed when there is no type; so do we)
            out.append("type:" + QUOTE + _upper(ptype) + QUOTE + "}")
    if "response" in fn:
        response = fn["response"]
        out.append(",response:{")
        rdesc = _get(response, "description")
        if _truthy(rdesc):
            out.append("description:" + QUOTE + _text(rdesc) + QUOTE + ",")
        if _upper(_get(response, "type")) == "OBJECT":
            out.append("type:" + QUOTE + _upper(_get(response, "type")) + QUOTE + "}")
    out.append("}")
    return "".join(out)


def _strip_thinking(text: str) -> str:
    """Drop every `<|channel>...<channel|>` block of an earlier model turn, then trim."""
    result = []
    for part in text.split(CHANNEL_END):
        result.append(part.split(CHANNEL_START)[0] if CHANNEL_START in part else part)
    return "".join(result).strip()


def _tool_response_block(name: Any, response: Any) -> str:
    if isinstance(response, Mapping):
        body = ",".join(_text(k) + ":" + format_value(v, escape_keys=False) for k, v in _sorted_items(response))
        return _concat(RESPONSE_START, "response:", name, "{") + body + "}" + RESPONSE_END
    return _concat(RESPONSE_START, "response:", name, "{value:") + format_value(response, escape_keys=False) + "}" + RESPONSE_END


def _render_content(content: Any, is_model: bool) -> tuple[str, str | None]:
    """Text of a message's content, and the media kind of its last media part (if any)."""
    if isinstance(content, str):
        return (_strip_thinking(content) if is_model else content.strip()), None
    out, last_media = [], None
    if isinstance(content, (list, tuple)):
        for item in content:
            kind = _get(item, "type")
            if kind == "text":
                text = _get(item, "text")
                text = _text(text)
                out.append(_strip_thinking(text) if is_model else text.strip())
            elif kind in ("image", "audio", "video"):
                out.append("<|" + kind + "|>")
                last_media = kind
    return "".join(out), last_media


def render_builtin(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    *,
    add_generation_prompt: bool = True,
    enable_thinking: bool = False,
    bos_token: str = BOS,
) -> str:
    """The Gemma 4 turn format (GEMMA4.md §7.2-7.3), equal to template C on prepared messages.

    Layout: `<bos>`, an optional system turn (`<|think|>\\n` when thinking, the first
    system/developer message, one `<|tool>declaration:...<tool|>` per tool), then one
    `<|turn>ROLE\\n...<turn|>\\n` per message (`assistant` -> `model`; consecutive assistant messages
    share a turn; tool calls `<|tool_call>call:NAME{...}<tool_call|>`; the following `role:"tool"`
    messages as `<|tool_response>response:NAME{...}<tool_response|>` inside the same model turn),
    then the generation prompt `<|turn>model\\n` (+ an empty thought channel when thinking is off).
    """
    messages = [dict(m) for m in messages]
    if not messages:
        raise ChatTemplateError("cannot render an empty conversation")
    out: list[str] = [_text(bos_token)]
    prev_type: str | None = None  # the template's ns.prev_message_type
    loop = messages
    first_role = messages[0].get("role")

    # ---- system turn: thinking switch, system/developer text, tool declarations
    if enable_thinking or tools or first_role in ("system", "developer"):
        out.append(TURN_START + "system\n")
        if enable_thinking:
            out.append(THINK + "\n")
            prev_type = "think"
        if first_role in ("system", "developer"):
            out.append(_text(messages[0].get("content", _MISSING)).strip())
            loop = messages[1:]
        if tools:
            for tool in tools:
                out.append(TOOL_START + _format_declaration(tool).strip() + TOOL_END)
            prev_type = "tool"
        out.append(TURN_END + "\n")

    # reasoning of a tool-calling model turn is kept only after the last user message
    last_user = max((i for i, m in enumerate(loop) if m.get("role") == "user"), default=-1)

    for idx, message in enumerate(loop):
        raw_role = message.get("role")
        if raw_role == "tool":
            continue  # rendered inside the preceding model turn
        prev_type = None
        role = "model" if raw_role == "assistant" else raw_role
        prev_role = next((loop[j].get("role") for j in range(idx - 1, -1, -1) if loop[j].get("role") != "tool"), None)
        if not (role == "model" and prev_role == "assistant"):
            out.append(_concat(TURN_START, role, "\n"))

        thinking = message.get("reasoning") or message.get("reasoning_content")
        if thinking and idx > last_user and message.get("tool_calls"):
            out.append(_concat(CHANNEL_START, "thought\n", thinking, "\n", CHANNEL_END))

        calls = message.get("tool_calls")
        if calls:
            for call in calls:
                fn = call["function"]
                out.append(_concat(CALL_START, "call:", fn["name"], "{"))
                args = fn.get("arguments", _MISSING)
                if isinstance(args, Mapping):
                    out.append(",".join(_text(k) + ":" + format_value(v, escape_keys=False) for k, v in _sorted_items(args)))
                elif isinstance(args, str):
                    out.append(args)
                out.append("}" + CALL_END)
            prev_type = "tool_call"

        responded = False
        if message.get("tool_responses"):
            # Gemma-native: responses carried on the assistant message
            for tr in message["tool_responses"]:
                out.append(_tool_response_block(tr.get("name", "unknown"), tr.get("response", "")))
                responded = True
                prev_type = "tool_response"
        elif calls:
            # OpenAI: the role:"tool" messages that follow, named by tool_call_id
            for follow in loop[idx + 1 :]:
                if follow.get("role") != "tool":
                    break
                name = follow.get("name")
                for tc in calls:
                    if tc.get("id") == follow.get("tool_call_id"):
                        name = tc["function"]["name"]
                body = follow.get("content")
                if isinstance(body, Mapping):
                    raise ChatTemplateError("a tool message's content must be a string or a list of parts")
                if isinstance(body, (list, tuple)):
                    text = ""
                    for part in body:
                        if isinstance(part, Mapping) and part.get("type") == "text":
                            text = _concat(text, part.get("text", ""))
                    body = text
                out.append(_tool_response_block(name, body))
                responded = True
                prev_type = "tool_response"

        content = message.get("content", _MISSING)
        if content is not _MISSING:
            text, media = _render_content(content, role == "model")
            out.append(text)
            if media is not None:
                prev_type = media

        if prev_type == "tool_call" and not responded:
            out.append(RESPONSE_START)  # the model's stop point after a call
        elif not (responded and not _truthy(content)):
            out.append(TURN_END + "\n")

    if add_generation_prompt and prev_type not in ("tool_response", "tool_call"):
        out.append(TURN_START + "model\n")
        if not enable_thinking:
            out.append(CHANNEL_START + "thought\n" + CHANNEL_END)
    return "".join(out)
