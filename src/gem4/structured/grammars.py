"""Grammars from requests: tool calls in Gemma 4's own syntax, JSON documents, regexes, choices, Lark.

What a request asks for -> one llguidance grammar over the whole generated text (docs/structured.md):

    tool_choice "required"      start: LEAD call+          (one call with parallel_tool_calls=false)
    tool_choice {function: f}   start: LEAD call           (f only, exactly one call)
    tool_choice "auto", a tool with strict=true
                                start: LEAD TEXT? (call TEXT?)*
    response_format json_schema / json_object, structured_outputs json / regex / choice / grammar
                                start: LEAD doc            (`LEAD (doc | call+)` beside "auto" tools)
    call := <|tool_call> "call:" NAME ARGS <tool_call|>

Nothing else is constrained: "auto" without a strict tool and "none" give no grammar, as before.

LEAD is what may come before the answer, decided by the prompt's tail (`lead_of`): nothing when thinking is
off (the generation prompt already holds the empty thought `<|channel>thought\\n<channel|>`); an optional
thought `<|channel> "thought" REASONING? <channel|>` when thinking is on; the rest of a thought and its
`<channel|>` when the prompt ends inside an open channel (a continued reasoning prefill). Gemma's markers
are single special tokens that no text terminal can produce, so free text (a thought, prose in "auto", a
string's body) always ends exactly where the model emits the next marker.

ARGS follow the tool's `parameters` JSON Schema, written as the chat template writes a call
(`format_argument` in templates/google-gemma-4-31B-it.jinja) and as `gem4.parser` reads it back:
`{key:value,...}` with bare keys in the template's `dictsort` order (case-insensitive alphabetical; a key
the parser would read back differently if bare is written between `<|"|>` quotes, which it also reads),
strings as `<|"|>raw text<|"|>` (no escapes: `"` and `\\` are plain text inside), numbers and
`true`/`false`/`null` as JSON writes them (null also as the template's `None`), `[a,b]` lists, no spaces.
`_ArgsCompiler` turns a schema into Lark rules: `type` (one or a list), `enum`, `const`, `properties` /
`required` (optional members may be skipped, the commas stay right), `additionalProperties` (false / true /
a schema: extra bare keys anywhere among the declared ones, as the template sorts them in; absent, an
object with `properties` has only those), `items`, `minItems` / `maxItems`, `minLength` /
`maxLength`, `pattern`, a few `format`s, `anyOf` / `oneOf`, a one-member `allOf`, local `$ref`s
(`#`, `#/$defs/...`, `#/definitions/...`, recursive ones included), `nullable`, and the numeric bounds
(`minimum`, `maximum`, `exclusiveMinimum`, `exclusiveMaximum`, `multipleOf`, through llguidance's own
JSON compiler, since Gemma writes numbers as JSON does). Annotations (`title`, `description`, `default`,
`examples`, ...) are ignored. Any other keyword is refused: `GrammarError` names it and the request
parameter, and the server answers 400; nothing is silently left unconstrained.

JSON documents use llguidance's JSON Schema compiler (`%json`), with no whitespace between tokens
(`whitespace_flexible: false`): bare JSON as the content, as OpenAI returns it. Keywords llguidance does
not implement are refused by `validate`, which compiles every grammar against the engine's tokenizer
view (`GrammarVocab`, with its parser limits) before the request reaches the engine.

Bounds, so that one request cannot stall the engine thread: each schema, regex or grammar text at most
`MAX_SPEC_BYTES` when serialised, schemas nested at most `MAX_NESTING` deep, the built grammar at most
`MAX_GRAMMAR_BYTES`, and llguidance's per-step lexer fuel and Earley items capped (`vocab.LIMIT_FIELDS`).
"""
from __future__ import annotations

import enum
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from gem4.structured.spec import GrammarSpec

