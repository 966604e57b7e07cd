"""POST /v1/responses (what Codex CLI speaks) with the official `openai` client and the demo checkpoint (random
weights: tool calls and JSON come from the grammars of tool_choice and text.format).

`responses.create` streamed and not, `responses.stream(...)` accumulated by the SDK (its ordering checks raise
on a bad stream) with `get_final_response()` equal to the whole reply; the raw SSE event names and order, no
`[DONE]`; the input items -> chat messages translation renders the prompt the chat API renders; a conversation
replayed the way Codex replays it reads the earlier turns from the prefix cache; clamped max_output_tokens; the
stateless 400s."""
from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

import gem4
from gem4.demo import ensure_demo
from gem4.server import ServerConfig, create_app
from gem4.server.protocol_responses import ResponsesRequest, chat_messages
from server_helpers import InProcessServer, assert_openai_error, client_for

MODEL = "demo"
CHANNEL, CHANNEL_END = 100, 101   # <|channel>, <channel|>: biased, so that random thoughts open and end soon
CONTEXT = 1024

CITY = {"type": "object", "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 8}},
        "required": ["city"], "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather of a city", "parameters": CITY}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": "string", "not": {}}}}   # 'not': no grammar
THINK = {"seed": 0, "logit_bias": {str(CHANNEL): 10, str(CHANNEL_END): 10}}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GEM4_CACHE", str(tmp_path_factory.mktemp("gem4-cache")))
        directory = ensure_demo()
    model, tok = gem4.load(directory, dtype="float32"), gem4.Tokenizer.from_file(directory)
    engine = gem4.Engine(model, tok, max_model_len=CONTEXT, max_num_seqs=4)
    app = create_app(ServerConfig(served_model_name=MODEL, max_num_seqs=4), engine)
    with InProcessServer(app) as base:
        yield base, client_for(base), engine
    engine.shutdown()


def items(response) -> list[dict]:
    """The output items without their generated ids (call ids are random per request)."""
    out = []
    for item in response.output:
        d = item.model_dump(exclude_none=True, exclude={"id", "call_id", "parsed_arguments"})
        for part in d.get("content", []):
            part.pop("parsed", None)
        out.append(d)
    return out


def both(client, **kwargs):
    """The whole reply, and the same request streamed through `responses.stream` (the SDK's accumulator)
    with its events."""
    whole = client.responses.create(model=MODEL, **kwargs)
    with client.responses.stream(model=MODEL, **kwargs) as stream:
        events = list(stream)
        # the SDK returns a final response for response.completed only; an incomplete one is the last event's
        final = stream.get_final_response() if whole.status == "completed" else events[-1].response
    assert events[-1].type == f"response.{whole.status}"
    return whole, final, events


def check_usage(r) -> None:
    u = r.usage
    assert u.input_tokens > 0 and u.output_tokens > 0
    assert u.total_tokens == u.input_tokens + u.output_tokens
    assert 0 <= u.input_tokens_details.cached_tokens <= u.input_tokens
    assert 0 <= u.output_tokens_details.reasoning_tokens <= u.output_tokens


def test_text_streamed_and_whole(served):
    _, client, _ = served
    whole, final, events = both(client, input="Say hello", max_output_tokens=12, temperature=1.0,
                                extra_body={"seed": 3})
    assert whole.id.startswith("resp_") and whole.object == "response"
    assert [i.type for i in whole.output] == ["message"] and whole.output[0].id.startswith("msg_")
    assert whole.output_text and final.output_text == whole.output_text
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    assert items(final) == items(whole)
    check_usage(whole)
    assert whole.usage.output_tokens == 12
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert (final.usage.input_tokens, final.usage.output_tokens) == (whole.usage.input_tokens, 12)


