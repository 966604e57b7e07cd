"""Grammars from requests (`gem4.structured.grammars`), checked with llguidance's matcher over the demo
vocabulary (a subset of the real one: every Gemma 4 special token at its real id).

- What the chat template renders for a valid call (and thought) is accepted, token by token.
- What must be refused is refused: prose before a required call, an undeclared tool, a missing required
  key, a bad enum value, a JSON `"` where `<|"|>` belongs, a second call under a named choice or with
  parallel_tool_calls=false, a stop before any call.
- Random walks through the grammar (a random allowed token at every step) always parse, with
  `Gemma4Parser`, into calls to declared tools whose arguments validate against their schemas
  (`jsonschema`), and into JSON documents that validate: the grammar, the parser and the schema agree.
- Schemas the compiler cannot honour raise GrammarError naming the keyword and the parameter.
"""
from __future__ import annotations

import json
import random

import jsonschema
import llguidance
import llguidance.numpy
import numpy as np
import pytest

from gem4.chat import encode_prompt
from gem4.demo import demo_tokenizer
from gem4.parser import Gemma4Parser
from gem4.structured import GrammarVocab, grammar_vocab
from gem4.structured.grammars import (
    MAX_SPEC_BYTES,
    GrammarError,
    Lead,
    chat_grammar,
    completion_plan,
    lead_of,
    validate,
)
from gem4.structured.vocab import parser_limits

Q = '<|"|>'

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12},
                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city"]}}}
SEARCH = {"type": "function", "function": {"name": "search_web", "parameters": {
    "type": "object",
    "properties": {
        "query": {"type": "string", "minLength": 1, "maxLength": 10},
        "max_results": {"type": "integer", "minimum": 1, "maximum": 20},
        "Filters": {"type": "object", "properties": {"site": {"type": "string", "maxLength": 6},
                                                      "recent": {"type": "boolean"}},
                    "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "minItems": 1,
                 "maxItems": 3},
        "codes": {"type": "array", "items": {"type": "string", "maxLength": 2}, "minItems": 2, "maxItems": 2},
        "ids": {"type": "array", "items": {"const": "x"}, "minItems": 3},
        "score": {"anyOf": [{"type": "number", "minimum": 0, "maximum": 1}, {"type": "null"}]},
        "first name": {"type": "string", "pattern": "^[A-Z][a-z]{0,4}$"},
    },
    "required": ["query", "tags"]}}}
TREE = {"type": "function", "function": {"name": "plant", "parameters": {
    "type": "object",
    "$defs": {"node": {"type": "object", "properties": {
        "label": {"type": "string", "enum": ["x", "y"]},
        "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}},
        "required": ["label"]}},
    "properties": {"root": {"$ref": "#/$defs/node"}, "when": {"type": "string", "format": "date"},
                   "meta": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0}},
                            "additionalProperties": {"type": "boolean"}}},
    "required": ["root"]}}}
NO_ARGS = {"type": "function", "function": {"name": "ping"}}
UNTYPED = {"type": "function", "function": {"name": "note", "parameters": {"properties": {"text": {}}}}}
TOOLS = [WEATHER, SEARCH, TREE, NO_ARGS, UNTYPED]


@pytest.fixture(scope="module")
def tok():
    return demo_tokenizer()


@pytest.fixture(scope="module")
def vocab(tok) -> GrammarVocab:
    return grammar_vocab(tok)


@pytest.fixture(scope="module")
def ll(vocab):
    return vocab.lltokenizer()


def matcher(ll, grammar: str) -> llguidance.LLMatcher:
    m = llguidance.LLMatcher(ll, grammar, log_level=0, limits=parser_limits())
    assert not m.is_error(), m.get_error()
    return m


def ids_of(tok, text: str) -> list[int]:
    return tok.encode(text, add_bos=False, parse_special=True)


def accepts(ll, tok, grammar: str, text: str) -> bool:
    """Every token of `text` is allowed in turn, and then a stop token is."""
    m = matcher(ll, grammar)
    ids = ids_of(tok, text)
    return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()