MAX_SPEC_BYTES = 64 * 1024        # one schema / regex / grammar / choice list, as JSON text
MAX_NESTING = 64                  # objects and arrays inside one schema
MAX_GRAMMAR_BYTES = 1 << 20       # the grammar built from a whole request
MAX_ITEMS_BOUND = 1024            # minItems / maxItems are unrolled into the grammar up to this


class GrammarError(ValueError):
    """A request the grammar compiler cannot honour; `param` names the request parameter
    (`tools[0].function.parameters`, `response_format`, `structured_outputs`), as a 400 carries it."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param
        self.message = message


def validate(spec: GrammarSpec, param: str, vocab, timing=None) -> None:
    """Compile `spec` against `vocab` (the engine's `GrammarVocab`, with its parser limits; it keeps the
    compile, so the engine's own is a copy) or raise GrammarError naming `param` with llguidance's reason.
    Takes milliseconds (seconds while the vocabulary is still being built): call it off the event loop."""
    from gem4.structured.vocab import MatcherError

    if len(spec.grammar) > MAX_GRAMMAR_BYTES:
        raise GrammarError(param, f"the grammar built from {param} is {len(spec.grammar)} bytes; at most "
                                  f"{MAX_GRAMMAR_BYTES} are accepted")
    try:
        vocab.matcher(spec, timing)
    except MatcherError as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else "invalid grammar"
        raise GrammarError(param, f"{param} cannot be used for constrained decoding: {reason}") from None


# ---------------------------------------------------------------------------------------------
# What comes before the answer
# ---------------------------------------------------------------------------------------------


class Lead(enum.Enum):
    ANSWER = "answer"              # thinking off: the prompt closed an empty thought; the answer comes first
    THOUGHT = "thought"            # thinking on: an optional thought, then the answer
    OPEN_THOUGHT = "open_thought"  # the prompt ends inside an open thought: its rest, <channel|>, the answer
    OPEN_CHANNEL = "open_channel"  # the prompt ends with <|channel>: "thought", its text, <channel|>, ...


def lead_of(tokenizer, prompt_ids: Sequence[int], thinking: bool) -> Lead:
    """What the model may write before its answer, from the prompt's last structural token (as
    `Gemma4Parser` primes itself) and whether thinking is on."""
    sp = tokenizer.special
    marks = {sp.turn_start, sp.turn_end, sp.channel_start, sp.channel_end, sp.tool_call_start,
             sp.tool_call_end, sp.tool_response_start, sp.tool_response_end} - {None}
    last = next((k for k in range(len(prompt_ids) - 1, -1, -1) if prompt_ids[k] in marks), None)
    if last is not None and prompt_ids[last] == sp.channel_start:
        return Lead.OPEN_CHANNEL if last == len(prompt_ids) - 1 else Lead.OPEN_THOUGHT
    return Lead.THOUGHT if thinking else Lead.ANSWER


_LEADS = {
    Lead.ANSWER: "",
    Lead.THOUGHT: "thought? ",
    Lead.OPEN_THOUGHT: "REASONING? <channel|> ",
    Lead.OPEN_CHANNEL: '"thought" REASONING? <channel|> ',
}

_COMMON = r"""
thought: <|channel> "thought" REASONING? <channel|>
REASONING: /(?s:.+)/
TEXT: /(?s:.+)/
gstr: <|"|> GTEXT? <|"|>
GTEXT: /(?s:.+)/
GINT: /-?(0|[1-9][0-9]*)/
GNUM: /-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?/
gbool: "true" | "false"
gnull: "null" | "None"
gany: gstr | GNUM | gbool | gnull | gobj | garr
gobj: "{" (gkv ("," gkv)*)? "}"
gkv: GKEY ":" gany
garr: "[" (gany ("," gany)*)? "]"
GKEY: /[^\s:{}\[\],"]([^:{}\[\],\n]{0,62}[^\s:{}\[\],])?/
"""


def _grammar(start: str, rules: Sequence[str] = ()) -> str:
    return "%llguidance {}\nstart: " + start + "\n" + "\n".join(rules) + _COMMON


# ---------------------------------------------------------------------------------------------
# Requests -> grammars
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """A request's grammar but for what may come before the answer (`Lead`, known once the prompt is
    rendered): everything that can fail (bounds, schemas) has been checked when a Plan exists."""

    body: str                        # the start rule after the lead
    rules: tuple[str, ...]
    kind: str                        # GrammarSpec.kind
    param: str                       # the request parameter the grammar comes from (for a 400)
    user: dict | None = None         # a client's Lark grammar, referenced from `body` as @user

    def spec(self, lead: Lead) -> GrammarSpec:
        main = _grammar(_LEADS[lead] + self.body, self.rules)
        if self.user is None:
            return GrammarSpec(grammar=main, kind=self.kind)
        grammars = [{"lark_grammar": main}, {**self.user, "name": "user"}]
        return GrammarSpec(grammar=json.dumps({"grammars": grammars}), kind=self.kind)


def chat_plan(*, tools: Sequence[Mapping] | None, tool_choice: Any, parallel_tool_calls: bool,
              response_format: Mapping | None, structured_outputs: Mapping | None) -> Plan | None:
    """The grammar plan of a chat request, or None when nothing is constrained; GrammarError naming the
    parameter it cannot honour.

    tools: the request's tools as dicts (`{"type": "function", "function": {...}}`), names unique.
    tool_choice: "none" | "auto" | "required" | {"type": "function", "function": {"name": ...}} | None.
    response_format: `{"type": "text" | "json_object" | "json_schema", "json_schema": {...}}` or None.
    structured_outputs: vLLM's extension, `{json | regex | choice | grammar | json_object: ...}`, or None.
    A forced call (required, named) wins over a document: that turn has no text answer.
    """
    tools = list(tools or [])
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        tools = []
    if structured_outputs is not None and response_format is not None and response_format.get("type") != "text":
        raise GrammarError("structured_outputs", "give either response_format or structured_outputs, not both")
    if isinstance(choice, Mapping):
        name = choice["function"]["name"]
        if not any(t["function"]["name"] == name for t in tools):
            raise GrammarError("tool_choice", f"tool_choice names the function {name!r}, which is not among the "
                                              "tools")
        return Plan("call", _calls(tools, strict_only=False, only=name), "tools_named", "tools")
    if choice == "required":
        if not tools:
            raise GrammarError("tool_choice", "tool_choice 'required' needs at least one tool")
        return Plan("call+" if parallel_tool_calls else "call", _calls(tools, strict_only=False), "tools_required",
                    "tools")
    doc = _document(response_format, structured_outputs)
    strict = any(t["function"].get("strict") for t in tools)
    if doc is None and not strict:
        return None
    if doc is None:
        body = "TEXT? (call TEXT?)*" if parallel_tool_calls else "TEXT? (call TEXT?)?"
        return Plan(body, _calls(tools, strict_only=True), "tools_auto", "tools")
    if tools:                        # beside "auto" tools: the document, or calls
        calls = "call+" if parallel_tool_calls else "call"
        return replace(doc, body=f"({doc.body} | {calls})", rules=doc.rules + _calls(tools, strict_only=True))
    return doc


def completion_plan(structured_outputs: Mapping | None) -> Plan | None:
    """The grammar plan of a /v1/completions request (`structured_outputs` over the whole generated text;
    use it with `Lead.ANSWER`)."""
    return _document(None, structured_outputs)


def chat_grammar(*, lead: Lead, **request: Any) -> tuple[GrammarSpec, str] | None:
    """`chat_plan(**request)` with its lead, in one call (benchmarks, tests): (the grammar, its parameter),
    or None."""
    plan = chat_plan(**request)
    return None if plan is None else (plan.spec(lead), plan.param)


def _document(response_format: Mapping | None, so: Mapping | None) -> Plan | None:
    """The plan of a document answer (response_format, or structured_outputs), or None."""
    if response_format is not None and response_format.get("type", "text") != "text":
        if response_format["type"] == "json_object":
            return Plan(_json_rule({"type": "object"}, "response_format"), (), "json_object", "response_format")
        param = "response_format.json_schema.schema"
        schema = (response_format.get("json_schema") or {}).get("schema", {})
        _check_size(schema, param)
        return Plan(_json_rule(schema, param), (), "json_schema", param)
    if so is None:
        return None
    given = [k for k in ("json", "regex", "choice", "grammar", "json_object") if so.get(k) not in (None, False)]
    if len(given) != 1:
        raise GrammarError("structured_outputs", "structured_outputs takes exactly one of json, regex, choice, "
                                                 f"grammar or json_object (got {', '.join(given) or 'none'})")
    (key,) = given
    value = so[key]
    param = f"structured_outputs.{key}"
    _check_size(value, param)
    if key == "json_object":
        return Plan(_json_rule({"type": "object"}, param), (), "json_object", param)
    if key == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise GrammarError(param, f"{param} is not valid JSON: {e}") from None
        return Plan(_json_rule(value, param), (), "json_schema", param)
    if key == "regex":
        if not isinstance(value, str):
            raise GrammarError(param, f"{param} must be a string")
        import llguidance

        return Plan("USER_REGEX", (f"USER_REGEX: /{llguidance.regex_to_lark(value, '')}/",), "regex", param)
    if key == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise GrammarError(param, f"{param} must be a non-empty list of non-empty strings")
        return Plan("(" + " | ".join(json.dumps(c) for c in value) + ")", (), "choice", param)
    if not isinstance(value, str):
        raise GrammarError(param, f"{param} must be a string (a Lark or GBNF grammar)")
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        lark = any_to_lark(value)
    except Exception as e:        # the converter raises bare Exceptions for GBNF it cannot read
        raise GrammarError(param, f"{param} is neither a Lark nor a GBNF grammar llguidance reads: {e}") from None
    return Plan("@user", (), "grammar", param, user={"lark_grammar": lark})


def _json_rule(schema: Any, param: str) -> str:
    if not isinstance(schema, (dict, bool)):
        raise GrammarError(param, f"{param} must be a JSON Schema (an object)")
    _check_nesting(schema, param)
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    options = {**schema.get("x-guidance", {}), "whitespace_flexible": False}
    return "%json " + json.dumps({**schema, "x-guidance": options})


def _check_size(value: Any, param: str) -> None:
    size = len(json.dumps(value)) if not isinstance(value, str) else len(value.encode())
    if size > MAX_SPEC_BYTES:
        raise GrammarError(param, f"{param} is {size} bytes; constrained decoding accepts at most "
                                  f"{MAX_SPEC_BYTES} bytes")


def _check_nesting(value: Any, param: str) -> None:
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if depth > MAX_NESTING:
            raise GrammarError(param, f"{param} nests objects and arrays more than {MAX_NESTING} deep")
        if isinstance(v, dict):
            stack += [(x, depth + 1) for x in v.values()]
        elif isinstance(v, list):
            stack += [(x, depth + 1) for x in v]


# ---------------------------------------------------------------------------------------------
# Tool calls: JSON Schema -> Gemma 4 argument syntax
# ---------------------------------------------------------------------------------------------


def _calls(tools: Sequence[Mapping], *, strict_only: bool, only: str | None = None) -> tuple[str, ...]:
    """The `call` rule over `tools` (the one named `only`, if given): each tool's name, then its arguments by
    its schema (by a generic argument object when `strict_only` and the tool is not strict)."""
    rules: list[str] = []
    names = []
    for i, tool in enumerate(tools):
        fn = tool["function"]
        if only is not None and fn["name"] != only:
            continue
        param = f"tools[{i}].function.parameters"
        params = fn.get("parameters")
        if strict_only and not fn.get("strict"):
            args = "gobj"
        elif params is None:
            args = '"{" "}"'
        else:
            _check_size(params, param)
            _check_nesting(params, param)
            if isinstance(params, Mapping) and not _COMBINATORS & set(params):
                params = {**params, "type": "object"}      # arguments are an object, whether or not it says so
            args = _ArgsCompiler(params, param, f"t{i}_", rules).value(params, "", 0)
        rules.append(f"call_{i}: {json.dumps(fn['name'])} {args}")
        names.append(f"call_{i}")
    rules.append(f'call: <|tool_call> "call:" ({" | ".join(names)}) <tool_call|>')
    return tuple(rules)


_COMBINATORS = frozenset({"$ref", "anyOf", "oneOf", "allOf", "enum", "const"})
_ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$comment", "$schema", "$id", "deprecated",
                          "readOnly", "writeOnly", "$defs", "definitions", "x-guidance"})
_KEYWORDS = {
    "string": {"minLength", "maxLength", "pattern", "format"},
    "integer": {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"},
    "number": {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"},
    "boolean": set(),
    "null": set(),
    "array": {"items", "minItems", "maxItems"},
    "object": {"properties", "required", "additionalProperties"},
}
_ALL_TYPED = set().union(*_KEYWORDS.values())
_TYPES = tuple(_KEYWORDS)

_FORMATS = {
    "date-time": r"[0-9]{4}-[0-9]{2}-[0-9]{2}[Tt ][0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]+)?([Zz]|[+\-][0-9]{2}:[0-9]{2})",
    "date": r"[0-9]{4}-[0-9]{2}-[0-9]{2}",
    "time": r"[0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]+)?([Zz]|[+\-][0-9]{2}:[0-9]{2})?",
    "uuid": r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}",
    "email": r"[^\s@<>]+@[^\s@<>]+\.[^\s@<>]+",
    "uri": r"[A-Za-z][A-Za-z0-9+.\-]*:[^\s]*",
    "ipv4": r"((25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])",
}

_KEY_BREAKS = re.compile(r"[:{}\[\],]")


def _sort_keys(keys) -> list[str]:
    """The template's `dictsort` order: case-insensitive, ties in their given order."""
    return sorted(keys, key=str.lower)


