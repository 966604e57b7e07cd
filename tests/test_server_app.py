"""The OpenAI-compatible server in-process, tested with the official `openai` client on 127.0.0.1 only.

The app runs in-process (uvicorn in a thread) over `ScriptedEngine`, a test stand-in for
`gem4.Engine` that replays a fixed token-id script per request: reasoning, tool calls, slow
prefill, a failing engine, a held queue. The scripted ids are real Gemma 4 token ids, so the
server's real parser turns them into reasoning / content / tool calls. Also here: what the app does
before admission (body limits) and the connection guards of `gem4 serve`, on raw sockets.
"""
from __future__ import annotations

import json
import queue
import re
import socket
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from server_helpers import (
    API_KEY,
    InProcessServer,
    accumulate,
    assert_openai_error,
    client_for,
    metric,
    raw_exchange,
    raw_response,
    request_head,
    sse_data,
    sse_lines,
    user,
    wait_for,
)
from text_fixtures import tiny_tokenizer

import gem4
from gem4.chat import encode_prompt
from gem4.engine import EngineError, GenerationEvent
from gem4.parser import parse
from gem4.sampling import SamplingParams
from gem4.server import ServerConfig, create_app
from gem4.server.http11 import guarded_protocol
from gem4.server.metrics import Metrics


# ---------------------------------------------------------------------------------------------
# The scripted engine (test stand-in for gem4.Engine)
# ---------------------------------------------------------------------------------------------


def ids_of(text: str) -> list[int]:
    return tiny_tokenizer().encode(text, add_bos=False, parse_special=True)


Q = '<|"|>'
SCRIPTS = {
    # keyword in the prompt -> model output
    "PLAIN": "Hello, world! 2+2=4.<turn|>",
    "THINK": "<|channel>thought\nadd two and two<channel|>It is 4.<turn|>",
    "WEATHER": (f"Let me check.<|tool_call>call:get_weather{{city:{Q}Paris{Q},days:3,units:{{temp:{Q}C{Q}}}}}"
                f"<tool_call|><|tool_call>call:get_time{{zone:{Q}CET{Q}}}<tool_call|><|tool_response>"),
    "ROGUE": f"<|tool_call>call:launch{{target:{Q}moon{Q}}}<tool_call|><|tool_response>",
    "LONG": "abc " * 3000,
    "FAIL": "one two three four five six<turn|>",
    "SLOW": "Finally.<turn|>",
    "HOLD": "Released.<turn|>",
    "NEGINF": "Nothing left.<turn|>",   # logprobs of -inf and NaN, as an engine may report them
    "AGAIN": "Here it is.<|turn>user\nAnd the next question, and the next<turn|>",   # runs on into a new turn
}


class FakeStream:
    """The part of gem4.engine.Stream the server uses: get() blocks; raises EngineError on failure."""

    def __init__(self):
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self.finished = False

    def get(self, timeout: float | None = None) -> GenerationEvent:
        item = self._q.get(timeout=timeout)
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item


class ScriptedEngine:
    """Each request replays SCRIPTS[keyword] (the first keyword found in the decoded prompt), one
    token per step of `step_s` seconds, with gem4.Engine's end-token / max_tokens / abort rules.
    Records prompts, params, and how many tokens each request produced after abort() was called."""

    def __init__(self, step_s: float = 0.002, slow_s: float = 0.5, fail_after: int = 3):
        self.tokenizer = tiny_tokenizer()
        self.vocab_size = self.tokenizer.vocab_size
        self.max_model_len = 4096
        self.detokenized: dict[str, bool] = {}
        self.end_ids = self.tokenizer.special.end_of_generation
        self.step_s, self.slow_s, self.fail_after = step_s, slow_s, fail_after
        self.gate = threading.Event()
        self.prompts: dict[str, list[int]] = {}
        self.params: dict[str, SamplingParams] = {}
        self.aborted: dict[str, threading.Event] = {}
        self.after_abort: dict[str, int] = {}
        self.done: dict[str, str] = {}          # request id -> finish reason

    def script(self, prompt_ids: list[int]) -> tuple[str, list[int]]:
        text = self.tokenizer.decode(prompt_ids)
        found = [(text.rfind(k), k) for k in SCRIPTS if k in text]
        key = max(found)[1] if found else "PLAIN"
        return key, ids_of(SCRIPTS[key])

    def submit(self, prompt, params: SamplingParams, *, request_id: str, n: int = 1, detokenize: bool = True) -> FakeStream:
        assert n == 1, "the scripted engine serves one choice (n > 1 is tested on the real engine)"
        prompt = list(prompt)
        if params.max_tokens is not None and len(prompt) + params.max_tokens > self.max_model_len:
            raise ValueError("too long")
        stream = FakeStream()
        self.prompts[request_id], self.params[request_id] = prompt, params
        self.detokenized[request_id] = detokenize
        self.aborted[request_id] = threading.Event()
        threading.Thread(target=self._run, args=(request_id, prompt, params, stream), daemon=True).start()
        return stream

    def abort(self, request_id: str) -> bool:
        if request_id in self.done:
            return False
        self.after_abort.setdefault(request_id, 0)
        self.aborted[request_id].set()
        return True

    def _run(self, rid: str, prompt: list[int], params: SamplingParams, stream: FakeStream) -> None:
        key, script = self.script(prompt)
        detok = self.tokenizer.detokenizer(skip_special=True)
        aborted = self.aborted[rid]
        limit = params.max_tokens or self.max_model_len - len(prompt)
        n = 0

        lp, lp_other = (float("-inf"), float("nan")) if key == "NEGINF" else (-0.5, -3.0)

        def event(tid, text, finish):
            return GenerationEvent(
                request_id=rid, token_id=tid, text=text, finish_reason=finish, stop_reason=None,
                prompt_tokens=len(prompt), completion_tokens=n,
                logprob=lp if params.logprobs and tid is not None else None,
                top_logprobs=([(tid, lp), (0, lp_other)][:params.top_logprobs]
                              if params.logprobs and tid is not None else None))

        if key == "HOLD":
            while not self.gate.wait(0.01):
                if aborted.is_set():
                    break
        delay = self.slow_s if key == "SLOW" else self.step_s
        for tid in script:
            if aborted.wait(delay):
                self.done[rid] = "abort"
                stream._q.put(event(None, detok.flush(), "abort"))
                return
            delay = self.step_s
            n += 1
            if key == "FAIL" and n > self.fail_after:
                self.done[rid] = "error"
                stream._q.put(EngineError(f"{rid}: generation failed: scripted failure"))
                return
            if rid in self.after_abort:
                self.after_abort[rid] += 1
            if tid in self.end_ids and not params.ignore_eos:
                self.done[rid] = "stop"
                stream._q.put(event(tid, detok.flush(), "stop"))
                return
            text = detok.feed(tid)
            if n >= limit:
                self.done[rid] = "length"
                stream._q.put(event(tid, text + detok.flush(), "length"))
                return
            stream._q.put(event(tid, text, None))
        self.done[rid] = "stop"
        stream._q.put(event(None, detok.flush(), "stop"))