def test_tool_call_with_thinking_required(served):
    _, client, _ = served
    thought = 0
    for seed in range(6):
        kwargs = dict(input=f"Weather in Paris? {seed}", tools=[WEATHER], tool_choice="required",
                      reasoning={"effort": "high"}, include=["reasoning.encrypted_content"], temperature=1.0,
                      max_output_tokens=400, extra_body={**THINK, "seed": seed})
        whole, final, _ = both(client, **kwargs)
        assert items(final) == items(whole)
        assert whole.status == "completed", whole
        kinds = [i.type for i in whole.output]
        assert kinds[-1] == "function_call" and set(kinds) <= {"reasoning", "function_call"}, kinds
        for item in whole.output:
            if item.type == "function_call":
                assert item.name == "get_weather" and item.id.startswith("fc_") and item.call_id
                jsonschema.validate(json.loads(item.arguments), CITY)
            else:
                thought += 1
                assert item.id.startswith("rs_") and item.content[0].type == "reasoning_text"
                assert item.encrypted_content == item.content[0].text
                assert whole.usage.output_tokens_details.reasoning_tokens > 0
        check_usage(whole)
    assert thought, "no seed thought before calling"


def test_reasoning_effort_none_turns_thinking_off(served):
    _, client, _ = served
    for seed in range(3):
        r = client.responses.create(model=MODEL, input="Weather?", tools=[WEATHER], tool_choice="required",
                                    reasoning={"effort": "none"}, max_output_tokens=200, temperature=1.0,
                                    extra_body={"seed": seed})
        assert [i.type for i in r.output] == ["function_call"] * len(r.output) and r.output
        assert r.usage.output_tokens_details.reasoning_tokens == 0


def test_named_choice_and_custom_tool(served):
    _, client, _ = served
    patch = {"type": "custom", "name": "apply_patch", "description": "Apply a patch"}
    hosted = {"type": "web_search"}
    whole, final, events = both(client, input="Fix it", tools=[WEATHER, patch, hosted],
                                tool_choice={"type": "custom", "name": "apply_patch"}, parallel_tool_calls=False,
                                max_output_tokens=300, temperature=1.0, extra_body={"seed": 1})
    assert items(final) == items(whole)
    calls = [i for i in whole.output if i.type != "reasoning"]
    assert len(calls) == 1 and calls[0].type == "custom_tool_call" and calls[0].name == "apply_patch"
    assert isinstance(calls[0].input, str) and calls[0].call_id
    (done,) = [e for e in events if e.type == "response.custom_tool_call_input.done"]
    assert done.input == calls[0].input
    deltas = [e.delta for e in events if e.type == "response.custom_tool_call_input.delta"]
    assert "".join(deltas) == calls[0].input and len(deltas) > 1, deltas     # streamed as it is written
    # its output goes back as a custom_tool_call_output item, rendered as a tool message
    history = [{"role": "user", "content": "Fix it"}, calls[0].model_dump(exclude_none=True),
               {"type": "custom_tool_call_output", "call_id": calls[0].call_id, "output": "Done."}]
    again = client.responses.create(model=MODEL, input=history, tools=[patch], max_output_tokens=2)
    assert again.usage.input_tokens > whole.usage.input_tokens