def _key(name: str) -> str:
    """A property name as the model writes it, with its ':' (a Lark expression): bare as the template writes
    it, unless the parser would read it back differently (a ':' or bracket inside, spaces around it, or
    "quotes" around it), then between <|"|> quotes."""
    if name and name == name.strip() and not _KEY_BREAKS.search(name) and not (name[0] == name[-1] == '"'):
        return json.dumps(name + ":")
    return f'<|"|> {json.dumps(name)} <|"|> ":"'


def _literal(value: Any, param: str) -> str:
    """A JSON value (from enum / const) in Gemma's argument syntax, as a Lark expression."""
    if isinstance(value, str):
        return f'<|"|> {json.dumps(value)} <|"|>' if value else '<|"|> <|"|>'
    if value is None:
        return "gnull"
    if isinstance(value, (bool, int, float)):
        return json.dumps(json.dumps(value))
    if isinstance(value, list):
        inner = ' "," '.join(_literal(v, param) for v in value)
        return f'"[" {inner} "]"'
    if isinstance(value, dict):
        inner = ' "," '.join(f"{_key(k)} {_literal(value[k], param)}" for k in _sort_keys(value))
        return f'"{{" {inner} "}}"'
    raise GrammarError(param, f"{param}: {value!r} is not a JSON value")