WEATHER_TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather forecast for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                        "units": {"type": "object"}},
                       "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "Local time",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}},
]
WEATHER_ARGS = [("get_weather", {"city": "Paris", "days": 3, "units": {"temp": "C"}}), ("get_time", {"zone": "CET"})]


def expected(key: str):
    """What the parser makes of a script (texts come from the tiny vocabulary's decoding)."""
    return parse(tiny_tokenizer(), ids_of(SCRIPTS[key]), tool_names={"get_weather", "get_time"})


@pytest.fixture(scope="module")
def fake():
    """(engine, base url, app) of the in-process server over the scripted engine."""
    engine = ScriptedEngine()
    config = ServerConfig(served_model_name="scripted", api_key=API_KEY, max_num_seqs=2, max_waiting=2,
                          heartbeat_s=0.1)
    app = create_app(config, engine)
    with InProcessServer(app) as base:
        yield engine, base, app


# ---------------------------------------------------------------------------------------------
# Scripted engine: the chat protocol
# ---------------------------------------------------------------------------------------------


def test_chat_non_stream_plain(fake):
    engine, base, _ = fake
    r = client_for(base).chat.completions.create(model="scripted", messages=user("PLAIN"))
    (choice,) = r.choices
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == "scripted"
    assert choice.message.role == "assistant"
    assert choice.message.content == expected("PLAIN").content
    assert choice.message.tool_calls is None
    assert "reasoning_content" not in (choice.message.model_extra or {})
    assert choice.finish_reason == "stop"
    n_prompt = len(engine.prompts[r.id])
    assert r.usage.prompt_tokens == n_prompt
    assert r.usage.completion_tokens == len(ids_of(SCRIPTS["PLAIN"]))   # the end token counts
    assert r.usage.total_tokens == n_prompt + r.usage.completion_tokens


def test_thinking_goes_to_reasoning_content(fake):
    engine, base, _ = fake
    client = client_for(base)
    want = expected("THINK")
    assert want.reasoning_content and want.content
    r = client.chat.completions.create(model="scripted", messages=user("THINK"),
                                       extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    msg = r.choices[0].message
    assert msg.content == want.content
    assert msg.model_extra["reasoning_content"] == want.reasoning_content
    assert msg.model_extra["reasoning"] == want.reasoning_content
    assert "thought" not in msg.content and "<|channel>" not in msg.content
    # the template got enable_thinking: the prompt carries <|think|>
    assert "<|think|>" in engine.tokenizer.decode(engine.prompts[r.id])

    chunks = list(client.chat.completions.create(model="scripted", messages=user("THINK"), stream=True))
    got = accumulate(chunks)
    assert got["reasoning_content"] == want.reasoning_content and got["content"] == want.content
    # every reasoning delta carries both names
    for ch in chunks:
        extra = ch.choices[0].delta.model_extra or {} if ch.choices else {}
        assert ("reasoning_content" in extra) == ("reasoning" in extra)


def test_tool_calls_non_stream(fake):
    engine, base, _ = fake
    r = client_for(base).chat.completions.create(model="scripted", messages=user("WEATHER"), tools=WEATHER_TOOLS)
    (choice,) = r.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == expected("WEATHER").content
    calls = choice.message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == WEATHER_ARGS
    assert all(c.type == "function" and c.id for c in calls) and len({c.id for c in calls}) == 2
    # the tools were declared to the template
    prompt = engine.tokenizer.decode(engine.prompts[r.id])
    assert prompt.count("<|tool>") == 2 and "get_weather" in prompt


def test_tool_call_stream_deltas_and_sdk_stream_helper(fake):
    _, base, _ = fake
    client = client_for(base)
    # raw chunks: per call, one delta with index/id/type/name, then argument fragments only
    chunks = list(client.chat.completions.create(model="scripted", messages=user("WEATHER"), tools=WEATHER_TOOLS,
                                                 stream=True))
    deltas = [tc for ch in chunks for tc in (ch.choices[0].delta.tool_calls or [])]
    for index in (0, 1):
        mine = [tc for tc in deltas if tc.index == index]
        first, rest = mine[0], mine[1:]
        assert first.id and first.type == "function" and first.function.name == WEATHER_ARGS[index][0]
        assert first.function.arguments == ""
        assert len(rest) >= 2, "arguments arrive in several fragments"
        assert all(tc.id is None and tc.type is None and tc.function.name is None for tc in rest)
    got = accumulate(chunks)
    assert got["finish_reason"] == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in got["tool_calls"]] == WEATHER_ARGS

    # the SDK's own stream helper accumulates the same calls
    with client.chat.completions.stream(model="scripted", messages=user("WEATHER"), tools=WEATHER_TOOLS) as s:
        done_events = [e for e in s if e.type == "tool_calls.function.arguments.done"]
        final = s.get_final_completion()
    assert [(e.name, json.loads(e.arguments)) for e in done_events] == WEATHER_ARGS
    msg = final.choices[0].message
    assert final.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == WEATHER_ARGS