def completion_grammar(structured_outputs):
    plan = completion_plan(structured_outputs)
    return None if plan is None else (plan.spec(Lead.ANSWER), plan.param)


def grammar_for(choice, *, tools=TOOLS, parallel=True, lead=Lead.ANSWER, response_format=None, so=None) -> str:
    spec, _ = chat_grammar(tools=tools, tool_choice=choice, parallel_tool_calls=parallel,
                           response_format=response_format, structured_outputs=so, lead=lead)
    return spec.grammar


# ---------------------------------------------------------------------------------------------
# What the template renders is accepted
# ---------------------------------------------------------------------------------------------

CALLS = [
    ("get_weather", {"city": 'Pa"ri\\s', "unit": "celsius"}),
    ("get_weather", {"city": ""}),
    ("search_web", {"query": "q", "tags": ["a", "c"], "Filters": {"recent": False, "site": "x.org"},
                    "max_results": 20, "score": 0.5, "first name": "Ann"}),
    ("search_web", {"query": "multi\nline", "tags": ["b"], "score": None, "codes": ["", "zz"],
                    "ids": ["x", "x", "x", "x"]}),
    ("plant", {"root": {"label": "x", "children": [{"label": "y"}, {"label": "x", "children": []}]},
               "when": "2026-12-03", "meta": {"id": 3, "extra": True}}),
    ("ping", {}),
    ("note", {"text": [1, {"a b": "c", "x.y-z": 2.5e-7}, None, True]}),
    ("note", {}),
]


def rendered_turn(tok, calls, reasoning: str | None = None) -> str:
    """The model turn the template renders for `calls` (and a thought), up to the <|tool_response> it
    ends with: what a model trained on the template writes."""
    msg = {"role": "assistant", "content": None, "tool_calls": [
        {"id": f"c{i}", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
        for i, (n, a) in enumerate(calls)]}
    if reasoning is not None:
        msg["reasoning_content"] = reasoning
    ids = encode_prompt(tok, [{"role": "user", "content": "hi"}, msg], TOOLS, add_generation_prompt=False)
    text = tok.decode(ids)
    turn = text[text.rindex("<|turn>model\n") + len("<|turn>model\n"):]
    assert turn.endswith("<|tool_response>"), turn
    return turn[:-len("<|tool_response>")]


def parsed_calls(tok, text: str | list[int]):
    parser = Gemma4Parser(tok, tool_names={t["function"]["name"] for t in TOOLS})
    parser.feed(ids_of(tok, text) if isinstance(text, str) else text)
    parser.finish()
    return parser.result


def schema_of(name: str) -> dict:
    fn = next(t["function"] for t in TOOLS if t["function"]["name"] == name)
    return fn.get("parameters") or {"type": "object", "properties": {}, "additionalProperties": False}


@pytest.mark.parametrize("call", CALLS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CALLS)])
def test_the_template_rendering_of_a_valid_call_is_accepted(ll, tok, call):
    turn = rendered_turn(tok, [call])
    assert turn.startswith("<|tool_call>call:" + call[0] + "{")
    assert accepts(ll, tok, grammar_for("required"), turn), turn
    assert accepts(ll, tok, grammar_for({"type": "function", "function": {"name": call[0]}}), turn)
    # and the parser reads back the arguments the template was given
    (got,) = parsed_calls(tok, turn).tool_calls
    assert json.loads(got.arguments) == call[1]


