"""Constrained decoding through the server, with the official `openai` client and the demo checkpoint (random
weights: its unconstrained output is junk, which is why every guarantee below must come from the grammar).

Seeded requests at temperature 1 (varied outputs), streamed and not, thinking on and off, n = 2, with and
without ngram speculation: every `required` reply calls declared tools with arguments that validate against
their schemas (`jsonschema`); a named choice calls exactly that tool; `parallel_tool_calls: false` gives one
call; `json_schema` content validates; `structured_outputs` on completions matches; `logit_bias` cannot
force a token the grammar masks. A schema the compiler cannot honour, or an oversized one, is a 400 naming
the parameter. Grammar-level checks: tests/test_grammars.py.
"""
from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

import gem4
from gem4.demo import ensure_demo
from gem4.server import ServerConfig, create_app
from server_helpers import InProcessServer, accumulate, assert_openai_error, client_for, metric, user

MODEL = "demo"
CHANNEL_END = 101             # <channel|>: biased in thinking tests, so that random thoughts end soon
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {
    "type": "object",
    "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 8},
                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "unit"], "additionalProperties": False}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object",
    "properties": {"query": {"type": "string", "maxLength": 6},
                   "filters": {"type": "object", "properties": {"recent": {"type": "boolean"},
                                                                 "lang": {"enum": ["en", "fr", None]}},
                               "required": ["recent"]},
                   "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2}},
    "required": ["query"]}}}
TOOLS = [WEATHER, SEARCH]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "address": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                                                 "city": {"type": "string", "maxLength": 5}},
                "required": ["zip"], "additionalProperties": False},
    "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 3},
    "score": {"type": "number", "minimum": 0, "maximum": 1},
    "member": {"type": "boolean"}},
    "required": ["name", "age", "address"], "additionalProperties": False}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GEM4_CACHE", str(tmp_path_factory.mktemp("gem4-cache")))
        directory = ensure_demo()
    return gem4.load(directory, dtype="float32"), gem4.Tokenizer.from_file(directory)


@pytest.fixture(scope="module", params=[None, NGRAM], ids=["plain", "ngram"])
def served(request, model):
    """(base URL, client) of an in-process server on the demo checkpoint, with or without ngram speculation."""
    m, tok = model
    engine = gem4.Engine(m, tok, max_model_len=1024, max_num_seqs=4, speculative_config=request.param)
    app = create_app(ServerConfig(served_model_name=MODEL, max_num_seqs=4), engine)
    with InProcessServer(app) as base:
        yield base, client_for(base)
    engine.shutdown()


def thinking_body(thinking: bool) -> dict:
    body = {"chat_template_kwargs": {"enable_thinking": thinking}}
    if thinking:
        body["logit_bias"] = {str(CHANNEL_END): 10}
    return body


def choices_of(client, stream: bool, **kwargs) -> list[dict]:
    """Each choice as {content, reasoning_content, tool_calls: [{name, arguments}], finish_reason}, from a
    streamed reply (folded per choice index) or a whole one."""
    if not stream:
        r = client.chat.completions.create(model=MODEL, **kwargs)
        return [{"content": c.message.content or "",
                 "reasoning_content": (c.message.model_extra or {}).get("reasoning_content") or "",
                 "tool_calls": [{"name": t.function.name, "arguments": t.function.arguments}
                                for t in c.message.tool_calls or []],
                 "finish_reason": c.finish_reason} for c in sorted(r.choices, key=lambda c: c.index)]
    chunks = list(client.chat.completions.create(model=MODEL, stream=True, **kwargs))
    indices = sorted({c.choices[0].index for c in chunks if c.choices})
    return [accumulate([c for c in chunks if c.choices and c.choices[0].index == i]) for i in indices]


def check_calls(choice: dict, names=None) -> None:
    assert choice["content"].strip() == "", choice
    assert choice["finish_reason"] == "tool_calls", choice
    assert len(choice["tool_calls"]) >= 1
    for call in choice["tool_calls"]:
        assert call["name"] in (names or SCHEMAS)
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("thinking", [False, True], ids=["no-think", "think"])
def test_required_gives_valid_calls_to_declared_tools(served, stream, thinking):
    _, client = served
    for seed in range(3):
        choices = choices_of(client, stream, messages=user(f"Plan my trip {seed}"), tools=TOOLS,
                             tool_choice="required", n=2, seed=seed, temperature=1.0, max_tokens=400,
                             extra_body=thinking_body(thinking))
        assert len(choices) == 2
        for choice in choices:
            check_calls(choice)
            if not thinking:
                assert choice["reasoning_content"] == ""


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_named_choice_and_parallel_false_give_one_call(served, stream):
    _, client = served
    for seed in range(3):
        named = choices_of(client, stream, messages=user("Look it up"), tools=TOOLS, n=2, seed=seed,
                           tool_choice={"type": "function", "function": {"name": "search"}}, temperature=1.0,
                           max_tokens=400, extra_body=thinking_body(seed == 2))
        for choice in named:
            check_calls(choice, names={"search"})
            assert len(choice["tool_calls"]) == 1
        single = choices_of(client, stream, messages=user("Weather?"), tools=TOOLS, tool_choice="required",
                            parallel_tool_calls=False, n=2, seed=seed, temperature=1.0, max_tokens=400)
        for choice in single:
            check_calls(choice)
            assert len(choice["tool_calls"]) == 1


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("thinking", [False, True], ids=["no-think", "think"])
def test_json_schema_content_validates(served, stream, thinking):
    _, client = served
    for seed in range(3):
        for choice in choices_of(client, stream, messages=user(f"Who is person {seed}?"), response_format=JSON_SCHEMA,
                                 n=2, seed=seed, temperature=1.0, max_tokens=400, extra_body=thinking_body(thinking)):
            assert choice["finish_reason"] == "stop", choice
            assert choice["tool_calls"] == []
            jsonschema.validate(json.loads(choice["content"]), PERSON)
    obj = choices_of(client, stream, messages=user("Anything"), response_format={"type": "json_object"}, n=2,
                     seed=5, temperature=1.0, max_tokens=60)
    for choice in obj:     # any object: a random model may not close it in time, but what it writes is one
        assert choice["content"].startswith("{")
        if choice["finish_reason"] == "stop":
            assert isinstance(json.loads(choice["content"]), dict)