def test_stream_and_non_stream_give_the_same_message(fake):
    _, base, _ = fake
    client = client_for(base)
    for key, kwargs in (("WEATHER", {"tools": WEATHER_TOOLS}), ("THINK", {}), ("PLAIN", {"max_tokens": 5})):
        r = client.chat.completions.create(model="scripted", messages=user(key), seed=3, **kwargs)
        s = accumulate(client.chat.completions.create(model="scripted", messages=user(key), seed=3, stream=True,
                                                      **kwargs))
        m = r.choices[0].message
        assert s["content"] == (m.content or "")
        assert s["reasoning_content"] == (m.model_extra or {}).get("reasoning_content", "")
        assert [(c["name"], c["arguments"]) for c in s["tool_calls"]] == \
            [(c.function.name, c.function.arguments) for c in m.tool_calls or []]
        assert s["finish_reason"] == r.choices[0].finish_reason


def test_parallel_tool_calls_false_returns_the_first_call_and_stops(fake):
    engine, base, _ = fake
    client = client_for(base)
    r = client.chat.completions.create(model="scripted", messages=user("WEATHER"), tools=WEATHER_TOOLS,
                                       parallel_tool_calls=False)
    calls = r.choices[0].message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == WEATHER_ARGS[:1]
    assert r.choices[0].finish_reason == "tool_calls"
    wait_for(lambda: engine.done.get(r.id) == "abort")     # the engine request was stopped there
    s = accumulate(client.chat.completions.create(model="scripted", messages=user("WEATHER"), tools=WEATHER_TOOLS,
                                                  parallel_tool_calls=False, stream=True))
    assert [c["name"] for c in s["tool_calls"]] == ["get_weather"] and s["finish_reason"] == "tool_calls"


def test_tool_choice_none_and_undeclared_tools_never_make_tool_calls(fake):
    engine, base, _ = fake
    client = client_for(base)
    r = client.chat.completions.create(model="scripted", messages=user("WEATHER"), tools=WEATHER_TOOLS,
                                       tool_choice="none")
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "stop"
    assert "<|tool>" not in engine.tokenizer.decode(engine.prompts[r.id])   # tools not offered
    assert "get_weather" in r.choices[0].message.content                       # the text stays visible
    # the model calls a function nobody declared: content, not a tool call
    r = client.chat.completions.create(model="scripted", messages=user("ROGUE"), tools=WEATHER_TOOLS)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "stop"
    assert "launch" in r.choices[0].message.content


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_choice_is_refused_not_faked(fake, choice):
    _, base, _ = fake
    with pytest.raises(openai.BadRequestError) as e:
        client_for(base).chat.completions.create(model="scripted", messages=user("PLAIN"), tools=WEATHER_TOOLS,
                                                 tool_choice=choice)
    assert e.value.status_code == 400 and e.value.body["param"] == "tool_choice"
    assert "constrained decoding" in e.value.body["message"]


def test_messages_of_every_shape_reach_the_template(fake):
    engine, base, _ = fake
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [
        {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "Weather"}, {"type": "text", "text": "in Paris?"}]},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
        {"role": "assistant", "content": "It is 21."},
        {"role": "user", "content": "PLAIN", "name": "bob"},
    ]
    r = client_for(base).chat.completions.create(model="scripted", messages=messages, tools=WEATHER_TOOLS,
                                                 extra_body={"some_unknown_field": {"x": 1}})
    assert r.choices[0].message.content == expected("PLAIN").content
    tok = engine.tokenizer
    # what the server renders: the developer's text parts joined into a string, the rest as given
    want = encode_prompt(tok, [{"role": "developer", "content": "Be brief."}, *messages[1:]], WEATHER_TOOLS)
    assert engine.prompts[r.id] == want
    assert "<|tool_response>" in tok.decode(want) and "call:get_weather" in tok.decode(want)