def test_parallel_calls_and_a_thought_are_accepted_where_allowed(ll, tok):
    both = rendered_turn(tok, CALLS[:2])
    assert accepts(ll, tok, grammar_for("required"), both)
    assert not accepts(ll, tok, grammar_for("required", parallel=False), both)
    thought = rendered_turn(tok, CALLS[:1], reasoning="Let me look it up.")
    assert thought.startswith("<|channel>thought\nLet me look it up.\n<channel|><|tool_call>")
    assert accepts(ll, tok, grammar_for("required", lead=Lead.THOUGHT), thought)
    assert not accepts(ll, tok, grammar_for("required", lead=Lead.ANSWER), thought)   # thinking off: no thought
    # a prompt that ends inside an open thought: the rest of it, <channel|>, then the call
    assert accepts(ll, tok, grammar_for("required", lead=Lead.OPEN_THOUGHT), "more text<channel|>" + both)
    assert accepts(ll, tok, grammar_for("required", lead=Lead.OPEN_CHANNEL), "thought\nx<channel|>" + both)


def test_the_lead_follows_the_generation_prompt(tok):
    chat = [{"role": "user", "content": "hi"}]
    assert lead_of(tok, encode_prompt(tok, chat, enable_thinking=False), False) == Lead.ANSWER
    assert lead_of(tok, encode_prompt(tok, chat, enable_thinking=True), True) == Lead.THOUGHT
    prompt = encode_prompt(tok, chat, enable_thinking=True)
    open_thought = prompt + ids_of(tok, "<|channel>thought\nSo")
    assert lead_of(tok, open_thought, True) == Lead.OPEN_THOUGHT
    assert lead_of(tok, open_thought[:len(prompt) + 1], True) == Lead.OPEN_CHANNEL
    assert lead_of(tok, open_thought + ids_of(tok, "<channel|>"), True) == Lead.THOUGHT


# ---------------------------------------------------------------------------------------------
# What must be refused
# ---------------------------------------------------------------------------------------------

GOOD = f"<|tool_call>call:get_weather{{city:{Q}Paris{Q}}}<tool_call|>"


@pytest.mark.parametrize("text, why", [
    ("Sure! " + GOOD, "prose before a required call"),
    (f"<|tool_call>call:get_time{{city:{Q}Paris{Q}}}<tool_call|>", "an undeclared tool"),
    (f"<|tool_call>call:get_weather{{unit:{Q}celsius{Q}}}<tool_call|>", "a missing required key"),
    (f"<|tool_call>call:get_weather{{city:{Q}Paris{Q},unit:{Q}kelvin{Q}}}<tool_call|>", "a bad enum value"),
    ('<|tool_call>call:get_weather{city:"Paris"}<tool_call|>', "a JSON quote where <|\"|> belongs"),
    (f"<|tool_call>call:get_weather{{unit:{Q}celsius{Q},city:{Q}Paris{Q}}}<tool_call|>", "keys out of order"),
    (f"<|tool_call>call:get_weather{{city:{Q}Paris{Q},country:{Q}FR{Q}}}<tool_call|>", "an undeclared key"),
    (f"<|tool_call>call:get_weather{{city:{Q}Paris is far away{Q}}}<tool_call|>", "maxLength"),
    (f"<|tool_call>call:get_weather{{ city:{Q}Paris{Q}}}<tool_call|>", "whitespace"),
    (f"<|tool_call>call:search_web{{query:{Q}q{Q},tags:[]}}<tool_call|>", "minItems"),
    (f"<|tool_call>call:search_web{{max_results:21,query:{Q}q{Q},tags:[{Q}a{Q}]}}<tool_call|>", "maximum"),
    (f"<|tool_call>call:search_web{{first name:{Q}ann{Q},query:{Q}q{Q},tags:[{Q}a{Q}]}}<tool_call|>", "pattern"),
    ("", "a stop before any call"),
])
def test_required_refuses(ll, tok, text, why):
    assert accepts(ll, tok, grammar_for("required"), GOOD)
    assert not accepts(ll, tok, grammar_for("required"), text), why


def test_a_named_choice_allows_exactly_one_call_of_that_tool(ll, tok):
    named = grammar_for({"type": "function", "function": {"name": "get_weather"}})
    assert accepts(ll, tok, named, GOOD)
    assert not accepts(ll, tok, named, GOOD + GOOD)
    assert not accepts(ll, tok, named, rendered_turn(tok, [CALLS[5]]))           # another declared tool
    assert not accepts(ll, tok, grammar_for("required", parallel=False), GOOD + GOOD)