def test_a_cut_document_finishes_with_length(served):
    _, client = served
    r = client.chat.completions.create(model=MODEL, messages=user("Who?"), response_format=JSON_SCHEMA, seed=1,
                                       temperature=1.0, max_tokens=3)
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].message.content.startswith('{"')


def test_logit_bias_cannot_force_a_masked_token(served, model):
    _, client = served
    _, tok = model
    word = tok.encode("Hello", add_bos=False)[0]
    turn_end = tok.special.turn_end
    bias = {str(word): 100, str(turn_end): 100}
    r = client.chat.completions.create(model=MODEL, messages=user("Say hello"), tools=TOOLS, seed=3,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                       logit_bias=bias, logprobs=True, top_logprobs=5, temperature=1.0,
                                       max_tokens=400)
    (choice,) = r.choices
    check_calls({"content": choice.message.content or "", "finish_reason": choice.finish_reason,
                 "tool_calls": [{"name": t.function.name, "arguments": t.function.arguments}
                                for t in choice.message.tool_calls]}, names={"get_weather"})
    first = choice.logprobs.content[0]
    # thinking off, a named tool: <|tool_call> is the only token allowed first, whatever the bias
    assert first.token == "<|tool_call>" and first.logprob == 0.0
    assert [t.token for t in first.top_logprobs] == ["<|tool_call>"]


def test_structured_outputs_on_completions_and_chat(served):
    base, client = served
    for seed in range(3):
        r = client.completions.create(model=MODEL, prompt="Code:", seed=seed, temperature=1.0, max_tokens=40,
                                      extra_body={"structured_outputs": {"regex": "[A-Z]{2}-[0-9]{3}"}})
        assert re.fullmatch("[A-Z]{2}-[0-9]{3}", r.choices[0].text) and r.choices[0].finish_reason == "stop"
        r = client.completions.create(model=MODEL, prompt="Pick:", seed=seed, temperature=1.0, max_tokens=40,
                                      extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}})
        assert r.choices[0].text in ("red", "green", "blue")
        r = client.chat.completions.create(model=MODEL, messages=user("Yes or no?"), seed=seed, temperature=1.0,
                                           max_tokens=40, extra_body={"structured_outputs": {
                                               "grammar": 'start: "yes" | "no" | "maybe " NUM\nNUM: /[0-9]/'}})
        assert re.fullmatch("yes|no|maybe [0-9]", r.choices[0].message.content)
        r = client.chat.completions.create(model=MODEL, messages=user("Who?"), seed=seed, temperature=1.0,
                                           max_tokens=400, extra_body={"structured_outputs": {"json": PERSON}})
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    assert metric(base, "gem4:structured_requests_total", kind="regex") >= 3
    assert metric(base, "gem4:structured_requests_total", kind="json_schema") >= 3
    # a grammar this process has not compiled yet (engines on one tokenizer share their compiled grammars)
    r = client.completions.create(model=MODEL, prompt="URL:", max_tokens=40, extra_body={"structured_outputs": {
        "choice": [base, base + "/"]}})
    assert r.choices[0].text in (base, base + "/")
    assert metric(base, "gem4:grammar_compile_seconds_count") >= 1
    assert metric(base, "gem4:grammar_mask_seconds_count") >= 1


def tool_with(parameters: dict) -> dict:
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


def test_schemas_the_compiler_cannot_honour_are_400s_naming_the_parameter(served):
    base, _ = served
    url = base + "/v1/chat/completions"

    def post(**body):
        return httpx.post(url, json={"model": MODEL, "messages": user("hi"), "max_tokens": 4, **body}, timeout=60)

    unsupported = {"type": "object", "properties": {"x": {"type": "array", "uniqueItems": True}}}
    err = assert_openai_error(post(tools=[tool_with(unsupported)], tool_choice="required"), 400,
                              param="tools[0].function.parameters")
    assert "uniqueItems" in err["message"]
    err = assert_openai_error(post(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": unsupported}}), 400, param="response_format.json_schema.schema")
    assert "uniqueItems" in err["message"]
    huge = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "d" * 100}
                                             for i in range(700)}}
    err = assert_openai_error(post(tools=[tool_with(huge)], tool_choice="required"), 400, param="tools[0]")
    assert "bytes" in err["message"]
    assert_openai_error(post(structured_outputs={"regex": "(unclosed"}), 400,
                        param="structured_outputs.regex")
    assert_openai_error(post(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), 400,
                        param="tool_choice")
    # auto stays unconstrained: a schema the compiler refuses is no error there unless the tool is strict
    assert post(tools=[tool_with(unsupported)]).status_code == 200
    strict = {"type": "function", "function": {"name": "f", "parameters": unsupported, "strict": True}}
    assert_openai_error(post(tools=[strict]), 400, param="tools[0].function.parameters")
    assert httpx.get(base + "/health", timeout=10).status_code == 200


def test_openai_client_sees_the_400(served):
    _, client = served
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=user("hi"), tools=[tool_with(
            {"type": "object", "properties": {"x": {"not": {}}}})], tool_choice="required")
    assert e.value.body["param"] == "tools[0].function.parameters" and "'not'" in e.value.body["message"]