def test_sampling_parameters_are_mapped(fake):
    engine, base, _ = fake
    client = client_for(base)
    r = client.chat.completions.create(
        model="scripted", messages=user("PLAIN"), max_tokens=50, max_completion_tokens=7, temperature=0.5,
        top_p=0.9, seed=42, stop=["zzz"], presence_penalty=0.5, frequency_penalty=-0.5, logit_bias={"17": 5},
        logprobs=True, top_logprobs=2,
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "stop_token_ids": [3], "ignore_eos": True})
    p = engine.params[r.id]
    assert (p.max_tokens, p.temperature, p.top_p, p.seed, p.top_k, p.min_p) == (7, 0.5, 0.9, 42, 20, 0.05)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.5, 1.1)
    assert p.logit_bias == ((17, 5.0),) and p.stop_token_ids == (3,) and p.ignore_eos
    assert p.logprobs and p.top_logprobs == 2
    assert p.stop == ()              # chat stop strings are applied by the server, to the content
    # ignore_eos: the end token does not stop; max_completion_tokens does
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 7
    lp = r.choices[0].logprobs.content
    assert len(lp) == 7 and all(t.logprob == -0.5 and len(t.top_logprobs) == 2 for t in lp)
    assert lp[0].bytes == list(engine.tokenizer.piece_bytes(ids_of(SCRIPTS["PLAIN"])[0]))
    # defaults: OpenAI's (temperature 1, top_p 1), no limit but the context
    r = client.chat.completions.create(model="scripted", messages=user("PLAIN"))
    p = engine.params[r.id]
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens, p.seed) == (1.0, 1.0, 0, 0.0, None, None)