def test_auto_is_unconstrained_unless_a_tool_is_strict(ll, tok):
    assert chat_grammar(tools=TOOLS, tool_choice="auto", parallel_tool_calls=True, response_format=None,
                        structured_outputs=None, lead=Lead.ANSWER) is None
    assert chat_grammar(tools=TOOLS, tool_choice="none", parallel_tool_calls=True, response_format=None,
                        structured_outputs=None, lead=Lead.ANSWER) is None
    strict = [{**WEATHER, "function": {**WEATHER["function"], "strict": True}}, NO_ARGS]
    g = grammar_for("auto", tools=strict)
    assert accepts(ll, tok, g, "Let me check. " + GOOD + " Done.")
    assert accepts(ll, tok, g, "Just prose.")
    assert not accepts(ll, tok, g, f"<|tool_call>call:get_weather{{city:{Q}Paris{Q},unit:{Q}K{Q}}}<tool_call|>")
    assert accepts(ll, tok, g, f"<|tool_call>call:ping{{anything:[1,{Q}x{Q}]}}<tool_call|>")   # not strict


# ---------------------------------------------------------------------------------------------
# Documents: response_format and structured_outputs
# ---------------------------------------------------------------------------------------------

DOC_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "address": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["zip"], "additionalProperties": False},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3}},
    "required": ["name", "age"], "additionalProperties": False}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "person", "schema": DOC_SCHEMA, "strict": True}}


def test_json_schema_is_bare_compact_json_after_the_thought(ll, tok):
    doc = '{"name":"Ann","age":41,"address":{"zip":"12345"},"tags":["x"]}'
    g = grammar_for("auto", tools=[], lead=Lead.THOUGHT, response_format=JSON_SCHEMA)
    assert accepts(ll, tok, g, doc)
    assert accepts(ll, tok, g, "<|channel>thought\nhmm<channel|>" + doc)
    assert not accepts(ll, tok, g, "Here: " + doc)
    assert not accepts(ll, tok, g, '{"name": "Ann", "age": 41}')                # whitespace
    assert not accepts(ll, tok, g, '{"name":"Ann"}')                            # a missing required key
    assert not accepts(ll, tok, g, '{"name":"Ann","age":41,"address":{"zip":"1234"}}')
    off = grammar_for("auto", tools=[], lead=Lead.ANSWER, response_format=JSON_SCHEMA)
    assert not accepts(ll, tok, off, "<|channel>thought\nhmm<channel|>" + doc)
    obj = grammar_for("auto", tools=[], response_format={"type": "json_object"})
    assert accepts(ll, tok, obj, '{"any":[1,2,{"x":null}]}') and not accepts(ll, tok, obj, "[1]")
    # beside "auto" tools: a document or calls
    both = grammar_for("auto", tools=[WEATHER], response_format=JSON_SCHEMA)
    assert accepts(ll, tok, both, doc) and accepts(ll, tok, both, GOOD) and not accepts(ll, tok, both, "hi")


def test_structured_outputs_regex_choice_grammar_and_json(ll, tok):
    for so, good, bad in [
        ({"regex": r"[0-9]{3}-[a-z]+"}, "123-abc", "12-abc"),
        ({"choice": ["yes", "no", 'say "maybe"']}, 'say "maybe"', "yes!"),
        ({"grammar": 'start: "a" b+\nb: "b" | "c"'}, "abcb", "ba"),
        ({"grammar": 'root ::= "x" [0-9]+'}, "x42", "x"),                   # GBNF
        ({"json": DOC_SCHEMA}, '{"name":"A","age":1}', '{"age":1}'),
        ({"json": json.dumps(DOC_SCHEMA)}, '{"name":"A","age":1}', '{"age":1}'),
        ({"json_object": True}, "{}", "[]"),
    ]:
        thought = grammar_for("auto", tools=[], so=so, lead=Lead.THOUGHT)
        assert accepts(ll, tok, thought, "<|channel>thought\n...<channel|>" + good), so
        assert accepts(ll, tok, thought, good) and not accepts(ll, tok, thought, bad), so
        spec, param = completion_grammar(so)
        assert param == "structured_outputs." + next(iter(so))
        assert accepts(ll, tok, spec.grammar, good) and not accepts(ll, tok, spec.grammar, bad), so
        assert not accepts(ll, tok, spec.grammar, "<|channel>thought\n...<channel|>" + good)
    assert completion_grammar(None) is None