def test_json_schema_text_format(served):
    _, client, _ = served
    fmt = {"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}}
    done = 0
    for seed in range(3):
        whole, final, _ = both(client, input="Who?", text=fmt, max_output_tokens=300, temperature=1.0,
                               extra_body={"seed": seed})
        assert final.output_text == whole.output_text
        if whole.status == "completed":
            jsonschema.validate(json.loads(whole.output_text), PERSON)
            done += 1
    assert done


@pytest.mark.parametrize("text", ['line "one"\nline\\two \U0001F600 \u00e9\u0001 end', "\\ud83d x", ""])
def test_a_custom_tool_input_streams_whole_characters(text):
    """The custom tool's input decoded from its JSON arguments however they are cut: escapes and surrogate pairs
    never split, the text exact; arguments of another form stream nothing."""
    from gem4.server.routes.responses import _InputStream

    for ascii_only in (True, False):
        args = json.dumps({"input": text}, separators=(",", ":"), ensure_ascii=ascii_only)
        for step in (1, 2, 3, 7, len(args)):
            stream = _InputStream()
            parts = [stream.feed(args[i:i + step]) for i in range(0, len(args), step)]
            assert "".join(parts) == text == stream.sent
    other = _InputStream()
    assert other.feed('{"path":"a","input":"b"}') == "" and other.sent == ""


def raw_events(base: str, body: dict) -> tuple[list[str], list[dict]]:
    with httpx.stream("POST", base + "/v1/responses", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line and not line.startswith(":")]
    names, data = [], []
    for line in lines:
        assert not line.endswith("[DONE]")
        if line.startswith("event: "):
            names.append(line[len("event: "):])
        else:
            assert line.startswith("data: ") and len(data) == len(names) - 1, "one data line per event line"
            data.append(json.loads(line[len("data: "):]))
    assert [d["type"] for d in data] == names
    assert [d["sequence_number"] for d in data] == list(range(len(data)))
    return names, data


def test_raw_sse_text(served):
    base, _, _ = served
    names, data = raw_events(base, {"model": MODEL, "input": "hi", "stream": True, "max_output_tokens": 5,
                                    "seed": 2, "temperature": 1.0})
    deltas = names.count("response.output_text.delta")
    assert deltas >= 1
    assert names == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added"] + ["response.output_text.delta"] * deltas + [
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.incomplete"]
    assert len({d["response"]["id"] for d in data if "response" in d}) == 1
    assert data[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_raw_sse_tool_call_with_thinking(served):
    base, _, _ = served
    for seed in range(6):
        names, data = raw_events(base, {
            "model": MODEL, "input": f"Weather? {seed}", "stream": True, "tools": [WEATHER],
            "tool_choice": "required", "reasoning": {"effort": "high"}, "max_output_tokens": 400,
            "temperature": 1.0, **THINK, "seed": seed})
        if "response.reasoning_text.delta" not in names:
            continue
        r, a = names.count("response.reasoning_text.delta"), names.count("response.function_call_arguments.delta")
        assert names[:2 + 2 + r + 3] == (
            ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
            + ["response.reasoning_text.delta"] * r
            + ["response.reasoning_text.done", "response.content_part.done", "response.output_item.done"])
        rest = names[2 + 2 + r + 3:]
        assert rest[-1] == "response.completed"
        calls = 0
        rest = rest[:-1]
        while rest:                       # one call after the other: added, argument deltas, done
            a = next(i for i, n in enumerate(rest) if n != "response.function_call_arguments.delta" and i > 0)
            assert rest[:a + 2] == (["response.output_item.added"]
                                    + ["response.function_call_arguments.delta"] * (a - 1)
                                    + ["response.function_call_arguments.done", "response.output_item.done"])
            rest = rest[a + 2:]
            calls += 1
        final = data[-1]["response"]
        assert [i["type"] for i in final["output"]] == ["reasoning"] + ["function_call"] * calls
        for index, item in enumerate(final["output"][1:], 1):
            args = "".join(d["delta"] for d in data if d["type"] == "response.function_call_arguments.delta"
                           and d["output_index"] == index)
            assert args == item["arguments"]
            done = next(d["item"] for d in data
                        if d["type"] == "response.output_item.done" and d["output_index"] == index)
            assert done == item
        return
    pytest.fail("no seed thought before calling")


HISTORY = [
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
    {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Need the weather."}]},
    {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\":\"Paris\"}"},
    {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 21 C"},
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sunny."}]},
    {"type": "message", "role": "user", "content": "And Rome?"},
]
CHAT_HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
    {"role": "assistant", "content": None, "reasoning_content": "Need the weather.", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
    {"role": "assistant", "content": [{"type": "text", "text": "Sunny."}]},
    {"role": "user", "content": "And Rome?"},
]


def test_input_items_become_the_chat_messages():
    req = ResponsesRequest.model_validate({"input": HISTORY, "instructions": "Be brief."})
    assert chat_messages(req) == CHAT_HISTORY
    # contiguous reasoning + text + calls: one assistant turn; reasoning from content, summary or encrypted_content
    for reasoning in ({"content": [{"type": "reasoning_text", "text": "T"}]}, {"encrypted_content": "T"},
                      {"summary": [{"type": "summary_text", "text": "T"}], "encrypted_content": "x"}):
        turn = chat_messages(ResponsesRequest.model_validate({"input": [
            {"role": "user", "content": "q"}, {"type": "reasoning", **reasoning},
            {"type": "message", "role": "assistant", "content": "a"},
            {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]}))[1:]
        assert turn == [{"role": "assistant", "content": "a", "reasoning_content": "T", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]


def test_history_renders_the_chat_prompt(served, monkeypatch):
    """The engine gets the same prompt ids from the Responses history as from the equivalent chat messages."""
    base, client, engine = served
    prompts = []
    submit = engine.submit

    def recording(prompt_ids, *args, **kwargs):
        prompts.append(list(prompt_ids))
        return submit(prompt_ids, *args, **kwargs)

    monkeypatch.setattr(engine, "submit", recording)
    chat_tools = [{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}]
    r = client.responses.create(model=MODEL, instructions="Be brief.", input=HISTORY, tools=[WEATHER],
                                max_output_tokens=1, extra_body={"seed": 0})
    chat = client.chat.completions.create(model=MODEL, messages=CHAT_HISTORY, tools=chat_tools, max_tokens=1)
    ids = httpx.post(base + "/tokenize", json={"model": MODEL, "messages": CHAT_HISTORY, "tools": chat_tools},
                     timeout=60).json()["tokens"]
    assert prompts == [ids, ids]
    assert r.usage.input_tokens == chat.usage.prompt_tokens == len(ids)


def test_logprobs(served):
    _, client, _ = served
    r = client.responses.create(model=MODEL, input="hi", max_output_tokens=4, top_logprobs=2,
                                include=["message.output_text.logprobs"], extra_body={"seed": 0})
    (part,) = r.output[0].content
    assert len(part.logprobs) == 4 and "".join(lp.token for lp in part.logprobs) == part.text
    assert all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in part.logprobs)


def test_codex_replay_reads_earlier_turns_from_the_prefix_cache(served):
    """Codex's way: the whole history (the user turn, the reply's items, the tool outputs) every turn. From the
    second turn on, the prefix cache supplies every earlier turn's prompt, to within a block (16 tokens)."""
    _, client, _ = served
    history = [{"type": "message", "role": "user", "content": "Weather in Oslo? " * 20}]
    previous = None
    for turn in range(3):
        r = client.responses.create(model=MODEL, instructions="You are a coding agent.", input=history,
                                    tools=[WEATHER], tool_choice="required", max_output_tokens=100,
                                    temperature=1.0, store=False, extra_body={"seed": 5 + turn})
        assert r.status == "completed"
        if previous is not None:
            assert r.usage.input_tokens > previous
            assert r.usage.input_tokens_details.cached_tokens >= previous - 16, (previous, r.usage)
        previous = r.usage.input_tokens
        history += [i.model_dump(exclude_none=True) for i in r.output]
        history += [{"type": "function_call_output", "call_id": i.call_id, "output": f"Rain {turn}."}
                    for i in r.output if i.type == "function_call"]


def test_max_output_tokens_is_clamped_and_a_long_input_fails(served):
    base, client, _ = served
    r = client.responses.create(model=MODEL, input="hi", max_output_tokens=10 * CONTEXT, temperature=1.0,
                                extra_body={"seed": 4, "ignore_eos": True})
    assert r.status == "incomplete" and r.usage.input_tokens + r.usage.output_tokens == CONTEXT
    long = "word " * (2 * CONTEXT)
    assert_openai_error(httpx.post(base + "/v1/responses", json={"model": MODEL, "input": long}, timeout=60), 400,
                        code="context_length_exceeded")
    names, data = raw_events(base, {"model": MODEL, "input": long, "stream": True})
    assert names == ["response.created", "response.in_progress", "response.failed"]
    assert data[-1]["response"]["error"]["code"] == "context_length_exceeded"


def test_previous_response_id_continues_a_stored_conversation(served, monkeypatch):
    """A stored response (store defaults to true) is continued by previous_response_id: the prompt is the one the
    whole history renders (instructions not carried over), read from the prefix cache; GET returns the stored
    response, DELETE forgets it; store: false keeps nothing; an unknown id is a 400 naming the field."""
    base, client, engine = served
    prompts = []
    submit = engine.submit

    def recording(prompt_ids, *args, **kwargs):
        prompts.append(list(prompt_ids))
        return submit(prompt_ids, *args, **kwargs)

    monkeypatch.setattr(engine, "submit", recording)
    first = client.responses.create(model=MODEL, instructions="Be brief.", input="Weather in Oslo? " * 8,
                                    tools=[WEATHER], tool_choice="required", max_output_tokens=100, temperature=1.0,
                                    extra_body={"seed": 1})
    assert first.status == "completed" and first.store and first.previous_response_id is None
    outputs = [{"type": "function_call_output", "call_id": i.call_id, "output": "Rain."}
               for i in first.output if i.type == "function_call"]
    second = client.responses.create(model=MODEL, previous_response_id=first.id, input=outputs, tools=[WEATHER],
                                     instructions="Be brief.", max_output_tokens=3, extra_body={"seed": 2})
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 16
    history = [{"type": "message", "role": "user", "content": "Weather in Oslo? " * 8},
               *[i.model_dump(exclude_none=True) for i in first.output], *outputs]
    whole = client.responses.create(model=MODEL, input=history, tools=[WEATHER], instructions="Be brief.",
                                    max_output_tokens=3, store=False, extra_body={"seed": 2})
    assert prompts[1] == prompts[2] and len(prompts[1]) > len(prompts[0])
    assert [i.model_dump() for i in whole.output] and whole.store is False
    # a chain: the third turn continues the second, and so the first
    third = client.responses.create(model=MODEL, previous_response_id=second.id, input="And tomorrow?",
                                    tools=[WEATHER], instructions="Be brief.", max_output_tokens=2,
                                    extra_body={"seed": 3})
    assert prompts[3][:len(prompts[1]) - 5] == prompts[1][:-5]     # but its generation prompt (an empty thought)
    key = {"Authorization": "Bearer none"}
    got = httpx.get(f"{base}/v1/responses/{second.id}", headers=key, timeout=60)
    assert got.status_code == 200 and got.json()["id"] == second.id
    assert client.responses.retrieve(second.id) == second
    assert httpx.get(f"{base}/v1/responses/{whole.id}", timeout=60).status_code == 404       # store: false
    _, data = raw_events(base, {"model": MODEL, "input": "hi", "stream": True, "max_output_tokens": 2})
    final = data[-1]["response"]                                                              # streamed: stored too
    assert httpx.get(f"{base}/v1/responses/{final['id']}", timeout=60).json() == final
    deleted = httpx.delete(f"{base}/v1/responses/{first.id}", timeout=60)
    assert deleted.status_code == 200 and deleted.json()["deleted"] is True
    assert_openai_error(httpx.get(f"{base}/v1/responses/{first.id}", timeout=60), 404)
    err = assert_openai_error(httpx.post(base + "/v1/responses", json={
        "model": MODEL, "input": "hi", "previous_response_id": first.id}, timeout=60), 400,
        param="previous_response_id", code="previous_response_not_found")
    assert first.id in err["message"]
    # the chain's later turns hold the first turn's conversation themselves
    again = client.responses.create(model=MODEL, previous_response_id=third.id, input="ok", tools=[WEATHER],
                                    instructions="Be brief.", max_output_tokens=1)
    assert again.status in ("completed", "incomplete") and again.usage.input_tokens > third.usage.input_tokens


def test_the_response_store_is_bounded_and_evicts_the_least_recently_used():
    from gem4.server.store import ResponseStore

    def response(i: int, pad: int = 0) -> dict:
        return {"id": f"resp_{i}", "output": [], "pad": "x" * pad}

    one = len(json.dumps(response(0), separators=(",", ":"))) + len("[]")
    store = ResponseStore(3 * one)
    for i in range(3):
        assert store.put(response(i), [])
    assert len(store) == 3 and store.size == 3 * one
    assert store.get("resp_0") is not None          # now the most recently used: resp_1 goes first
    assert store.put(response(3), [])
    assert [store.get(f"resp_{i}") is not None for i in range(4)] == [True, False, True, True]
    assert not store.put(response(4, pad=3 * one), [])    # larger than the store: not kept, nothing evicted
    assert len(store) == 3 and store.size == 3 * one
    assert store.put(response(5, pad=one), [{"type": "message"}])          # evicts as many as it takes
    assert len(store) == 1 and store.size <= 3 * one
    assert store.delete("resp_5") and store.size == 0 and not store.delete("resp_5")
    with pytest.raises(ValueError):
        ResponseStore(0)


def test_a_server_without_a_store_refuses_previous_response_id(served):
    _, _, engine = served
    app = create_app(ServerConfig(served_model_name=MODEL, responses_store_bytes=0), engine)
    with InProcessServer(app) as base:
        r = httpx.post(base + "/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 1},
                       timeout=60)
        assert r.status_code == 200 and r.json()["store"] is False
        assert_openai_error(httpx.get(f"{base}/v1/responses/{r.json()['id']}", timeout=60), 404)
        err = assert_openai_error(httpx.post(base + "/v1/responses", json={
            "model": MODEL, "input": "hi", "previous_response_id": r.json()["id"]}, timeout=60), 400,
            param="previous_response_id")
        assert "--responses-store-mb" in err["message"]


@pytest.mark.parametrize(("extra", "param"), [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"background": True}, "background"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"type": "message", "role": "user", "content": [              # a model without a vision tower
        {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]}, "input[0].content[0]"),
    ({"input": [{"type": "message", "role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "computer_call_output"}]}, "input[0].type"),
    ({"tools": [{"type": "teleport"}]}, "tools[0].type"),
    ({"tools": [{"type": "web_search"}, {"type": "function", "name": "a b"}]}, "tools[1].name"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "array"}}]}, "tools[0].parameters"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]}, "input[0].arguments"),
    ({"tool_choice": {"type": "allowed_tools", "tools": []}}, "tool_choice"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    # errors of the chat path the request is translated onto name the Responses fields
    ({"tools": [{"type": "web_search"}, {"type": "function", "name": "f", "parameters": BAD_SCHEMA}],
      "tool_choice": "required"}, "tools[1].parameters"),
    ({"tools": [{"type": "file_search"}, {"type": "custom", "name": "a b"}]}, "tools[1].name"),
    ({"tools": [{"type": "custom"}]}, "tools[0].name"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": BAD_SCHEMA}}}, "text.format.schema"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "word " * (2 * CONTEXT)}, "input"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": 5}]}, "input[0].output"),
    ({"tool_choice": {"type": "function", "name": "nope"}, "tools": [WEATHER]}, "tool_choice"),
])
def test_unsupported_fields_are_400s_naming_them(served, extra, param):
    base, _, _ = served
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 1} | extra
    err = assert_openai_error(httpx.post(base + "/v1/responses", json=body, timeout=60), 400, param=param)
    assert ".function." not in err["message"] and "response_format" not in err["message"], err