def test_logprobs_of_minus_inf_are_written_as_vllm_does(fake):
    # JSON has no inf or NaN: non-streamed this was a 500, streamed "logprob": null
    engine, base, _ = fake
    headers = {"Authorization": f"Bearer {API_KEY}"}
    chat = {"model": "scripted", "messages": user("NEGINF"), "logprobs": True, "top_logprobs": 2}
    r = httpx.post(base + "/v1/chat/completions", json=chat, headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert content and all(t["logprob"] == -9999.0 for t in content)
    assert all([x["logprob"] for x in t["top_logprobs"]] == [-9999.0, -9999.0] for t in content)
    streamed = [c for c in sse_data(sse_lines(base, "/v1/chat/completions", {**chat, "stream": True}))
                if c != "[DONE]" and c["choices"] and c["choices"][0].get("logprobs")]
    values = [t["logprob"] for c in streamed for t in c["choices"][0]["logprobs"]["content"]]
    assert values and set(values) == {-9999.0}
    completion = {"model": "scripted", "prompt": "NEGINF", "logprobs": 2, "max_tokens": 3}
    for body in (completion, {**completion, "stream": True}):
        if body.get("stream"):
            chunks = [c for c in sse_data(sse_lines(base, "/v1/completions", body)) if c != "[DONE]"]
        else:
            r = httpx.post(base + "/v1/completions", json=body, headers=headers, timeout=30)
            assert r.status_code == 200, r.text
            chunks = [r.json()]
        lps = [c["choices"][0]["logprobs"] for c in chunks if c["choices"] and c["choices"][0]["logprobs"]]
        assert [v for lp in lps for v in lp["token_logprobs"]] == [-9999.0] * 3
        assert all(set(top.values()) == {-9999.0} for lp in lps for top in lp["top_logprobs"])


def test_stop_strings_cut_the_content(fake):
    _, base, _ = fake
    client = client_for(base)
    full = expected("PLAIN").content
    cut = full.index("2+2")
    r = client.chat.completions.create(model="scripted", messages=user("PLAIN"), stop="2+2")
    assert r.choices[0].message.content == full[:cut] and r.choices[0].finish_reason == "stop"
    s = accumulate(client.chat.completions.create(model="scripted", messages=user("PLAIN"), stop=["2+2", "zz"],
                                                  stream=True))
    assert s["content"] == full[:cut] and s["finish_reason"] == "stop"


def test_a_chat_reply_ended_by_a_stop_string_is_logged_as_stop(fake, caplog):
    """The server ends the reply at the stop string and aborts the engine request; the request's log line
    (written when the engine's "abort" arrives) and the finish metric say "stop", as the client saw."""
    _, base, _ = fake
    before = metric(base, "gem4:request_success_total", finished_reason="stop")
    with caplog.at_level("INFO", logger="gem4.server"):
        for stream in (False, True):
            r = client_for(base).chat.completions.create(model="scripted", messages=user("PLAIN"), stop="2+2",
                                                         stream=stream)
            rid = [chunk.id for chunk in r][0] if stream else r.id
            wait_for(lambda: any(rid in rec.getMessage() for rec in caplog.records))
            [line] = [rec.getMessage() for rec in caplog.records if rid in rec.getMessage()]
            assert line.endswith("finish stop"), line
    assert metric(base, "gem4:request_success_total", finished_reason="stop") == before + 2


def test_the_reply_ends_where_the_parser_ends_it(fake):
    """A reply that runs on into another turn (`<|turn>`, an end of output the engine does not stop at) ends
    there, as at a stop string: the engine request is stopped, not run on unread. With ignore_eos the engine
    goes on past every end id, and so does the reply: the text after them is sent (a stream that sent nothing
    while the engine ran on to max_tokens was issue 34's non-reading client that was not cut)."""
    engine, base, _ = fake
    client = client_for(base)
    ids, first = ids_of(SCRIPTS["AGAIN"]), expected("AGAIN").content         # "Here it is."
    r = client.chat.completions.create(model="scripted", messages=user("AGAIN"), logprobs=True)
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (first, "stop")
    assert len(r.choices[0].logprobs.content) == r.usage.completion_tokens == ids.index(ids_of("<|turn>")[0]) + 1
    chunks = list(client.chat.completions.create(model="scripted", messages=user("AGAIN"), stream=True))
    s = accumulate(chunks)
    assert (s["content"], s["finish_reason"]) == (first, "stop"), s
    for rid in (r.id, chunks[0].id):
        wait_for(lambda: engine.done.get(rid) == "abort")          # stopped there, not run on to the end
    whole = parse(tiny_tokenizer(), ids, ignore_eos=True).content
    assert whole.startswith(first) and "question" in whole[len(first):]
    for stream in (False, True):
        r = client.chat.completions.create(model="scripted", messages=user("AGAIN"), stream=stream,
                                           extra_body={"ignore_eos": True})
        s = accumulate(r) if stream else {"content": r.choices[0].message.content,
                                          "finish_reason": r.choices[0].finish_reason}
        assert (s["content"], s["finish_reason"]) == (whole, "stop"), s     # the script's end: the engine's stop


def test_stop_limits_are_400_naming_stop_before_any_work(fake):
    """60,000 stop strings (the attack of issue 34) are refused with 400 naming `stop` in about the time it
    takes to read the body: compared with a body of the same size refused for another field; so are one string
    too many, one too long, and too many stop_token_ids; the most the limits allow is served, on both
    endpoints."""
    from gem4.sampling import MAX_STOP_TOKEN_IDS
    from gem4.stops import MAX_STOP_CHARS, MAX_STOP_STRINGS

    engine, base, _ = fake
    headers = {"Authorization": f"Bearer {API_KEY}"}
    many = [f"s{i}" for i in range(60_000)]
    bodies = {"/v1/completions": {"model": "scripted", "prompt": "PLAIN"},
              "/v1/chat/completions": {"model": "scripted", "messages": user("PLAIN")}}
    n_requests = len(engine.prompts)
    for path, body in bodies.items():
        took, baseline = [], []
        for _ in range(3):                   # interleaved; medians
            t0 = time.perf_counter()
            assert_openai_error(httpx.post(base + path, json={**body, "stop": many}, headers=headers, timeout=60),
                                400, param="stop")
            took.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            assert_openai_error(httpx.post(base + path, json={**body, "user": many},
                                           headers=headers, timeout=60), 400, param="user")
            baseline.append(time.perf_counter() - t0)
        assert sorted(took)[1] < 2 * sorted(baseline)[1] + 0.25, (took, baseline)
        for bad, param in (({"stop": ["x"] * (MAX_STOP_STRINGS + 1)}, "stop"),
                           ({"stop": "x" * (MAX_STOP_CHARS + 1)}, "stop"),
                           ({"stop_token_ids": list(range(MAX_STOP_TOKEN_IDS + 1))}, "stop_token_ids")):
            err = assert_openai_error(httpx.post(base + path, json={**body, **bad}, headers=headers, timeout=60),
                                      400, param=param)
            assert "at most" in err["message"], err
    assert len(engine.prompts) == n_requests                    # none of them reached the engine
    most = [f"{i:02d}" + "z" * (MAX_STOP_CHARS - 2) for i in range(MAX_STOP_STRINGS)]
    for path, body in bodies.items():
        r = httpx.post(base + path, json={**body, "stop": most, "stop_token_ids": list(range(MAX_STOP_TOKEN_IDS))},
                       headers=headers, timeout=60)
        assert r.status_code == 200, r.text


def test_completions_default_to_16_tokens(fake):
    """/v1/completions without max_tokens generates 16 tokens, OpenAI's and vLLM's default for it (chat's
    default is the rest of the context); an explicit null means the rest of the context, as in vLLM."""
    engine, base, _ = fake
    r = client_for(base).completions.create(model="scripted", prompt="LONG")
    assert engine.params[r.id].max_tokens == 16
    assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (16, "length")
    r = httpx.post(base + "/v1/completions", json={"model": "scripted", "prompt": "PLAIN", "max_tokens": None},
                   headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    assert engine.params[r.json()["id"]].max_tokens is None


def test_include_usage_chunk(fake):
    _, base, _ = fake
    lines = sse_lines(base, "/v1/chat/completions", {"model": "scripted", "messages": user("PLAIN"), "stream": True,
                                                     "stream_options": {"include_usage": True}})
    data = sse_data(lines)
    assert data[-1] == "[DONE]"
    *chunks, usage_chunk = data[:-1]
    assert all(c["usage"] is None for c in chunks) and usage_chunk["choices"] == []
    n = len(ids_of(SCRIPTS["PLAIN"]))
    assert usage_chunk["usage"]["completion_tokens"] == n
    assert usage_chunk["usage"]["total_tokens"] == usage_chunk["usage"]["prompt_tokens"] + n
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    # without include_usage: no usage key at all
    data = sse_data(sse_lines(base, "/v1/chat/completions",
                              {"model": "scripted", "messages": user("PLAIN"), "stream": True}))
    assert all("usage" not in c for c in data[:-1])


def test_heartbeats_during_a_long_prefill(fake):
    _, base, _ = fake
    lines = sse_lines(base, "/v1/chat/completions", {"model": "scripted", "messages": user("SLOW"), "stream": True})
    first_content = next(i for i, line in enumerate(lines) if '"content":"F' in line or "Finally" in line)
    pings = [i for i, line in enumerate(lines) if line == ": ping"]
    assert len(pings) >= 2 and pings[0] < first_content        # 0.5 s prefill, 0.1 s heartbeat
    # the SDK ignores the comments
    r = client_for(base).chat.completions.create(model="scripted", messages=user("SLOW"), stream=True)
    assert accumulate(list(r))["content"] == expected("SLOW").content


def test_engine_failure_mid_stream_is_an_error_event(fake):
    _, base, _ = fake
    data = sse_data(sse_lines(base, "/v1/chat/completions",
                              {"model": "scripted", "messages": user("FAIL"), "stream": True}))
    assert data[-1] == "[DONE]"
    err = data[-2]["error"]
    assert err["type"] == "server_error" and "scripted failure" in err["message"]
    assert any(c.get("choices") and c["choices"][0]["delta"].get("content") for c in data[:-2])
    with pytest.raises(openai.APIError, match="scripted failure"):
        list(client_for(base).chat.completions.create(model="scripted", messages=user("FAIL"), stream=True))
    # non-streaming: a 500 with an error object; the server stays healthy
    r = httpx.post(base + "/v1/chat/completions", json={"model": "scripted", "messages": user("FAIL")},
                   headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)
    assert_openai_error(r, 500, code="engine_error")
    assert httpx.get(base + "/health").status_code == 200


def test_client_disconnect_aborts_within_one_step(fake):
    engine, base, app = fake
    client = client_for(base)
    for stream in (True, False):
        before = set(engine.prompts)
        body = {"model": "scripted", "messages": user("LONG"), "stream": stream}
        with httpx.Client(timeout=30) as http:
            if stream:
                with http.stream("POST", base + "/v1/chat/completions", json=body,
                                 headers={"Authorization": f"Bearer {API_KEY}"}) as r:
                    lines = r.iter_lines()
                    got = [next(lines) for _ in range(6)]
                    assert any('"content"' in line for line in got)
            else:
                with pytest.raises(httpx.ReadTimeout):
                    http.post(base + "/v1/chat/completions", json=body, timeout=0.3,
                              headers={"Authorization": f"Bearer {API_KEY}"})
        (rid,) = set(engine.prompts) - before
        wait_for(lambda rid=rid: engine.done.get(rid) == "abort")
        assert engine.after_abort[rid] <= 1, engine.after_abort[rid]
        assert len(ids_of(SCRIPTS["LONG"])) > 1000            # it was far from done
        wait_for(lambda: app.state.gem4.metrics.in_flight == 0)
        # the next request is served
        r = client.chat.completions.create(model="scripted", messages=user("PLAIN"))
        assert r.choices[0].message.content == expected("PLAIN").content


def test_shutdown_ends_a_stream_and_stops_its_engine_request_at_once():
    """What SIGTERM does to an open stream (state.shut_down): an error event and [DONE] for the client, and the
    engine request aborted then, not only when the engine itself shuts down after the server."""
    engine = ScriptedEngine()
    app = create_app(ServerConfig(served_model_name="scripted", api_key=API_KEY, heartbeat_s=0.1), engine)
    with InProcessServer(app) as base, httpx.Client(timeout=30) as http:
        with http.stream("POST", base + "/v1/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                         json={"model": "scripted", "messages": user("LONG"), "stream": True}) as r:
            lines = r.iter_lines()
            assert any('"content"' in next(lines) for _ in range(6))
            (rid,) = engine.prompts
            assert app.state.gem4.shut_down() == 1
            wait_for(lambda: engine.done.get(rid) == "abort")
            rest = [line for line in lines if line]
        assert json.loads(rest[-2].removeprefix("data: ")).get("error", {}).get("code") == "server_shutting_down", rest[-4:]
        assert rest[-1] == "data: [DONE]"
        assert engine.after_abort[rid] <= 1


def test_queue_full_is_503_with_retry_after(fake):
    engine, base, app = fake
    metrics = app.state.gem4.metrics
    engine.gate.clear()
    results: list = []

    def hold():
        r = client_for(base).chat.completions.create(model="scripted", messages=user("HOLD"), stream=True)
        results.append(accumulate(list(r))["content"])

    threads = [threading.Thread(target=hold) for _ in range(4)]     # 2 running + 2 waiting = the limit
    for t in threads:
        t.start()
    try:
        wait_for(lambda: metrics.in_flight == 4)
        r = httpx.post(base + "/v1/chat/completions", json={"model": "scripted", "messages": user("PLAIN")},
                       headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10)
        assert_openai_error(r, 503, code="server_busy")
        assert r.headers["retry-after"] == "1"
        assert metric(base, "gem4:num_requests_running") == 2 and metric(base, "gem4:num_requests_waiting") == 2
        assert metric(base, "gem4:request_rejected_total") >= 1
    finally:
        engine.gate.set()
        for t in threads:
            t.join(30)
    assert results == [expected("HOLD").content] * 4


def test_default_chat_template_kwargs_and_overrides():
    engine = ScriptedEngine()
    app = create_app(ServerConfig(served_model_name="m", default_chat_template_kwargs={"enable_thinking": True}),
                     engine)
    with InProcessServer(app) as base:
        client = client_for(base, key="unused")
        on = client.chat.completions.create(model="m", messages=user("PLAIN"))
        off = client.chat.completions.create(model="m", messages=user("PLAIN"),
                                             extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        assert "<|think|>" in engine.tokenizer.decode(engine.prompts[on.id])
        assert "<|think|>" not in engine.tokenizer.decode(engine.prompts[off.id])
        for bad in ({"enable_thinking": "yes"}, {"messages": []}, {"tools": None}):
            r = httpx.post(base + "/v1/chat/completions",
                           json={"model": "m", "messages": user("PLAIN"), "chat_template_kwargs": bad})
            assert_openai_error(r, 400, param="chat_template_kwargs")


def test_health_is_503_until_the_engine_is_ready():
    app = create_app(ServerConfig(served_model_name="later"))
    with InProcessServer(app) as base:
        r = httpx.get(base + "/health")
        assert_openai_error(r, 503, code="model_loading")
        assert r.headers["retry-after"] == "1"
        r = httpx.post(base + "/v1/chat/completions", json={"messages": user("PLAIN")})
        assert_openai_error(r, 503, code="model_loading")
        assert httpx.get(base + "/metrics").status_code == 200
        app.state.gem4.engine = ScriptedEngine()
        assert httpx.get(base + "/health").json() == {"status": "ok"}
        r = client_for(base, key="anything").chat.completions.create(model="later", messages=user("PLAIN"))
        assert r.choices[0].message.content == expected("PLAIN").content


def test_each_app_has_its_own_metrics_and_a_stand_in_engine_gets_the_estimate():
    apps = [create_app(ServerConfig(served_model_name=name, max_num_seqs=2), ScriptedEngine()) for name in "ab"]
    a, b = (app.state.gem4.metrics for app in apps)
    a.request_rejected()
    for _ in range(3):
        a.request_admitted(5)
    assert 'gem4:request_rejected_total{model_name="a"} 1.0' in a.render()
    assert 'gem4:request_rejected_total{model_name="b"} 0.0' in b.render()
    text = a.render()
    assert 'gem4:num_requests_running{model_name="a"} 2.0' in text           # FCFS: the first max_num_seqs
    assert 'gem4:num_requests_waiting{model_name="a"} 1.0' in text
    assert 'vllm:num_requests_running{model_name="a"} 2.0' in text           # vLLM's names: the same samples
    assert 'vllm:num_requests_waiting{model_name="a"} 1.0' in text
    assert 'gem4:prompt_tokens_total{model_name="a"} 15.0' in text
    # a stand-in engine without the engine's counters: the families are declared, with no sample
    for family in ("gem4:kv_cache_usage_perc", "vllm:kv_cache_usage_perc", "gem4:cache_config_info",
                   "gem4:num_preemptions_total", "gem4:iteration_tokens_total"):
        assert f"# TYPE {family} " in text and not re.search(rf"^{re.escape(family)}(_bucket|_count)?\{{", text, re.M)
    assert "_created" not in text
    assert Metrics("c", 1).render().count("gem4:num_requests_running{") == 1   # no engine yet: estimate 0


def test_cors_preflight_and_version():
    """vLLM's CORS flags: by default any origin gets the CORS headers; with --allowed-origins only those listed.
    GET /version answers gem4's version."""
    for origins, allowed, refused in ((("*",), ["http://anywhere.example"], []),
                                      (("http://good.example",), ["http://good.example"], ["http://evil.example"])):
        app = create_app(ServerConfig(served_model_name="m", api_key="k", allowed_origins=origins), ScriptedEngine())
        with InProcessServer(app) as base:
            assert httpx.get(base + "/version").json() == {"version": gem4.__version__}
            for origin, ok in [(o, True) for o in allowed] + [(o, False) for o in refused]:
                r = httpx.options(base + "/v1/chat/completions", headers={
                    "Origin": origin, "Access-Control-Request-Method": "POST",
                    "Access-Control-Request-Headers": "authorization, content-type"})
                if ok:            # answered before authentication: a preflight carries no key
                    assert r.status_code == 200, r.text
                    assert r.headers["access-control-allow-origin"] in ("*", origin)
                    assert "POST" in r.headers["access-control-allow-methods"]
                    assert "authorization" in r.headers["access-control-allow-headers"].lower()
                else:
                    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
                r = httpx.get(base + "/v1/models", headers={"Origin": origin, "Authorization": "Bearer k"})
                assert r.status_code == 200
                assert ("access-control-allow-origin" in r.headers) == ok


# ---------------------------------------------------------------------------------------------
# Bounded work before admission and connection guards, in process (raw sockets where the point is
# what the server does before or without a complete request)
# ---------------------------------------------------------------------------------------------


def guarded_server(app, *, header_timeout: float = 30.0, body_timeout: float = 30.0,
                   max_connections: int | None = None) -> InProcessServer:
    """InProcessServer with `gem4 serve`'s connection guards."""
    return InProcessServer(app, http=guarded_protocol(header_timeout=header_timeout, body_timeout=body_timeout,
                                                      max_connections=max_connections))


JSON_HEADERS = {"Content-Type": "application/json"}


def test_oversized_bodies_get_413_before_they_are_read():
    limit = 100_000
    app = create_app(ServerConfig(served_model_name="m", max_request_body=limit), ScriptedEngine())
    with guarded_server(app) as base:
        body = {"model": "m", "prompt": "PLAIN", "max_tokens": 2}
        under = json.dumps({**body, "padding": "x" * (limit - 100)}).encode()
        assert len(under) <= limit
        assert httpx.post(base + "/v1/completions", content=under, headers=JSON_HEADERS).status_code == 200
        over = json.dumps({**body, "padding": "x" * limit}).encode()
        err = assert_openai_error(httpx.post(base + "/v1/completions", content=over, headers=JSON_HEADERS), 413,
                                  code="request_too_large")
        assert str(limit) in err["message"]
        # declared: 1 GB announced and never sent; the answer comes at once and the connection closes
        got, closed_after = raw_exchange(base, request_head("/v1/completions", length=10**9))
        assert closed_after is not None and closed_after < 2, (got, closed_after)
        status, headers, payload = raw_response(got)
        assert (status, payload["error"]["code"], headers["connection"]) == (413, "request_too_large", "close")
        # chunked: counted as it arrives, refused once past the limit (4 x 30 kB)
        chunks = b"".join(b"%x\r\n%s\r\n" % (30_000, b"x" * 30_000) for _ in range(4))
        got, closed_after = raw_exchange(base, request_head("/v1/completions") + chunks)
        assert closed_after is not None and raw_response(got)[0] == 413, got
        # the same from an HTTP client streaming a chunked body
        r = httpx.post(base + "/v1/completions", content=(over[i:i + 10_000] for i in range(0, len(over), 10_000)),
                       headers=JSON_HEADERS)
        assert_openai_error(r, 413, code="request_too_large")
        assert httpx.get(base + "/health").status_code == 200
    # the default limit: 1 MiB + 64 bytes per token of max_model_len
    engine = ScriptedEngine()
    default = 2**20 + 64 * engine.max_model_len
    with guarded_server(create_app(ServerConfig(served_model_name="m"), engine)) as base:
        status, _, payload = raw_response(raw_exchange(base, request_head("/v1/completions", length=default + 1))[0])
        assert status == 413 and f"at most {default} bytes" in payload["error"]["message"]


def test_header_and_body_timeouts_close_stalled_connections():
    app = create_app(ServerConfig(served_model_name="m"), ScriptedEngine())
    with guarded_server(app, header_timeout=1.0, body_timeout=1.0) as base:
        # headers begun and never finished (slowloris)
        got, closed_after = raw_exchange(base, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        assert closed_after is not None and 0.9 < closed_after < 4, closed_after
        status, _, payload = raw_response(got)
        assert status == 408 and payload["error"]["code"] == "request_timeout"
        # a body that stops arriving
        got, closed_after = raw_exchange(base, request_head("/v1/completions", length=1000) + b'{"model": ')
        assert closed_after is not None and 0.9 < closed_after < 4, closed_after
        assert raw_response(got)[0] == 408
        # a kept-alive connection idle between requests is the keep-alive timer's, not the header timeout's
        host, port = base.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            for _ in range(2):
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                got = b""
                while not got.endswith(b'{"status":"ok"}'):
                    got += sock.recv(65536)
                assert got.startswith(b"HTTP/1.1 200"), got
                time.sleep(1.5)
        assert httpx.get(base + "/health").status_code == 200


def test_connections_beyond_the_cap_get_503_and_are_closed():
    app = create_app(ServerConfig(served_model_name="m"), ScriptedEngine())
    server = guarded_server(app, max_connections=3)
    with server as base:
        host, port = base.removeprefix("http://").split(":")
        idle = [socket.create_connection((host, int(port)), timeout=5) for _ in range(3)]
        try:
            wait_for(lambda: len(server.server.server_state.connections) == 3)
            got, closed_after = raw_exchange(base)
            assert closed_after is not None and closed_after < 2
            status, headers, payload = raw_response(got)
            assert (status, payload["error"]["code"], headers["retry-after"]) == (503, "too_many_connections", "1")
            # the open ones are untouched; once one goes, a new connection is served
            idle[0].close()
            wait_for(lambda: len(server.server.server_state.connections) == 2)
            assert httpx.get(base + "/health").status_code == 200
            idle[1].settimeout(0.2)
            with pytest.raises(TimeoutError):
                idle[1].recv(1)
        finally:
            for s in idle:
                s.close()


def test_connection_cap_default():
    from gem4.argtypes import ArgParser
    from gem4.server.main import add_arguments, max_connections

    parser = ArgParser()
    add_arguments(parser)
    assert max_connections(parser.parse_args(["m"])) == 8 + 64 + 128             # the default --max-num-seqs
    assert max_connections(parser.parse_args(["m", "--max-num-seqs", "3", "--max-waiting", "10"])) == 3 + 10 + 128
    assert max_connections(parser.parse_args(["m", "--max-connections", "7"])) == 7


def test_chat_text_is_decoded_once(fake):
    """Chat replies are read from the token ids by the output parser, so the engine is asked for no text of its
    own; completions (whose stop strings the engine applies to the text) are."""
    engine, base, _ = fake
    chat = client_for(base).chat.completions.create(model="scripted", messages=user("PLAIN"))
    completion = client_for(base).completions.create(model="scripted", prompt="PLAIN", max_tokens=2)
    assert engine.detokenized[chat.id] is False and engine.detokenized[completion.id] is True