# ---------------------------------------------------------------------------------------------
# Random walks: whatever the grammar allows parses and validates
# ---------------------------------------------------------------------------------------------


def random_walk(ll, tok, grammar: str, rng: random.Random, limit: int = 400) -> list[int] | None:
    """Draw a random allowed token at each step (markers and stop tokens favoured, so that walks end)
    until a stop token; None if the walk did not end within `limit` tokens."""
    m = matcher(ll, grammar)
    mask = llguidance.numpy.allocate_token_bitmask(1, ll.vocab_size)
    stops = set(tok.special.end_of_generation)
    favoured = set(tok.structural_ids) | {ids_of(tok, c)[0] for c in ",}]"}
    out: list[int] = []
    for _ in range(limit):
        llguidance.numpy.fill_next_token_bitmask(m, mask, 0)
        bits = np.unpackbits(mask[0].view(np.uint8), bitorder="little")[:ll.vocab_size]
        allowed = np.flatnonzero(bits).tolist()
        assert allowed, "the grammar left no token (a dead end)"
        pick = [t for t in allowed if t in favoured]
        t = rng.choice(pick if pick and rng.random() < 0.35 else allowed)
        if t in stops:
            return out
        assert m.consume_token(t), m.get_error()
        out.append(t)
    return None


@pytest.mark.parametrize("choice, parallel", [("required", True), ("required", False),
                                              ({"type": "function", "function": {"name": "search_web"}}, True),
                                              ({"type": "function", "function": {"name": "plant"}}, True)])
def test_random_walks_through_a_tool_grammar_are_valid_calls(ll, tok, choice, parallel):
    rng = random.Random(7)
    g = grammar_for(choice, parallel=parallel, lead=Lead.THOUGHT)
    ended = 0
    for _ in range(30):
        ids = random_walk(ll, tok, g, rng)
        if ids is None:
            continue
        ended += 1
        result = parsed_calls(tok, ids)
        assert not result.malformed, (tok.decode(ids), result.errors)
        assert result.content == ""
        assert len(result.tool_calls) >= 1 and (parallel or len(result.tool_calls) == 1)
        if isinstance(choice, dict):
            assert [c.name for c in result.tool_calls] == [choice["function"]["name"]]
        for call in result.tool_calls:
            assert call.complete
            jsonschema.validate(json.loads(call.arguments), schema_of(call.name))
    assert ended >= 20


def test_random_walks_through_a_json_schema_grammar_validate(ll, tok):
    rng = random.Random(3)
    g = grammar_for("auto", tools=[], lead=Lead.THOUGHT, response_format=JSON_SCHEMA)
    ended = 0
    for _ in range(30):
        ids = random_walk(ll, tok, g, rng)
        if ids is None:
            continue
        ended += 1
        parser = Gemma4Parser(tok)
        parser.feed(ids)
        parser.finish()
        jsonschema.validate(json.loads(parser.result.content), DOC_SCHEMA)
    assert ended >= 20


# ---------------------------------------------------------------------------------------------
# What the compiler cannot honour, and bounds
# ---------------------------------------------------------------------------------------------


def tool(parameters: dict) -> dict:
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