class _ArgsCompiler:
    """One tool's parameters schema -> Lark rules appended to `rules`, named with `prefix`."""

    def __init__(self, root: Mapping, param: str, prefix: str, rules: list[str]):
        self.root = root
        self.param = param
        self.prefix = prefix
        self.rules = rules
        self.refs: dict[str, str] = {}
        self.n = 0

    def _fail(self, path: str, message: str):
        raise GrammarError(self.param, f"{self.param}{path}: {message}")

    def _rule(self, body: str, name: str | None = None) -> str:
        if name is None:
            name = f"{self.prefix}{self.n}"
            self.n += 1
        self.rules.append(f"{name}: {body}")
        return name

    def _terminal(self, body: str) -> str:
        name = f"{self.prefix.upper()}S{self.n}"
        self.n += 1
        self.rules.append(f"{name}: {body}")
        return name

    def value(self, s: Any, path: str, depth: int) -> str:
        """The rule for a value that `s` allows (a rule name or a short expression)."""
        if depth > MAX_NESTING:
            self._fail(path, f"schemas nest more than {MAX_NESTING} deep")
        if s is True or s == {}:
            return "gany"
        if not isinstance(s, Mapping):
            self._fail(path, "a schema must be an object (or true)")
        unknown = sorted(k for k in s if k not in _ANNOTATIONS and k not in _ALL_TYPED and k not in
                         {"type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "nullable"})
        if unknown:
            self._fail(path, f"the keyword {unknown[0]!r} is not supported by constrained decoding")
        alts = self._alternatives(s, path, depth)
        if s.get("nullable") is True:
            alts.append("gnull")
        # always one name: llguidance 1.9.1 misreads `<|"|>)~0..1` (a repetition right after a special token)
        return alts[0] if len(alts) == 1 and " " not in alts[0] else self._rule(" | ".join(alts))

    def _alternatives(self, s: Mapping, path: str, depth: int) -> list[str]:
        constraints = [k for k in s if k not in _ANNOTATIONS and k != "nullable"]
        if "$ref" in s:
            if constraints != ["$ref"]:
                self._fail(path, "'$ref' beside other keywords is not supported")
            return [self._ref(s["$ref"], path, depth)]
        for key in ("anyOf", "oneOf"):
            if key in s:
                if constraints != [key]:
                    self._fail(path, f"{key!r} beside other keywords is not supported")
                if not isinstance(s[key], list) or not s[key]:
                    self._fail(path, f"{key!r} must be a non-empty array of schemas")
                return [self.value(b, f"{path}.{key}[{i}]", depth + 1) for i, b in enumerate(s[key])]
        if "allOf" in s:
            if constraints != ["allOf"] or not isinstance(s["allOf"], list) or len(s["allOf"]) != 1:
                self._fail(path, "'allOf' is supported with exactly one schema and no other keywords")
            return [self.value(s["allOf"][0], f"{path}.allOf[0]", depth + 1)]
        if "const" in s:
            return [_literal(s["const"], self.param)]
        if "enum" in s:
            if not isinstance(s["enum"], list) or not s["enum"]:
                self._fail(path, "'enum' must be a non-empty array")
            return [_literal(v, self.param) for v in s["enum"]]
        kinds = s.get("type")
        if kinds is None:
            kinds = [t for t in _TYPES if _KEYWORDS[t] & set(s)] or None
            if kinds is None:
                return ["gany"]
            if kinds == ["integer", "number"]:
                kinds = ["number"]
        kinds = [kinds] if isinstance(kinds, str) else kinds
        if not isinstance(kinds, list) or not kinds or any(k not in _TYPES for k in kinds):
            self._fail(path, f"'type' must be one of {', '.join(_TYPES)} or a list of them, got {s['type']!r}")
        typed = set(s) & _ALL_TYPED
        stray = typed - set().union(*(_KEYWORDS[k] for k in kinds))
        if stray:
            self._fail(path, f"{sorted(stray)[0]!r} does not apply to type {kinds if len(kinds) > 1 else kinds[0]!r}")
        return [getattr(self, "_" + k)(s, path, depth) for k in kinds]

    def _ref(self, ref: Any, path: str, depth: int) -> str:
        if ref in self.refs:
            return self.refs[ref]
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            self._fail(path, f"only local '$ref's ('#', '#/$defs/...') are supported, got {ref!r}")
        target: Any = self.root
        for part in ref[2:].split("/") if ref != "#" else []:
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, Mapping) or part not in target:
                self._fail(path, f"'$ref' {ref!r} points at nothing")
            target = target[part]
        name = f"{self.prefix}{self.n}"
        self.n += 1
        self.refs[ref] = name                 # before compiling: a recursive schema refers to itself
        self._rule(self.value(target, f"({ref})", depth + 1), name)
        return name

    # ---- one type each ----

    def _string(self, s: Mapping, path: str, depth: int) -> str:
        lo, hi = s.get("minLength", 0), s.get("maxLength")
        for k, v in (("minLength", lo), ("maxLength", hi)):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                self._fail(path, f"{k!r} must be a non-negative integer")
        if hi is not None and hi < lo:
            self._fail(path, f"'maxLength' {hi} is below 'minLength' {lo}")
        parts = []
        if lo or hi is not None:
            parts.append(f"/(?s:.{{{lo},{'' if hi is None else hi}}})/")
        if "pattern" in s:
            parts.append(f"/{self._pattern(s['pattern'], path)}/")
        if "format" in s:
            if s["format"] not in _FORMATS:
                self._fail(path, f"the format {s['format']!r} is not supported by constrained decoding (supported: "
                                 f"{', '.join(_FORMATS)})")
            parts.append(f"/{_FORMATS[s['format']]}/")
        if not parts:
            return "gstr"
        return f'<|"|> {self._terminal(" & ".join(parts))} <|"|>'

    def _pattern(self, pattern: Any, path: str) -> str:
        """A JSON Schema pattern (it matches anywhere unless anchored) as a whole-string regex for Lark."""
        import llguidance

        if not isinstance(pattern, str):
            self._fail(path, "'pattern' must be a string")
        start = pattern.startswith("^")
        end = pattern.endswith("$") and not pattern.endswith("\\$")
        body = pattern[1 if start else 0:len(pattern) - 1 if end else len(pattern)]
        anchors, alternation = _regex_structure(body)
        if anchors or ((start or end) and alternation):
            self._fail(path, f"the pattern {pattern!r} is not supported by constrained decoding (anchors are "
                             "supported only at its two ends, around no top-level '|')")
        whole = ("" if start else "(?s:.*)") + f"(?:{body})" + ("" if end else "(?s:.*)")
        return llguidance.regex_to_lark(whole, "dw")

    def _integer(self, s: Mapping, path: str, depth: int) -> str:
        return self._numeric(s, "integer", "GINT")

    def _number(self, s: Mapping, path: str, depth: int) -> str:
        return self._numeric(s, "number", "GNUM")

    def _numeric(self, s: Mapping, kind: str, plain: str) -> str:
        bounds = {k: s[k] for k in _KEYWORDS[kind] if k in s}
        if not bounds:
            return plain
        # Gemma writes numbers as JSON does: llguidance's JSON compiler knows the bounds' regexes
        return self._rule("%json " + json.dumps({"type": kind, **bounds,
                                                 "x-guidance": {"whitespace_flexible": False}}))

    def _boolean(self, s: Mapping, path: str, depth: int) -> str:
        return "gbool"

    def _null(self, s: Mapping, path: str, depth: int) -> str:
        return "gnull"

    def _array(self, s: Mapping, path: str, depth: int) -> str:
        item = self.value(s.get("items", True), f"{path}.items", depth + 1)
        lo, hi = s.get("minItems", 0), s.get("maxItems")
        for k, v in (("minItems", lo), ("maxItems", hi)):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0 or v > MAX_ITEMS_BOUND):
                self._fail(path, f"{k!r} must be an integer in [0, {MAX_ITEMS_BOUND}]")
        if hi is not None and hi < lo:
            self._fail(path, f"'maxItems' {hi} is below 'minItems' {lo}")
        if hi == 0:
            return self._rule('"[" "]"')
        more = f'("," {item})'
        if hi is None:
            tail = f"{more}~ {lo - 1} {more}*" if lo > 1 else f"{more}*"
        else:
            tail = f"{more}~ {max(lo - 1, 0)}..{hi - 1}" if hi > 1 else ""
        items = f"{item} {tail}".strip()
        return self._rule(f'"[" {items} "]"' if lo else f'"[" ({items})? "]"')

    def _object(self, s: Mapping, path: str, depth: int) -> str:
        props = s.get("properties")
        extra_schema = s.get("additionalProperties")
        required = s.get("required", [])
        if props is not None and not isinstance(props, Mapping):
            self._fail(path, "'properties' must be an object")
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            self._fail(path, "'required' must be an array of property names")
        props = dict(props or {})
        for r in required:
            props.setdefault(r, True)         # required but not described: any value
        if not props and extra_schema is None and "properties" not in s:
            return "gobj"                     # {"type": "object"}: any object
        names = _sort_keys(props)
        members = [f"{_key(k)} {self.value(props[k], f'{path}.properties.{k}', depth + 1)}" for k in names]
        if extra_schema not in (None, False):
            value = self.value(extra_schema, f"{path}.additionalProperties", depth + 1)
            key = self._terminal(" & ".join(["GKEY", *(f"~{json.dumps(n)}" for n in names)]))
            extra = self._rule(f'{key} ":" {value}')
        else:
            extra = None
        # F(i): members i.. with nothing written yet; R(i): members i.. after something was (each after a
        # ","). Extra members (additionalProperties) may come anywhere, as the template sorts them in:
        #   F(i) = E R(i) | m_i R(i+1) [| F(i+1) if m_i is optional]      F(n) = E R(n) | nothing
        #   R(i) = "," E R(i) | "," m_i R(i+1) [| R(i+1) if optional]      R(n) = "," E R(n) | nothing
        # Each is a rule of its own, so the grammar stays linear in the number of properties.
        n = len(names)
        tag = f"{self.prefix}{self.n}"
        self.n += 1
        f: list[str] = [""] * (n + 1)          # rule names; "" where the rule would match only nothing
        r: list[str] = [""] * (n + 1)
        if extra:
            f[n] = self._rule(f'({extra} ("," {extra})*)?', f"{tag}f{n}")
            r[n] = self._rule(f'("," {extra})*', f"{tag}r{n}")
        for i in range(n - 1, -1, -1):
            f[i], r[i] = f"{tag}f{i}", f"{tag}r{i}"
            f_alts = [f"{extra} {r[i]}"] if extra else []
            r_alts = [f'"," {extra} {r[i]}'] if extra else []
            f_alts.append(f"{members[i]} {r[i + 1]}".strip())
            r_alts.append(f'"," {members[i]} {r[i + 1]}'.strip())
            optional = names[i] not in required
            for rule, alts, skip in ((f[i], f_alts, f[i + 1]), (r[i], r_alts, r[i + 1])):
                if optional and skip:
                    alts.append(skip)
                body = " | ".join(alts)
                self._rule(f"({body})?" if optional and not skip else body, rule)
        return self._rule(f'"{{" {f[0]} "}}"' if f[0] else '"{" "}"')


def _regex_structure(body: str) -> tuple[bool, bool]:
    """(an unescaped ^ or $ outside a character class, a top-level |) in a regex."""
    anchors = alternation = False
    depth, i, in_class = 0, 0, False
    while i < len(body):
        c = body[i]
        if c == "\\":
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
            if body[i + 1:i + 2] == "^":
                i += 1
        elif c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
        elif c in "^$":
            anchors = True
        elif c == "|" and depth == 0:
            alternation = True
        i += 1
    return anchors, alternation
