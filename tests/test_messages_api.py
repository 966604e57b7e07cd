"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) with the official `anthropic` client and
raw SSE, on the demo checkpoint (random weights: what the tests rely on comes from the protocol, the grammar
of tool_choice any / tool, and seeded sampling, never from what the model happens to say).

Text and tool use, streamed and not (the stream's final message equals the whole reply for the same seed);
thinking blocks with a signature, replayed in the next turn with a tool_result; the translation renders the
prompt the chat API renders for the same conversation; count_tokens equals the real request's input plus
cache-read tokens; a second turn reads the first from the prefix cache; max_tokens clamped to the context;
stop_sequences; `beta.messages.create`, `?beta=true`, `x-api-key` and Bearer keys; any model name with
--accept-any-model-name; Anthropic's error envelope for a bad body, a bad key, an unknown model and a full
queue (529).
"""
from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

import gem4
from gem4.demo import ensure_demo
from gem4.server import ServerConfig, create_app
from gem4.server.outputs import ChatOutput
from server_helpers import API_KEY, InProcessServer, client_for, gem4_serve

MODEL = "demo"
CHANNEL_START, CHANNEL_END = 100, 101       # <|channel>, <channel|>
THINK_BIAS = {str(CHANNEL_START): 30, str(CHANNEL_END): 8}   # a thought starts, and ends soon
WEATHER = {"name": "get_weather", "description": "Weather of a city", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 8},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city"], "additionalProperties": False}}
SEARCH = {"name": "search", "input_schema": {"type": "object", "properties": {"query": {"type": "string",
                                                                                       "maxLength": 6}},
                                             "required": ["query"]}}
SCHEMAS = {t["name"]: t["input_schema"] for t in (WEATHER, SEARCH)}
HI = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GEM4_CACHE", str(tmp_path_factory.mktemp("gem4-cache")))
        return ensure_demo()


@pytest.fixture(scope="module")
def model(demo_dir):
    return gem4.load(demo_dir, dtype="float32"), gem4.Tokenizer.from_file(demo_dir)


@pytest.fixture(scope="module")
def served(model):
    """(base URL, anthropic client) of an in-process server with an API key, prefix caching on."""
    m, tok = model
    engine = gem4.Engine(m, tok, max_model_len=1024, max_num_seqs=2)
    app = create_app(ServerConfig(served_model_name=MODEL, api_key=API_KEY, max_num_seqs=2), engine)
    with InProcessServer(app) as base:
        yield base, anthropic.Anthropic(base_url=base, api_key=API_KEY, max_retries=0, timeout=60)
    engine.shutdown()


def blocks(message) -> list[dict]:
    return [b.to_dict() for b in message.content]


def check_calls(message, names=SCHEMAS) -> list[dict]:
    """The reply's tool_use blocks, each a declared tool with arguments valid for its schema."""
    assert message.stop_reason == "tool_use", message
    calls = [b for b in blocks(message) if b["type"] == "tool_use"]
    assert calls
    for call in calls:
        assert call["name"] in names and call["id"].startswith("toolu_")
        jsonschema.validate(call["input"], SCHEMAS[call["name"]])
    return calls


# ---------------------------------------------------------------------------------------------
# Text, tools, thinking
# ---------------------------------------------------------------------------------------------


def test_text_reply_whole_and_streamed(served):
    _, client = served
    kwargs = dict(model=MODEL, max_tokens=24, messages=HI, system="Be brief.", extra_body={"seed": 7})
    whole = client.messages.create(**kwargs)
    assert whole.type == "message" and whole.role == "assistant" and whole.model == MODEL
    assert whole.id.startswith("msg_")
    assert whole.stop_reason in ("end_turn", "max_tokens") and whole.stop_sequence is None
    assert [b["type"] for b in blocks(whole)] in (["text"], [])
    u = whole.usage
    assert u.input_tokens + u.cache_read_input_tokens > 0 and u.cache_creation_input_tokens == 0
    assert 0 < u.output_tokens <= 24
    with client.messages.stream(**kwargs) as stream:
        texts = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert blocks(final) == blocks(whole) and final.stop_reason == whole.stop_reason
    assert texts == "".join(b["text"] for b in blocks(whole))
    assert final.usage.output_tokens == u.output_tokens


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_tool_use_with_thinking(served, stream):
    """tool_choice any forces declared calls; thinking enabled gives a thinking block first, with a signature;
    a named tool_choice calls that tool; disable_parallel_tool_use gives one call."""
    _, client = served
    for seed in range(3):
        kwargs = dict(model=MODEL, max_tokens=300, messages=[{"role": "user", "content": f"Weather {seed}?"}],
                      tools=[WEATHER, SEARCH], tool_choice={"type": "any"},
                      thinking={"type": "enabled", "budget_tokens": 1024},
                      extra_body={"seed": seed, "logit_bias": THINK_BIAS})
        if stream:
            with client.messages.stream(**kwargs) as s:
                reply = s.get_final_message()
        else:
            reply = client.messages.create(**kwargs)
        first = blocks(reply)[0]
        assert first["type"] == "thinking" and first["thinking"] and first["signature"], blocks(reply)
        check_calls(reply)
    named = client.messages.create(model=MODEL, max_tokens=200, messages=HI, tools=[WEATHER, SEARCH],
                                   tool_choice={"type": "tool", "name": "search", "disable_parallel_tool_use": True},
                                   extra_body={"seed": 1})
    assert len(check_calls(named, names={"search"})) == 1


def test_thinking_budget_closes_the_thought(served, model, monkeypatch):
    """thinking.budget_tokens is enforced: with a bias that keeps the thought from ending, the thought without a
    budget runs to max_tokens; with a budget of N it holds N tokens (the generated ids between <|channel> and
    <channel|>, its name included; more only while tool_choice's grammar is still spelling the name `thought`,
    which it must finish before the thought may close), closes, and the forced call follows, streamed and not."""
    _, client = served
    _, tok = model
    generated: list[int] = []
    feed = ChatOutput.feed

    def recording(self, ev):
        if ev.token_id is not None:
            generated.append(ev.token_id)
        return feed(self, ev)

    monkeypatch.setattr(ChatOutput, "feed", recording)
    long_thought = {str(CHANNEL_START): 30, str(CHANNEL_END): -100}
    kwargs = dict(model=MODEL, max_tokens=120, messages=HI, tools=[WEATHER], tool_choice={"type": "any"},
                  extra_body={"seed": 2, "logit_bias": long_thought})
    endless = client.messages.create(thinking={"type": "enabled", "budget_tokens": 1000}, **kwargs)
    assert endless.stop_reason == "max_tokens" and [b["type"] for b in blocks(endless)] == ["thinking"]
    for budget in (4, 12):
        generated.clear()
        whole = client.messages.create(thinking={"type": "enabled", "budget_tokens": budget}, **kwargs)
        n = generated.index(CHANNEL_END) - 1
        name = tok.decode(generated[1:n])              # the thought but its last token
        assert generated[0] == CHANNEL_START and CHANNEL_START not in generated[1:]
        assert n == budget or n > budget and "thought".startswith(name) and name != "thought", (budget, generated)
        with client.messages.stream(thinking={"type": "enabled", "budget_tokens": budget}, **kwargs) as s:
            final = s.get_final_message()
        assert [{k: v for k, v in b.items() if k != "id"} for b in blocks(final)] == \
            [{k: v for k, v in b.items() if k != "id"} for b in blocks(whole)]
        check_calls(whole, names={"get_weather"})
        thought = "".join(b["thinking"] for b in blocks(whole) if b["type"] == "thinking")
        assert endless.content[0].thinking.startswith(thought) and len(endless.content[0].thinking) > len(thought)


def test_tool_result_round_trip_renders_as_the_chat_api(served):
    """A tool_use reply (its thinking block and signature replayed) answered with tool_result blocks (one with
    is_error) and text: a normal reply, and the prompt is the one the chat API renders for the same turns."""
    base, client = served
    first = client.messages.create(model=MODEL, max_tokens=300, messages=HI, tools=[WEATHER],
                                   tool_choice={"type": "any"}, thinking={"type": "enabled", "budget_tokens": 500},
                                   extra_body={"seed": 3, "logit_bias": THINK_BIAS})
    calls = check_calls(first, names={"get_weather"})
    results = [{"type": "tool_result", "tool_use_id": c["id"], "content": [{"type": "text", "text": "sunny"}]}
               for c in calls]
    results[-1]["is_error"] = True
    history = HI + [{"role": "assistant", "content": blocks(first)},
                    {"role": "user", "content": results + [{"type": "text", "text": "Thanks!"}]}]
    second = client.messages.create(model=MODEL, max_tokens=16, messages=history, tools=[WEATHER],
                                    thinking={"type": "enabled", "budget_tokens": 500}, extra_body={"seed": 3})
    assert second.type == "message" and second.stop_reason in ("end_turn", "max_tokens", "tool_use")
    n_input = second.usage.input_tokens + second.usage.cache_read_input_tokens

    thought = next(b["thinking"] for b in blocks(first) if b["type"] == "thinking")
    replies = [json.dumps({"error": "sunny"}) if r.get("is_error") else "sunny" for r in results]
    chat = [{"role": "user", "content": "Hello there"},
            {"role": "assistant", "content": None, "reasoning_content": thought,
             "tool_calls": [{"id": c["id"], "type": "function",
                             "function": {"name": c["name"], "arguments": json.dumps(c["input"])}} for c in calls]},
            *[{"role": "tool", "tool_call_id": c["id"], "content": text} for c, text in zip(calls, replies)],
            {"role": "user", "content": "Thanks!"}]
    tools = [{"type": "function", "function": {"name": WEATHER["name"], "description": WEATHER["description"],
                                               "parameters": WEATHER["input_schema"]}}]
    same = client_for(base).chat.completions.create(model=MODEL, messages=chat, tools=tools, max_tokens=1,
                                                    extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert same.usage.prompt_tokens == n_input


def test_a_last_assistant_message_is_a_prefill_the_reply_continues(served, model, monkeypatch):
    """Anthropic's prefill: the prompt ends inside the assistant's turn, after its text (the closed turn's ids but
    its `<turn|>` and newline), whole and streamed, thinking on or off; count_tokens agrees; the reply holds only
    what follows. Trailing whitespace in the prefill is a 400, as Anthropic answers."""
    base, client = served
    _, tok = model
    prompts: list[list[int]] = []
    init = ChatOutput.__init__

    def recording(self, tokenizer, prompt_ids, **kwargs):
        prompts.append(list(prompt_ids))
        init(self, tokenizer, prompt_ids, **kwargs)

    monkeypatch.setattr(ChatOutput, "__init__", recording)
    turns = HI + [{"role": "assistant", "content": [{"type": "text", "text": "Well, the answer is"}]}]
    chat = [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Well, the answer is"}]
    for thinking in ({"type": "disabled"}, {"type": "enabled", "budget_tokens": 64}):
        closed = httpx.post(base + "/tokenize", json={
            "model": MODEL, "messages": chat, "add_generation_prompt": False,
            "chat_template_kwargs": {"enable_thinking": thinking["type"] == "enabled"}},
            headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60).json()["tokens"]
        assert tok.decode(closed[-2:]) == "<turn|>\n"
        prompts.clear()
        whole = client.messages.create(model=MODEL, max_tokens=6, messages=turns, thinking=thinking,
                                       extra_body={"seed": 1})
        with client.messages.stream(model=MODEL, max_tokens=6, messages=turns, thinking=thinking,
                                    extra_body={"seed": 1}) as s:
            streamed = s.get_final_message()
        assert prompts == [closed[:-2], closed[:-2]]
        assert tok.decode(prompts[0]).endswith("<|turn>model\nWell, the answer is")
        assert blocks(streamed) == blocks(whole)
        assert whole.usage.input_tokens + whole.usage.cache_read_input_tokens == len(closed) - 2
        assert client.messages.count_tokens(model=MODEL, messages=turns, thinking=thinking).input_tokens == \
            len(closed) - 2
        assert "Well, the answer is" not in "".join(b.get("text", "") for b in blocks(whole))
        # the chat API's continue_final_message (vLLM's) is the same prompt
        same = client_for(base).chat.completions.create(
            model=MODEL, messages=chat, max_tokens=1, extra_body={
                "continue_final_message": True, "add_generation_prompt": False,
                "chat_template_kwargs": {"enable_thinking": thinking["type"] == "enabled"}})
        assert same.usage.prompt_tokens == len(closed) - 2
    for bad in ({"continue_final_message": True}, {"continue_final_message": True, "add_generation_prompt": False,
                                                   "messages": HI}):
        r = httpx.post(base + "/v1/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                       json={"model": MODEL, "messages": chat, **bad}, timeout=60)
        assert r.status_code == 400 and "continue_final_message" in r.json()["error"]["message"], r.text
    r = httpx.post(base + "/v1/messages", headers={"x-api-key": API_KEY}, json={
        "model": MODEL, "max_tokens": 4, "messages": HI + [{"role": "assistant", "content": "Well "}]}, timeout=60)
    assert_envelope(r, 400, "invalid_request_error")
    assert "messages[1].content" in r.json()["error"]["message"]


@pytest.mark.parametrize(("extra", "want"), [
    ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, {"chat_template_kwargs": {"enable_thinking": True}}),
    ({"thinking": {"type": "adaptive"}}, {"chat_template_kwargs": {"enable_thinking": True}}),
    ({"thinking": {"type": "disabled"}}, {"chat_template_kwargs": {"enable_thinking": False}}),
    ({}, {"chat_template_kwargs": None}),
    ({"tools": [WEATHER], "tool_choice": {"type": "auto"}}, {"tool_choice": "auto", "parallel_tool_calls": True}),
    ({"tools": [WEATHER], "tool_choice": {"type": "none"}}, {"tool_choice": "none"}),
    ({"tools": [WEATHER], "tool_choice": {"type": "any", "disable_parallel_tool_use": True}},
     {"tool_choice": "required", "parallel_tool_calls": False}),
    ({"stop_sequences": ["END"], "top_k": 5}, {"stop": ["END"], "top_k": 5}),
])
def test_the_translation_onto_a_chat_request(extra, want):
    from gem4.server import protocol_messages as M

    req = M.MessagesRequest.model_validate({"model": MODEL, "max_tokens": 8, "messages": HI} | extra)
    chat = M.to_chat(req).model_dump()
    assert {k: chat[k] for k in want} == want
    assert M.budget_of(req) == (extra.get("thinking") or {}).get("budget_tokens")


def test_tool_choice_none_declares_no_tool(served):
    """tool_choice none: the tools are not declared to the model (the prompt is the one without them) and the
    reply is no tool_use."""
    _, client = served
    kwargs = dict(model=MODEL, messages=HI)
    bare = client.messages.count_tokens(**kwargs).input_tokens
    assert client.messages.count_tokens(tools=[WEATHER], tool_choice={"type": "none"}, **kwargs).input_tokens == bare
    reply = client.messages.create(max_tokens=16, tools=[WEATHER], tool_choice={"type": "none"},
                                   extra_body={"seed": 0}, **kwargs)
    assert reply.stop_reason != "tool_use" and all(b["type"] != "tool_use" for b in blocks(reply))


def test_output_config_format_constrains_the_answer(served):
    _, client = served
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["name", "age"], "additionalProperties": False}
    for seed in range(3):
        reply = client.messages.create(model=MODEL, max_tokens=200, messages=HI, extra_body={
            "seed": seed, "output_config": {"format": {"type": "json_schema", "schema": schema}}})
        assert reply.stop_reason == "end_turn", reply
        jsonschema.validate(json.loads(reply.content[0].text), schema)


def test_count_tokens_equals_the_real_requests_input(served):
    _, client = served
    request = dict(model=MODEL, messages=[{"role": "user", "content": [{"type": "text", "text": "Count me"}]}],
                   system=[{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}],
                   tools=[WEATHER, SEARCH])
    counted = client.messages.count_tokens(**request).input_tokens
    real = client.messages.create(max_tokens=4, extra_body={"seed": 0}, **request)
    assert counted == real.usage.input_tokens + real.usage.cache_read_input_tokens
    assert counted > client.messages.count_tokens(model=MODEL, messages=request["messages"]).input_tokens


def test_second_turn_reads_the_first_from_the_prefix_cache(served):
    _, client = served
    turn1 = [{"role": "user", "content": "A first question about caching, long enough to span blocks " * 4}]
    first = client.messages.create(model=MODEL, max_tokens=8, messages=turn1, extra_body={"seed": 5})
    n_first = first.usage.input_tokens + first.usage.cache_read_input_tokens
    turn2 = turn1 + [{"role": "assistant", "content": blocks(first) or "ok"},
                     {"role": "user", "content": "And a second one."}]
    second = client.messages.create(model=MODEL, max_tokens=8, messages=turn2, extra_body={"seed": 5})
    # all of the first prompt but the empty thought its generation prompt ends with (thinking off), which the
    # template does not render in the history: `<|channel>thought\n<channel|>`, 5 tokens
    assert second.usage.cache_read_input_tokens >= n_first - 5, (n_first, second.usage)
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens > n_first


def test_stop_sequences(served):
    _, client = served
    kwargs = dict(model=MODEL, max_tokens=24, messages=HI, extra_body={"seed": 11, "logit_bias": {"106": -100,
                                                                                               "1": -100}})
    text = client.messages.create(**kwargs).content[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip()
    reply = client.messages.create(stop_sequences=[stop], **kwargs)
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == stop
    assert text.startswith(reply.content[0].text) and stop not in reply.content[0].text


def test_max_tokens_beyond_the_context_is_clamped(model):
    m, tok = model
    engine = gem4.Engine(m, tok, max_model_len=64, max_num_seqs=1)
    with InProcessServer(create_app(ServerConfig(served_model_name=MODEL), engine)) as base:
        client = anthropic.Anthropic(base_url=base, api_key="none", max_retries=0, timeout=60)
        reply = client.messages.create(model=MODEL, max_tokens=32000, messages=HI,
                                       extra_body={"seed": 0, "logit_bias": {"106": -100, "1": -100}})
        assert reply.stop_reason == "max_tokens"
        assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens + reply.usage.output_tokens == 64
    engine.shutdown()


# ---------------------------------------------------------------------------------------------
# What Claude Code sends: ?beta=true, anthropic-beta, x-api-key, a second model name, raw SSE
# ---------------------------------------------------------------------------------------------


def test_beta_messages_and_keys(served):
    base, client = served
    reply = client.beta.messages.create(model=MODEL, max_tokens=4, messages=HI,
                                        betas=["claude-code-20250219", "interleaved-thinking-2025-05-14"])
    assert reply.type == "message"
    bearer = anthropic.Anthropic(base_url=base, auth_token=API_KEY, max_retries=0, timeout=60)
    assert bearer.messages.create(model=MODEL, max_tokens=4, messages=HI).type == "message"
    assert bearer.messages.count_tokens(model=MODEL, messages=HI).input_tokens > 0


def sse_events(base: str, body: dict, path: str = "/v1/messages?beta=true") -> list[tuple[str, dict]]:
    """(event name, data) of each frame of a streamed reply, checking that every frame has both lines."""
    headers = {"x-api-key": API_KEY, "anthropic-version": "2023-06-01",
               "anthropic-beta": "claude-code-20250219,fine-grained-tool-streaming-2025-05-14"}
    with httpx.stream("POST", base + path, json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    assert "[DONE]" not in raw
    frames = []
    for frame in raw.strip("\n").split("\n\n"):
        event, data = frame.split("\n")
        assert event.startswith("event: ") and data.startswith("data: "), frame
        frames.append((event[len("event: "):], json.loads(data[len("data: "):])))
    return frames


def check_sequence(frames: list[tuple[str, dict]]) -> list[dict]:
    """Anthropic's order: message_start, then blocks (start, deltas, stop) indexed from 0, message_delta,
    message_stop; pings anywhere. -> the content blocks, folded from the deltas."""
    frames = [(e, d) for e, d in frames if e != "ping"]
    assert all(e == d["type"] for e, d in frames)
    names = [e for e, _ in frames]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"], names
    assert frames[0][1]["message"]["content"] == [] and frames[0][1]["message"]["stop_reason"] is None
    folded: list[dict] = []
    open_ = None
    for e, d in frames[1:-2]:
        if e == "content_block_start":
            assert open_ is None and d["index"] == len(folded)
            folded.append(dict(d["content_block"], partial=""))
            open_ = d["index"]
        elif e == "content_block_delta":
            assert d["index"] == open_
            delta, block = d["delta"], folded[open_]
            kind = {"text": "text_delta", "thinking": ("thinking_delta", "signature_delta"),
                    "tool_use": "input_json_delta"}[block["type"]]
            assert delta["type"] in kind, (block, delta)
            field = {"text_delta": "text", "thinking_delta": "thinking", "signature_delta": "signature",
                     "input_json_delta": "partial"}[delta["type"]]
            block[field] += delta.get("partial_json", delta.get(field, ""))
        else:
            assert e == "content_block_stop" and d["index"] == open_, (e, d)
            open_ = None
    assert open_ is None
    return folded


def test_raw_sse_event_sequence(served):
    base, _ = served
    text = check_sequence(sse_events(base, {"model": MODEL, "max_tokens": 16, "stream": True, "messages": HI,
                                            "seed": 2}))
    assert [b["type"] for b in text] in (["text"], [])
    frames = sse_events(base, {"model": MODEL, "max_tokens": 300, "stream": True, "messages": HI, "seed": 4,
                               "logit_bias": THINK_BIAS, "tools": [WEATHER], "tool_choice": {"type": "any"},
                               "thinking": {"type": "enabled", "budget_tokens": 2000}})
    folded = check_sequence(frames)
    assert folded[0]["type"] == "thinking" and folded[0]["thinking"] and folded[0]["signature"]
    calls = [b for b in folded if b["type"] == "tool_use"]
    assert calls and all(b["input"] == {} for b in calls)
    for call in calls:
        jsonschema.validate(json.loads(call["partial"]), WEATHER["input_schema"])
    delta = frames[-2][1]
    assert delta["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    start = frames[0][1]["message"]["usage"]
    assert delta["usage"]["output_tokens"] > 0 and delta["usage"]["input_tokens"] == start["input_tokens"]


def stream_frames(base: str, body: dict, after: int, then) -> list[tuple[str, dict]]:
    """A streamed reply's frames: `after` frames are read, `then()` runs, the rest are read to the end."""
    with httpx.stream("POST", base + "/v1/messages", json=body, headers={"x-api-key": API_KEY}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = (line for line in r.iter_lines() if line)
        frames = []
        for event in lines:
            data = next(lines)
            assert event.startswith("event: ") and data.startswith("data: "), (event, data)
            frames.append((event[len("event: "):], json.loads(data[len("data: "):])))
            if len(frames) == after:
                then()
    return frames


def test_a_stream_that_fails_midway_ends_with_an_error_event(model):
    """The engine failing mid-stream (its sampler raising) and the server shutting down mid-stream: after the
    frames already sent, an `event: error` frame in Anthropic's envelope (api_error; overloaded_error, which
    clients retry, for the shutdown) ends the stream, with no message_stop; the SDK raises it."""
    m, tok = model
    engine = gem4.Engine(m, tok, max_model_len=1024, max_num_seqs=2)
    app = create_app(ServerConfig(served_model_name=MODEL, api_key=API_KEY, heartbeat_s=0.1), engine)
    body = {"model": MODEL, "max_tokens": 800, "stream": True, "messages": HI, "seed": 1,
            "logit_bias": {"106": -100, "1": -100, "50": -100}}        # no end: it would run to max_tokens
    sample = engine._runner.sampler.sample

    def failing(*args, **kwargs):
        raise RuntimeError("the sampler broke")

    def fail() -> None:
        engine._runner.sampler.sample = failing

    with InProcessServer(app) as base:
        try:
            frames = stream_frames(base, body, 4, fail)
        finally:
            engine._runner.sampler.sample = sample
        names = [e for e, _ in frames if e != "ping"]
        assert names[0] == "message_start" and "content_block_delta" in names
        assert names[-1] == "error" and "message_stop" not in names, names
        error = frames[-1][1]
        assert error["type"] == "error" and error["error"]["type"] == "api_error"
        assert "the sampler broke" in error["error"]["message"]
        # the SDK raises the error event
        client = anthropic.Anthropic(base_url=base, api_key=API_KEY, max_retries=0, timeout=60)
        engine._runner.sampler.sample = failing
        try:
            with pytest.raises(anthropic.APIStatusError, match="the sampler broke"):
                with client.messages.stream(model=MODEL, max_tokens=8, messages=HI) as s:
                    s.get_final_message()
        finally:
            engine._runner.sampler.sample = sample
        # the server shutting down
        frames = stream_frames(base, body, 4, lambda: app.state.gem4.shut_down())
        assert frames[-1] == ("error", {"type": "error", "error": {
            "type": "overloaded_error", "message": "The server is shutting down; this request was stopped."}})
        assert "message_stop" not in [e for e, _ in frames]
    engine.shutdown()


def test_claude_code_shaped_request_with_any_model_name(model):
    """What Claude Code sends (system blocks with cache_control, metadata, tools, a server tool, streaming,
    ?beta=true, max_tokens 32000, its small model's name) against --accept-any-model-name."""
    m, tok = model
    engine = gem4.Engine(m, tok, max_model_len=1024, max_num_seqs=1)
    config = ServerConfig(served_model_name=MODEL, api_key=API_KEY, accept_any_model_name=True)
    with InProcessServer(create_app(config, engine)) as base:
        body = {"model": "claude-haiku-4-5-20251001", "max_tokens": 32000, "stream": True,
                "system": [{"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
                           {"type": "text", "text": "Be helpful."}],
                "metadata": {"user_id": "user_abc"}, "tools": [WEATHER, {"type": "web_search_20250305",
                                                                         "name": "web_search"}],
                "messages": [{"role": "user", "content": [{"type": "text", "text": "hi",
                                                           "cache_control": {"type": "ephemeral"}}]}],
                "thinking": {"type": "disabled"}, "seed": 0, "logit_bias": {"106": 5}}
        frames = sse_events(base, body)
        check_sequence(frames)
        assert frames[0][1]["message"]["model"] == MODEL
        r = httpx.post(base + "/v1/messages/count_tokens?beta=true", json=body, headers={"x-api-key": API_KEY},
                       timeout=60)
        assert r.status_code == 200 and r.json()["input_tokens"] > 0
    engine.shutdown()


def test_gem4_serve_accept_any_model_name(demo_dir, tmp_path):
    """The command line: `gem4 serve DEMO --accept-any-model-name` answers Claude Code's small model's name,
    with the key in x-api-key; without the option that name is a 404 not_found_error."""
    body = {"model": "claude-haiku-4-5", "max_tokens": 4, "messages": HI}
    for accept, status in ((True, 200), (False, 404)):
        args = [str(demo_dir), "--api-key", API_KEY, "--max-model-len", "256"] + (["--accept-any-model-name"] * accept)
        with gem4_serve(args, tmp_path / "stderr.txt") as base:
            r = httpx.post(base + "/v1/messages?beta=true", json=body, headers={"x-api-key": API_KEY}, timeout=60)
            assert r.status_code == status, r.text
            assert r.json()["type"] == ("message" if accept else "error")


# ---------------------------------------------------------------------------------------------
# Errors: Anthropic's envelope
# ---------------------------------------------------------------------------------------------


def assert_envelope(r: httpx.Response, status: int, kind: str) -> None:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    assert body["error"]["type"] == kind and body["error"]["message"], body


def test_errors_use_anthropics_envelope(served):
    base, client = served
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model=MODEL, max_tokens=8, messages=[])
    assert bad.value.body["type"] == "error" and bad.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=base, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=8, messages=HI)
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-sonnet-4-5", max_tokens=8, messages=HI)
    key = {"x-api-key": API_KEY}
    assert_envelope(httpx.post(base + "/v1/messages", json={"model": MODEL, "messages": HI}, headers=key),
                    400, "invalid_request_error")     # max_tokens is required
    image = [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                       "data": "AAAA"}}]}]
    r = httpx.post(base + "/v1/messages", json={"model": MODEL, "max_tokens": 8, "messages": image}, headers=key)
    assert_envelope(r, 400, "invalid_request_error")                  # a model without a vision tower
    assert "messages[0].content[0]" in r.json()["error"]["message"], r.json()
    assert "does not take images" in r.json()["error"]["message"], r.json()
    bad_system = {"model": MODEL, "max_tokens": 8, "messages": HI, "system": [{"type": "text", "text": "a"},
                                                                            {"type": "image"}]}
    r = httpx.post(base + "/v1/messages", json=bad_system, headers=key)
    assert_envelope(r, 400, "invalid_request_error")
    assert "system[1]" in r.json()["error"]["message"]
    assert_envelope(httpx.post(base + "/v1/messages/count_tokens", json={"messages": HI}), 401,
                    "authentication_error")
    assert_envelope(httpx.post(base + "/v1/messages", content=b"{not json", headers=key), 400,
                    "invalid_request_error")
    # the chat API keeps OpenAI's error objects
    r = httpx.post(base + "/v1/chat/completions", json={"messages": []}, headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 400 and "type" not in r.json()


BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": "string", "not": {}}}}   # 'not': no grammar


@pytest.mark.parametrize(("extra", "field"), [
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}, {"name": "f", "input_schema": BAD_SCHEMA}],
      "tool_choice": {"type": "any"}}, "tools[1].input_schema.properties.a"),
    ({"tools": [{"type": "bash_20250124", "name": "bash"}, {"name": "a b"}]}, "'tools[1].name'"),
    ({"output_config": {"format": {"type": "json_schema", "schema": BAD_SCHEMA}}}, "output_config.format.schema"),
    ({"tool_choice": {"type": "any"}}, "tool_choice of type 'any' needs 'tools'"),
    ({"stop_sequences": ["x"] * 100}, "'stop_sequences'"),
    ({"max_tokens": 0}, "'max_tokens'"),
    ({"thinking": {"type": "enabled", "budget_tokens": 0}}, "'thinking.budget_tokens'"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c", "content": 5}]}]},
     "messages[0].content[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": "word " * 3000}]}, "the length of the messages"),
    ({"system": [{"type": "text", "text": "a"}, {"type": "image"}]}, "system[1]"),
])
def test_errors_name_the_messages_fields(served, extra, field):
    """Bad input -> a 400 in Anthropic's envelope whose message names the field the client sent, also where the
    error comes from the chat path the request is translated onto (never tools[i].function..., response_format,
    stop)."""
    base, _ = served
    body = {"model": MODEL, "max_tokens": 4, "messages": HI} | extra
    r = httpx.post(base + "/v1/messages", json=body, headers={"x-api-key": API_KEY}, timeout=60)
    assert_envelope(r, 400, "invalid_request_error")
    message = r.json()["error"]["message"]
    assert field in message, message
    assert ".function." not in message and "response_format" not in message and "'stop'" not in message


def test_queue_full_is_529_overloaded(model):
    m, tok = model
    engine = gem4.Engine(m, tok, max_model_len=256, max_num_seqs=1)
    # no room at all: every request finds the queue full
    with InProcessServer(create_app(ServerConfig(served_model_name=MODEL, max_num_seqs=0, max_waiting=0),
                                    engine)) as base:
        r = httpx.post(base + "/v1/messages", json={"model": MODEL, "max_tokens": 8, "messages": HI}, timeout=60)
        assert_envelope(r, 529, "overloaded_error")
        assert r.headers["retry-after"] == "1"
        with pytest.raises(anthropic.InternalServerError) as e:
            anthropic.Anthropic(base_url=base, api_key="none", max_retries=0).messages.create(
                model=MODEL, max_tokens=8, messages=HI)
        assert e.value.status_code == 529
    engine.shutdown()