@pytest.mark.parametrize("parameters, keyword", [
    ({"type": "object", "properties": {"x": {"type": "array", "uniqueItems": True}}}, "uniqueItems"),
    ({"type": "object", "patternProperties": {"^a": {}}}, "patternProperties"),
    ({"type": "object", "properties": {"x": {"not": {"type": "string"}}}}, "not"),
    ({"type": "object", "properties": {"x": {"type": "string", "format": "color"}}}, "color"),
    ({"type": "object", "properties": {"x": {"type": "string", "minimum": 3}}}, "minimum"),
    ({"type": "object", "properties": {"x": {"$ref": "https://example.com/s.json"}}}, "$ref"),
    ({"type": "object", "properties": {"x": {"$ref": "#/$defs/missing"}}}, "points at nothing"),
    ({"type": "object", "properties": {"x": {"type": "string", "pattern": "a|^b"}}}, "pattern"),
    ({"type": "object", "properties": {"x": {"type": "array", "maxItems": 10**6}}}, "maxItems"),
])
def test_an_unsupported_schema_is_refused_naming_the_keyword_and_the_parameter(parameters, keyword):
    with pytest.raises(GrammarError) as e:
        chat_grammar(tools=[NO_ARGS, tool(parameters)], tool_choice="required", parallel_tool_calls=True,
                     response_format=None, structured_outputs=None, lead=Lead.ANSWER)
    assert e.value.param == "tools[1].function.parameters"
    assert keyword in e.value.message


def test_a_named_choice_compiles_only_its_tool_and_names_it_by_its_index():
    bad = {"type": "object", "properties": {"x": {"not": {}}}}
    spec, _ = chat_grammar(tools=[tool(bad), WEATHER], tool_choice={"type": "function", "function": {
        "name": "get_weather"}}, parallel_tool_calls=True, response_format=None, structured_outputs=None,
        lead=Lead.ANSWER)                              # the other tool's schema is not compiled
    assert '"get_weather"' in spec.grammar and '"f"' not in spec.grammar
    with pytest.raises(GrammarError) as e:
        chat_grammar(tools=[WEATHER, tool(bad)], tool_choice={"type": "function", "function": {"name": "f"}},
                     parallel_tool_calls=True, response_format=None, structured_outputs=None, lead=Lead.ANSWER)
    assert e.value.param == "tools[1].function.parameters"


def test_schemas_llguidance_refuses_are_refused_by_validate(vocab):
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}}}
    spec, param = chat_grammar(tools=None, tool_choice=None, parallel_tool_calls=True, response_format=rf,
                               structured_outputs=None, lead=Lead.ANSWER)
    assert param == "response_format.json_schema.schema"
    with pytest.raises(GrammarError, match="uniqueItems") as e:
        validate(spec, param, vocab)
    assert e.value.param == param
    spec, param = completion_grammar({"regex": "(a"})
    with pytest.raises(GrammarError) as e:
        validate(spec, param, vocab)
    assert e.value.param == "structured_outputs.regex"


def test_hostile_schemas_are_bounded():
    big = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 64} for i in range(1000)}}
    with pytest.raises(GrammarError, match=f"at most {MAX_SPEC_BYTES} bytes") as e:
        chat_grammar(tools=[tool(big)], tool_choice="required", parallel_tool_calls=True, response_format=None,
                     structured_outputs=None, lead=Lead.ANSWER)
    assert e.value.param == "tools[0].function.parameters"
    deep: dict = {"type": "string"}
    for _ in range(100):
        deep = {"type": "object", "properties": {"x": deep}}
    for call in (lambda: chat_grammar(tools=[tool(deep)], tool_choice="required", parallel_tool_calls=True,
                                      response_format=None, structured_outputs=None, lead=Lead.ANSWER),
                 lambda: completion_grammar({"json": deep})):
        with pytest.raises(GrammarError, match="deep"):
            call()
    with pytest.raises(GrammarError, match="exactly one"):
        completion_grammar({"regex": "a", "choice": ["a"]})
    with pytest.raises(GrammarError, match="not among the tools") as e:
        chat_grammar(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}},
                     parallel_tool_calls=True, response_format=None, structured_outputs=None, lead=Lead.ANSWER)
    assert e.value.param == "tool_choice"
