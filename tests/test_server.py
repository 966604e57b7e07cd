"""The OpenAI-compatible server, tested with the official `openai` client on 127.0.0.1 only.

Two servers:

- **`gem4 serve` as a subprocess** on a tiny real checkpoint (the `dense_plain` fixture model with
  the 512-token real-vocab tokenizer and the official chat template copied beside it). Its output
  is random text, so correctness is checked against an in-process `gem4.Engine` + output parser
  on the same checkpoint (the oracle), and against the server itself (stream == non-stream,
  concurrent == sequential).
- **The app in-process** (uvicorn in a thread) over `ScriptedEngine`, a test stand-in for
  `gem4.Engine` that replays a fixed token-id script per request: reasoning, tool calls, slow
  prefill, a failing engine, a held queue. The scripted ids are real Gemma 4 token ids, so the
  server's real parser turns them into reasoning / content / tool calls.
"""
from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn

sys.path.insert(0, str(Path(__file__).parent))
from model_fixtures import build_hf
from text_fixtures import tiny_tokenizer, tiny_tokenizer_dir

import gem4
from gem4.chat import encode_prompt, stop_token_ids
from gem4.engine import EngineError, GenerationEvent
from gem4.kv_cache import kv_pool_size
from gem4.parser import Gemma4Parser, parse
from gem4.sampling import SamplingParams
from gem4.server import ServerConfig, create_app
from gem4.server.http11 import guarded_protocol
from gem4.server.metrics import Metrics

API_KEY = "test-key"
MAX_MODEL_LEN = 512
HOST = "127.0.0.1"          # loopback only, always


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def client_for(base: str, key: str = API_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=60)


def sse_lines(base: str, path: str, body: dict, key: str = API_KEY) -> list[str]:
    """The raw lines of an SSE response (comments included)."""
    with httpx.stream("POST", base + path, json=body, headers={"Authorization": f"Bearer {key}"},
                      timeout=60) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return [line for line in r.iter_lines() if line]


def sse_data(lines: list[str]) -> list[dict | str]:
    out = []
    for line in lines:
        if line.startswith("data: "):
            payload = line[len("data: "):]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def metric(base: str, name: str, **labels) -> float:
    text = httpx.get(base + "/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"metric {name} {labels} not found in:\n{text}")


def assert_openai_error(r: httpx.Response, status: int, *, param: str | None = "any", code: str | None = "any"):
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    if param != "any":
        assert err["param"] == param, err
    if code != "any":
        assert err["code"] == code, err
    return err


def accumulate(chunks) -> dict:
    """Fold chat.completion.chunk objects (SDK models) into one message, checking the chunk rules."""
    msg = {"role": None, "content": "", "reasoning_content": "", "tool_calls": {}}
    finish, ids = None, set()
    for i, ch in enumerate(chunks):
        ids.add(ch.id)
        assert ch.object == "chat.completion.chunk"
        if not ch.choices:
            continue
        (choice,) = ch.choices
        d = choice.delta
        if i == 0:
            assert d.role == "assistant"
        else:
            assert d.role is None
        assert finish is None, "nothing may follow the finish_reason chunk but the usage chunk"
        msg["role"] = msg["role"] or d.role
        msg["content"] += d.content or ""
        msg["reasoning_content"] += (d.model_extra or {}).get("reasoning_content") or ""
        for tc in d.tool_calls or []:
            slot = msg["tool_calls"].setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            if tc.id is not None:
                assert slot["id"] is None and slot["arguments"] == "", "id/name come first, once"
                slot["id"], slot["name"] = tc.id, tc.function.name
            slot["arguments"] += tc.function.arguments or ""
        finish = choice.finish_reason
    assert len(ids) == 1, ids
    msg["finish_reason"] = finish
    msg["tool_calls"] = [msg["tool_calls"][k] for k in sorted(msg["tool_calls"])]
    return msg


class InProcessServer:
    """uvicorn in a thread on 127.0.0.1, port chosen by the OS; `uvicorn_kwargs` go to uvicorn.Config."""

    def __init__(self, app, **uvicorn_kwargs):
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, host=HOST, port=0, log_level="warning", **uvicorn_kwargs))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline and self.thread.is_alive(), "in-process server did not start"
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://{HOST}:{port}"

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


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
        self.end_ids = stop_token_ids(self.tokenizer)
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

    def submit(self, prompt, params: SamplingParams, *, request_id: str, n: int = 1) -> FakeStream:
        assert n == 1, "the scripted engine serves one choice (n > 1 is tested on the real engine)"
        prompt = list(prompt)
        if params.max_tokens is not None and len(prompt) + params.max_tokens > self.max_model_len:
            raise ValueError("too long")
        stream = FakeStream()
        self.prompts[request_id], self.params[request_id] = prompt, params
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


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


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


def wait_for(cond, timeout: float = 10.0) -> None:
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, "condition not reached in time"
        time.sleep(0.01)


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
    assert 'gem4:prompt_tokens_total{model_name="a"} 15.0' in text
    # a stand-in engine without the engine's counters: the families are declared, with no sample
    for family in ("gem4:kv_cache_usage_perc", "gem4:num_preemptions_total", "gem4:iteration_tokens_total"):
        assert f"# TYPE {family} " in text and not re.search(rf"^{re.escape(family)}(_bucket|_count)?\{{", text, re.M)
    assert "_created" not in text
    assert Metrics("c", 1).render().count("gem4:num_requests_running{") == 1   # no engine yet: estimate 0


# ---------------------------------------------------------------------------------------------
# Bounded work before admission and connection guards, in process (raw sockets where the point is
# what the server does before or without a complete request)
# ---------------------------------------------------------------------------------------------


def request_head(path: str, *, length: int | None = None, key: str | None = None, method: str = "POST") -> bytes:
    """An HTTP/1.1 request line and headers: Content-Length `length`, or chunked when None."""
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json"]
    lines.append("Transfer-Encoding: chunked" if length is None else f"Content-Length: {length}")
    if key is not None:
        lines.append(f"Authorization: Bearer {key}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def raw_exchange(base: str, data: bytes = b"", *, timeout: float = 8.0) -> tuple[bytes, float | None]:
    """Open a connection, send `data` (maybe nothing, or an incomplete request) and read until the
    server closes it: (what came back, seconds until it closed), or seconds None if it was still open
    after `timeout`."""
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        start = time.perf_counter()
        if data:
            sock.sendall(data)
        got = b""
        try:
            while chunk := sock.recv(65536):
                got += chunk
        except TimeoutError:
            return got, None
        except ConnectionResetError:
            pass
        return got, time.perf_counter() - start


def raw_response(data: bytes) -> tuple[int, dict[str, str], dict]:
    """(status, headers, JSON body) of one raw HTTP response."""
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in header_lines)}
    return int(status_line.split()[1]), headers, json.loads(body)


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


# ---------------------------------------------------------------------------------------------
# `gem4 serve` on a tiny real checkpoint, as a subprocess
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    """The dense_plain fixture checkpoint with the tiny real-vocab tokenizer + template C beside it."""
    d = tmp_path_factory.mktemp("server") / "tiny"
    causal, _ = build_hf("dense_plain")
    causal.save_pretrained(d)
    for f in tiny_tokenizer_dir().iterdir():
        shutil.copy(f, d / f.name)
    return d


@contextlib.contextmanager
def gem4_serve(args: list[str], log: Path, env: dict | None = None):
    """`gem4 serve ARGS --host 127.0.0.1 --port 0` in a subprocess; yields the URL from its ready line."""
    with gem4_serve_process(args, log, env) as (url, _):
        yield url


@contextlib.contextmanager
def gem4_serve_process(args: list[str], log: Path, env: dict | None = None):
    """gem4_serve, yielding (URL, the server's Popen)."""
    cmd = [sys.executable, "-m", "gem4.cli", "serve", *args, "--host", HOST, "--port", "0"]
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True,
                                env=None if env is None else {**os.environ, **env})
        lines: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
        try:
            deadline = time.time() + 180
            url = None
            while url is None:
                assert time.time() < deadline and proc.poll() is None, \
                    f"gem4 serve did not start:\n{log.read_text()}"
                try:
                    line = lines.get(timeout=0.2)
                except queue.Empty:
                    continue
                m = re.search(r"ready at (http://127\.0\.0\.1:\d+)", line)
                url = m and m.group(1)
            yield url, proc
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


SERVED_BODY_MIB = 8              # room for the 5 MB prompts of the early character bound test
SERVED_HEADER_TIMEOUT = 2.0


@pytest.fixture(scope="module")
def served(tiny_dir, tmp_path_factory):
    """`gem4 serve` on the tiny checkpoint; yields its base URL."""
    log = tmp_path_factory.mktemp("serve-log") / "stderr.txt"
    with gem4_serve([str(tiny_dir), "--dtype", "float32", "--api-key", API_KEY, "--served-model-name", "tiny",
                     "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "4", "--heartbeat-interval", "5",
                     "--default-chat-template-kwargs", '{"enable_thinking": false}',
                     "--max-request-body-mb", str(SERVED_BODY_MIB), "--header-timeout", str(SERVED_HEADER_TIMEOUT)],
                    log) as url:
        assert "weights" in log.read_text()          # the load progress bar went to stderr
        yield url


@pytest.fixture(scope="module")
def oracle(tiny_dir):
    """An in-process Engine on the same checkpoint: what the server must reproduce."""
    model = gem4.load(tiny_dir, dtype="float32")
    tok = gem4.Tokenizer.from_file(tiny_dir)
    return gem4.Engine(model, tok, max_model_len=MAX_MODEL_LEN), tok


def oracle_chat(oracle, messages, params: SamplingParams, **template_kwargs):
    engine, tok = oracle
    ids = encode_prompt(tok, messages, **template_kwargs)
    parser = Gemma4Parser(tok, prompt_ids=ids, tool_names=frozenset())
    events = list(engine.generate(ids, params))
    parser.feed([e.token_id for e in events if e.token_id is not None])
    parser.finish()
    return parser.result, events


def test_models_and_health(served):
    client = client_for(served)
    models = client.models.list()
    (card,) = models.data
    assert card.id == "tiny" and card.object == "model" and card.model_extra["max_model_len"] == MAX_MODEL_LEN
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    assert httpx.get(served + "/health").json() == {"status": "ok"}


@pytest.mark.parametrize("thinking", [False, True])
def test_chat_matches_the_engine_and_parser(served, oracle, thinking):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"}]
    r = client_for(served).chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0,
                                                   extra_body={"chat_template_kwargs": {"enable_thinking": thinking}})
    want, events = oracle_chat(oracle, messages, SamplingParams(temperature=0, max_tokens=16),
                               enable_thinking=thinking)
    msg = r.choices[0].message
    assert msg.content == want.content
    assert (msg.model_extra or {}).get("reasoning_content") == (want.reasoning_content or None)
    assert r.choices[0].finish_reason == ("length" if events[-1].finish_reason == "length" else "stop")
    assert r.usage.prompt_tokens == events[-1].prompt_tokens
    assert r.usage.completion_tokens == events[-1].completion_tokens


def test_chat_stream_equals_non_stream_for_the_same_seed(served):
    client = client_for(served)
    kwargs = {"model": "tiny", "messages": user("Tell me a story"), "max_tokens": 20, "seed": 1234,
              "temperature": 1.0, "logprobs": True, "top_logprobs": 3}
    r = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    s = accumulate(chunks)
    m = r.choices[0].message
    assert s["content"] == (m.content or "") and s["finish_reason"] == r.choices[0].finish_reason
    assert s["reasoning_content"] == (m.model_extra or {}).get("reasoning_content", "")
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens
    # logprobs: one entry per generated token, streamed or not, the same values
    lp = r.choices[0].logprobs.content
    streamed = [t for ch in chunks if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.content]
    assert len(lp) == r.usage.completion_tokens == len(streamed)
    # (the second request finds the first's prompt in the prefix cache and computes only its last token:
    # float32 rounds that row a little differently alone, so the values agree to float32's rounding)
    assert [t.token for t in lp] == [t.token for t in streamed]
    assert [t.logprob for t in lp] == pytest.approx([t.logprob for t in streamed], rel=1e-5, abs=1e-6)
    assert r.usage.prompt_tokens_details.cached_tokens < r.usage.prompt_tokens - 1           # earlier tests' prompts
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == r.usage.prompt_tokens - 1  # all but the last
    assert all(len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob >= t.logprob - 1e-6 for t in lp)
    # a different seed gives a different reply
    other = client.chat.completions.create(**{**kwargs, "seed": 99})
    assert other.choices[0].message.content != m.content


def test_completions(served, oracle):
    engine, tok = oracle
    client = client_for(served)
    r = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=12, temperature=0)
    events = list(engine.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=12)))
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].text == "".join(e.text for e in events)
    assert r.choices[0].finish_reason == events[-1].finish_reason
    assert r.usage.prompt_tokens == events[-1].prompt_tokens and r.usage.completion_tokens == 12
    # streamed: the same text; include_usage
    chunks = list(client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    # token-id prompt, echo, logprobs
    ids = tok.encode("Once upon a time")
    r2 = client.completions.create(model="tiny", prompt=ids, max_tokens=12, temperature=0, logprobs=2)
    assert r2.choices[0].text == r.choices[0].text
    assert len(r2.choices[0].logprobs.tokens) == 12 and all(len(t) <= 2 for t in r2.choices[0].logprobs.top_logprobs)
    r3 = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=12, temperature=0, echo=True)
    assert r3.choices[0].text == "Once upon a time" + r.choices[0].text
    # a stop string: the text ends before it
    text = r.choices[0].text
    stop = next((text[i:i + 2] for i in range(2, len(text) - 2) if text[i:i + 2].strip()), None)
    assert stop is not None
    r4 = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=12, temperature=0, stop=[stop])
    assert r4.choices[0].text == text[:text.index(stop)] and r4.choices[0].finish_reason == "stop"


def by_choice(chunks) -> dict[int, list]:
    """Streamed chunks split per choice index (one choice per chunk); the usage chunk is left out."""
    out: dict[int, list] = {}
    for ch in chunks:
        if ch.choices:
            (choice,) = ch.choices
            out.setdefault(choice.index, []).append(ch)
    return dict(sorted(out.items()))


def test_n_chat_choices_are_indexed_seeded_per_choice_and_counted_once(served, oracle):
    """n=2: choice i is the request alone with seed + i (the engine's rule), streamed or not; usage counts
    the prompt once and the tokens of both choices."""
    client = client_for(served)
    messages = user("Tell me a story")
    kwargs = {"model": "tiny", "messages": messages, "max_tokens": 14, "seed": 77, "temperature": 1.0, "n": 2}
    want = [oracle_chat(oracle, messages, SamplingParams(temperature=1.0, seed=77 + i, max_tokens=14),
                        enable_thinking=False) for i in range(2)]
    r = client.chat.completions.create(**kwargs)
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.message.content for c in r.choices] == [w.content for w, _ in want]
    assert r.choices[0].message.content != r.choices[1].message.content
    assert [c.finish_reason for c in r.choices] == [
        "length" if ev[-1].finish_reason == "length" else "stop" for _, ev in want]
    assert r.usage.prompt_tokens == want[0][1][-1].prompt_tokens
    assert r.usage.completion_tokens == sum(ev[-1].completion_tokens for _, ev in want)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    per = by_choice(chunks)
    assert list(per) == [0, 1] and all(len(ch.choices) == 1 for ch in chunks if ch.choices)
    for i, sub in per.items():
        s = accumulate(sub)
        assert s["content"] == r.choices[i].message.content and s["finish_reason"] == r.choices[i].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == r.usage.model_dump()
    # greedy: every choice is the one greedy reply
    g = client.chat.completions.create(**{**kwargs, "temperature": 0, "seed": None, "n": 3})
    (greedy, _), = [oracle_chat(oracle, messages, SamplingParams(temperature=0, max_tokens=14),
                                enable_thinking=False)]
    assert [c.message.content for c in g.choices] == [greedy.content] * 3 and [c.index for c in g.choices] == [0, 1, 2]


def test_n_completions_streamed_and_not(served, oracle):
    engine, tok = oracle
    client = client_for(served)
    kwargs = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 12, "seed": 5, "temperature": 1.0, "n": 2}
    want = [list(engine.generate("Once upon a time", SamplingParams(temperature=1.0, seed=5 + i, max_tokens=12)))
            for i in range(2)]
    r = client.completions.create(**kwargs)
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == ["".join(e.text for e in ev) for ev in want]
    assert r.choices[0].text != r.choices[1].text
    assert [c.finish_reason for c in r.choices] == [ev[-1].finish_reason for ev in want]
    assert r.usage.prompt_tokens == want[0][-1].prompt_tokens and r.usage.completion_tokens == 24
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    per = by_choice(chunks)
    assert {i: "".join(c.choices[0].text for c in sub) for i, sub in per.items()} == {0: r.choices[0].text,
                                                                                      1: r.choices[1].text}
    assert [[c.choices[0].finish_reason for c in sub][-1] for sub in per.values()] == [c.finish_reason
                                                                                        for c in r.choices]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    # echo and a stop string apply to each choice
    first = r.choices[0].text
    stop = next((first[i:i + 2] for i in range(2, len(first) - 2) if first[i:i + 2].strip()), None)
    assert stop is not None
    r2 = client.completions.create(**kwargs, stop=[stop], echo=True)
    for c, full in zip(r2.choices, (x.text for x in r.choices)):
        cut = full[:full.index(stop)] if stop in full else full
        assert c.text == "Once upon a time" + cut
    assert r2.choices[0].finish_reason == "stop"


def test_tokenize_and_detokenize(served, oracle):
    _, tok = oracle
    headers = {"Authorization": f"Bearer {API_KEY}"}
    r = httpx.post(served + "/tokenize", json={"prompt": "Hello world", "return_token_strs": True},
                   headers=headers).json()
    assert r["tokens"] == tok.encode("Hello world") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == MAX_MODEL_LEN and r["token_strs"][0] == "<bos>"
    d = httpx.post(served + "/detokenize", json={"tokens": r["tokens"]}, headers=headers).json()
    assert d["prompt"] == tok.decode(r["tokens"])
    msgs = user("Hi")
    r = httpx.post(served + "/tokenize", json={"messages": msgs, "chat_template_kwargs": {"enable_thinking": True}},
                   headers=headers).json()
    assert r["tokens"] == encode_prompt(tok, msgs, enable_thinking=True)
    r = httpx.post(served + "/tokenize", json={"prompt": "x", "add_special_tokens": False}, headers=headers).json()
    assert r["tokens"] == tok.encode("x", add_bos=False)


LONG_TEXT = "word " * 700          # > MAX_MODEL_LEN tokens with the tiny vocabulary
OK_CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
BAD_INPUTS = [
    # (name, path, body (dict, or raw bytes), headers override, status, param, code)
    ("invalid JSON", "/v1/chat/completions", b'{"model": "tiny", "messages": [', None, 400, None, None),
    ("body not an object", "/v1/chat/completions", b"[1, 2]", None, 400, None, None),
    ("missing messages", "/v1/chat/completions", {"model": "tiny"}, None, 400, "messages", None),
    ("empty messages", "/v1/chat/completions", {**OK_CHAT, "messages": []}, None, 400, "messages", None),
    ("messages wrong type", "/v1/chat/completions", {**OK_CHAT, "messages": "hi"}, None, 400, "messages", None),
    ("temperature wrong type", "/v1/chat/completions", {**OK_CHAT, "temperature": "hot"}, None, 400,
     "temperature", None),
    ("max_tokens as a string", "/v1/chat/completions", {**OK_CHAT, "max_tokens": "5"}, None, 400, "max_tokens", None),
    ("negative max_tokens", "/v1/chat/completions", {**OK_CHAT, "max_tokens": -1}, None, 400, "max_tokens", None),
    ("content wrong type", "/v1/chat/completions", {**OK_CHAT, "messages": [{"role": "user", "content": 5}]},
     None, 400, "messages[0].content", None),
    ("unknown role", "/v1/chat/completions", {**OK_CHAT, "messages": [{"role": "wizard", "content": "hi"}]},
     None, 400, "messages[0].role", None),
    ("tool message without tool_call_id", "/v1/chat/completions",
     {**OK_CHAT, "messages": [{"role": "tool", "content": "{}"}]}, None, 400, "messages[0].tool_call_id", None),
    ("image input", "/v1/chat/completions", {**OK_CHAT, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}}]}]}, None, 400, "messages[0].content",
     None),
    ("bad tool schema", "/v1/chat/completions", {**OK_CHAT, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "string"}}}]}, None, 400, "tools[0].function.parameters", None),
    ("bad tool name", "/v1/chat/completions", {**OK_CHAT, "tools": [{"type": "function", "function": {
        "name": "my tool"}}]}, None, 400, "tools[0].function.name", None),
    ("tool_choice required", "/v1/chat/completions", {**OK_CHAT, "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "f"}}]}, None, 400, "tool_choice", None),
    ("n above max_num_seqs", "/v1/chat/completions", {**OK_CHAT, "n": 5}, None, 400, "n", None),
    ("n = 0", "/v1/completions", {"model": "tiny", "prompt": "x", "n": 0}, None, 400, "n", None),
    ("top_p = 0", "/v1/chat/completions", {**OK_CHAT, "top_p": 0}, None, 400, "top_p", None),
    ("logit_bias outside the vocabulary", "/v1/chat/completions", {**OK_CHAT, "logit_bias": {"100000": 1}}, None,
     400, "logit_bias", None),
    ("top_logprobs without logprobs", "/v1/chat/completions", {**OK_CHAT, "top_logprobs": 2}, None, 400,
     "top_logprobs", None),
    # issue 12: values that used to reach the engine thread (and fail every request) or answer 500
    ("top_k beyond int64", "/v1/chat/completions", {**OK_CHAT, "top_k": 2**63}, None, 400, "top_k", None),
    ("top_k 1e30", "/v1/chat/completions", {**OK_CHAT, "top_k": 1e30}, None, 400, "top_k", None),
    ("top_k above the vocabulary", "/v1/chat/completions", {**OK_CHAT, "top_k": 513}, None, 400, "top_k", None),
    ("logit_bias superscript-digit key", "/v1/chat/completions", {**OK_CHAT, "logit_bias": {"\u00b2": 1}}, None,
     400, "logit_bias", None),
    ("logit_bias Arabic-Indic digit key", "/v1/chat/completions", {**OK_CHAT, "logit_bias": {"\u0663": 1}}, None,
     400, "logit_bias", None),
    ("logit_bias 5000-digit key", "/v1/chat/completions", {**OK_CHAT, "logit_bias": {"7" * 5000: 1}}, None,
     400, "logit_bias", None),
    ("logit_bias with 301 entries", "/v1/chat/completions",
     {**OK_CHAT, "logit_bias": {str(i): 1 for i in range(301)}}, None, 400, "logit_bias", None),
    ("seed beyond 64 bits", "/v1/chat/completions", {**OK_CHAT, "seed": 2**64}, None, 400, "seed", None),
    ("seed below -2^63", "/v1/completions", {"model": "tiny", "prompt": "x", "seed": -(2**63) - 1}, None, 400,
     "seed", None),
    ("json_schema response_format", "/v1/chat/completions", {**OK_CHAT, "response_format": {"type": "json_schema"}},
     None, 400, "response_format", None),
    ("overlong prompt", "/v1/chat/completions", {**OK_CHAT, "messages": user(LONG_TEXT), "max_tokens": None},
     None, 400, "messages", "context_length_exceeded"),
    ("prompt + max_tokens over the context", "/v1/chat/completions", {**OK_CHAT, "max_tokens": MAX_MODEL_LEN}, None,
     400, "max_tokens", "context_length_exceeded"),
    ("max_tokens 1e9", "/v1/chat/completions", {**OK_CHAT, "max_tokens": 10**9}, None, 400, "max_tokens",
     "context_length_exceeded"),
    ("max_completion_tokens over the context", "/v1/chat/completions",
     {**OK_CHAT, "max_completion_tokens": MAX_MODEL_LEN - 2}, None, 400, "max_completion_tokens",
     "context_length_exceeded"),
    ("completion: max_tokens 1e9", "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 10**9}, None,
     400, "max_tokens", "context_length_exceeded"),
    ("completion: empty prompt", "/v1/completions", {"model": "tiny", "prompt": ""}, None, 400, "prompt", None),
    ("completion: token id outside the vocabulary", "/v1/completions", {"model": "tiny", "prompt": [1, 99999]},
     None, 400, "prompt", None),
    ("completion: overlong prompt", "/v1/completions", {"model": "tiny", "prompt": LONG_TEXT}, None, 400, "prompt",
     "context_length_exceeded"),
    ("tokenize: neither prompt nor messages", "/tokenize", {"model": "tiny"}, None, 400, None, None),
    ("detokenize: bad token id", "/detokenize", {"tokens": [-1]}, None, 400, "tokens", None),
    ("wrong API key", "/v1/chat/completions", OK_CHAT, {"Authorization": "Bearer nope"}, 401, None,
     "invalid_api_key"),
    ("no API key", "/v1/chat/completions", OK_CHAT, {}, 401, None, "invalid_api_key"),
    ("unknown model", "/v1/chat/completions", {**OK_CHAT, "model": "gpt-4o"}, None, 404, "model",
     "model_not_found"),
    ("unknown route", "/v1/embeddings", {"model": "tiny", "input": "x"}, None, 404, None, "unknown_url"),
]


def test_bad_inputs_get_openai_errors_and_the_server_stays_healthy(served):
    assert len(BAD_INPUTS) >= 12
    with httpx.Client(base_url=served, timeout=30) as http:
        for name, path, body, headers, status, param, code in BAD_INPUTS:
            h = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"} if headers is None \
                else {"Content-Type": "application/json", **headers}
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            r = http.post(path, content=content, headers=h)
            try:
                assert_openai_error(r, status, param=param, code=code)
            except AssertionError as e:
                raise AssertionError(f"{name}: {e}") from None
            assert http.get("/health").status_code == 200, name
        # a wrong method is an error object too, and a good request still works afterwards
        assert_openai_error(http.get("/v1/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"}), 405)
    client = client_for(served)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=user(LONG_TEXT))
    assert e.value.code == "context_length_exceeded"
    assert "maximum context length is 512 tokens" in e.value.message
    with pytest.raises(openai.AuthenticationError):
        client_for(served, key="wrong").models.list()
    assert client.chat.completions.create(model="tiny", messages=user("hi"), max_tokens=2).choices[0].message


def test_context_errors_name_what_does_not_fit(served):
    """vLLM's words: a max_tokens that does not fit names max_tokens, the context length, the prompt's tokens and
    the tokens asked for (it once blamed 'your messages (2 characters)'); a prompt that cannot fit names the
    prompt and its token count."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    n_chat = httpx.post(served + "/tokenize", json={"model": "tiny", "messages": user("hi")}, headers=headers).json()
    n_text = httpx.post(served + "/tokenize", json={"model": "tiny", "prompt": "hi"}, headers=headers).json()
    long_ids = [100] * MAX_MODEL_LEN
    cases = [  # (path, body, the message)
        ("/v1/chat/completions", {**OK_CHAT, "max_tokens": 10**9},
         f"'max_tokens' is too large: 1000000000. This model's maximum context length is {MAX_MODEL_LEN} tokens and "
         f"your request has {n_chat['count']} input tokens (1000000000 > {MAX_MODEL_LEN} - {n_chat['count']})."),
        ("/v1/chat/completions", {**OK_CHAT, "max_completion_tokens": MAX_MODEL_LEN - 2},
         f"'max_completion_tokens' is too large: {MAX_MODEL_LEN - 2}. This model's maximum context length is "
         f"{MAX_MODEL_LEN} tokens and your request has {n_chat['count']} input tokens"),
        ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": MAX_MODEL_LEN},
         f"'max_tokens' is too large: {MAX_MODEL_LEN}. This model's maximum context length is {MAX_MODEL_LEN} tokens "
         f"and your request has {n_text['count']} input tokens ({MAX_MODEL_LEN} > {MAX_MODEL_LEN} - "
         f"{n_text['count']})."),
        ("/v1/completions", {"model": "tiny", "prompt": long_ids, "max_tokens": 1},
         f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, your request has {MAX_MODEL_LEN} "
         f"input tokens. Please reduce the length of the prompt."),
    ]
    for path, body, says in cases:
        err = assert_openai_error(httpx.post(served + path, json=body, headers=headers), 400,
                                  code="context_length_exceeded")
        assert err["message"].startswith(says), (body, err["message"])
    with httpx.stream("POST", served + "/v1/completions", headers=headers, timeout=120,   # the edge: it fits
                      json={"model": "tiny", "prompt": "hi", "max_tokens": MAX_MODEL_LEN - n_text["count"],
                            "stream": True}) as r:
        assert r.status_code == 200


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


def test_chat_template_flag_replaces_the_checkpoints(tiny_dir, tmp_path):
    """`gem4 serve --chat-template FILE`: the file's template renders every chat prompt (/tokenize with messages
    shows it), the checkpoint's is not used."""
    template = tmp_path / "plain.jinja"
    template.write_text("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                        "{% if add_generation_prompt %}[model] {% endif %}")
    body = {"model": "tiny", "messages": [{"role": "system", "content": "Be brief."}, *user("Hello there")],
            "return_token_strs": True}
    with gem4_serve([str(tiny_dir), "--dtype", "float32", "--chat-template", str(template)],
                    tmp_path / "log.txt") as url:
        got = httpx.post(url + "/tokenize", json=body, timeout=30).json()
    text = tiny_tokenizer().decode(got["tokens"]).replace("\u2581", " ")       # the tiny vocabulary keeps ▁
    assert text.endswith("[system] Be brief.\n[user] Hello there\n[model] "), text
    assert "<|turn>" not in text


def test_sigterm_ends_open_streams_with_an_error_and_exits_zero(tiny_dir, tmp_path):
    """SIGTERM with a stream open: the stream ends with an error event and [DONE], the engine request is aborted,
    and the process exits 0 within a few seconds (uvicorn alone waited, cut the stream, and died of the signal)."""
    log = tmp_path / "log.txt"
    with gem4_serve_process([str(tiny_dir), "--dtype", "float32"], log) as (url, proc):
        lines: list[str] = []
        body = {"model": "tiny", "messages": user("Go on"), "stream": True, "max_tokens": 4000, "ignore_eos": True}

        def read():
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
                lines.extend(line for line in r.iter_lines() if line)

        reader = threading.Thread(target=read)
        reader.start()
        wait_for(lambda: metric(url, "gem4:generation_tokens_total") >= 4, timeout=60)
        start = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0, log.read_text()
        assert time.perf_counter() - start < 5
        reader.join(timeout=10)
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2].removeprefix("data: "))["error"]
    assert error["code"] == "server_shutting_down" and "shutting down" in error["message"], lines[-3:]
    assert not any('"finish_reason":"' in line for line in lines)          # cut by the shutdown, not finished
    text = log.read_text()
    assert "SIGTERM: shutting down" in text and "stopped 1 running request" in text
    assert "terminate called" not in text and "Traceback" not in text


def test_a_busy_port_is_one_line(tiny_dir):
    """Another server on the port: one gem4 line naming the port and the way out, before anything loads."""
    with socket.socket() as other:
        other.bind((HOST, 0))
        other.listen()
        port = other.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "gem4.cli", "serve", str(tiny_dir), "--host", HOST, "--port",
                            str(port)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr.splitlines() == [f"gem4: error: port {port} on {HOST} is already in use (another server?): "
                                     "stop it, or pass --port N (--port 0 picks a free port)"], r.stderr


def test_extreme_valid_sampling_values_give_finite_logprobs(served):
    # repetition_penalty 1e-300 is a valid value that float32 rounds to 0: it made NaN logprobs
    # (non-streamed a 500 "Out of range float values are not JSON compliant", streamed null)
    body = {"model": "tiny", "messages": user("hi there"), "max_tokens": 6, "repetition_penalty": 1e-300,
            "logprobs": True, "top_logprobs": 3, "seed": -(2**63), "ignore_eos": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    r = httpx.post(served + "/v1/chat/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    streamed = [t for c in sse_data(sse_lines(served, "/v1/chat/completions", {**body, "stream": True}))
                if c != "[DONE]" and c["choices"] and c["choices"][0].get("logprobs")
                for t in c["choices"][0]["logprobs"]["content"]]
    for tokens in (content, streamed):
        assert len(tokens) == 6
        values = [t["logprob"] for t in tokens] + [x["logprob"] for t in tokens for x in t["top_logprobs"]]
        assert all(isinstance(v, float) and -9999.0 <= v <= 0 for v in values), values
    assert [t["token"] for t in content] == [t["token"] for t in streamed]     # same seed, same tokens


def test_served_refuses_big_bodies_before_reading_them(served):
    """50 MB announced and never sent: without a key 401, with one 413 (over --max-request-body-mb),
    each at once, and the connection closes instead of draining the body."""
    for key, status, code in ((None, 401, "invalid_api_key"), (API_KEY, 413, "request_too_large")):
        got, closed_after = raw_exchange(served, request_head("/v1/chat/completions", length=50_000_000, key=key))
        assert closed_after is not None and closed_after < 2, (key, got, closed_after)
        assert raw_response(got)[0] == status and raw_response(got)[2]["error"]["code"] == code
    assert httpx.get(served + "/health").status_code == 200


def test_served_closes_a_silent_connection_after_the_header_timeout(served):
    got, closed_after = raw_exchange(served, timeout=SERVED_HEADER_TIMEOUT + 8)
    assert closed_after is not None and SERVED_HEADER_TIMEOUT - 0.1 < closed_after < SERVED_HEADER_TIMEOUT + 4
    status, headers, payload = raw_response(got)
    assert (status, payload["error"]["code"], headers["connection"]) == (408, "request_timeout", "close")


def test_a_text_that_cannot_fit_is_refused_without_tokenizing(served):
    """5 MB of text cannot be 512 tokens (no token is over 31 characters): refused with the
    context-length error at once, where tokenizing it would take ~20 s; /health answers meanwhile.
    The user text is checked before rendering, the rendered prompt (here: a long assistant turn) before tokenizing."""
    big = "word " * 1_000_000
    cases = [("/v1/completions", {"model": "tiny", "prompt": big, "max_tokens": 1}, "prompt"),
             ("/v1/chat/completions", {"model": "tiny", "messages": user(big)}, "messages"),
             ("/v1/chat/completions", {"model": "tiny", "messages": [*user("hi"), {"role": "assistant", "content": big},
                                                                     *user("go on")]}, "messages"),
             ("/tokenize", {"model": "tiny", "prompt": big}, "prompt")]
    headers = {"Authorization": f"Bearer {API_KEY}"}
    for path, body, param in cases:
        done: dict = {}

        def post():
            start = time.perf_counter()
            done["r"] = httpx.post(served + path, json=body, headers=headers, timeout=120)
            done["s"] = time.perf_counter() - start

        thread = threading.Thread(target=post)
        thread.start()
        health = []
        while thread.is_alive():
            start = time.perf_counter()
            assert httpx.get(served + "/health", timeout=30).status_code == 200
            health.append(time.perf_counter() - start)
            time.sleep(0.02)
        thread.join()
        err = assert_openai_error(done["r"], 400, param=param, code="context_length_exceeded")
        m = re.search(r"maximum context length is 512 tokens\. However, your \w+ \((\d+) characters\) would be at "
                      r"least (\d+) tokens \(no token is longer than 31 characters\)", err["message"])
        assert m and int(m[1]) >= len(big) - 1 and int(m[2]) == -(-int(m[1]) // 31), err
        assert done["s"] < 5, (path, done["s"])
        assert max(health, default=0) < 1.5, (path, health)


def test_disconnect_stops_generation_and_the_next_request_is_served(served):
    gen_before = metric(served, "gem4:generation_tokens_total")
    aborted_before = metric(served, "gem4:request_success_total", finished_reason="abort")
    body = {"model": "tiny", "messages": user("Go on"), "stream": True, "max_tokens": 400, "ignore_eos": True}
    with httpx.stream("POST", served + "/v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(8):                 # a few tokens in, then the client goes away
            next(lines)
    wait_for(lambda: metric(served, "gem4:num_requests_running") == 0, timeout=30)
    assert metric(served, "gem4:request_success_total", finished_reason="abort") == aborted_before + 1
    stopped_at = metric(served, "gem4:generation_tokens_total")
    assert stopped_at - gen_before < 100, "the request kept generating after the disconnect"
    time.sleep(0.3)
    assert metric(served, "gem4:generation_tokens_total") == stopped_at
    r = client_for(served).chat.completions.create(model="tiny", messages=user("Next"), max_tokens=3,
                                                   extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3


def test_sixteen_concurrent_streams_are_complete_distinct_and_batch_invariant(served):
    """16 clients at once (4 decoded together, the others queued): each stream is complete and has exactly
    the text the same seeded request gets alone."""
    client = client_for(served)

    def request(i: int, **kw):
        return dict(model="tiny", messages=user(f"Client number {i}"), max_tokens=10, seed=i, temperature=1.0,
                    extra_body={"ignore_eos": True}, **kw)

    sequential = [client.chat.completions.create(**request(i)).choices[0].message.content for i in range(16)]
    results: dict[int, dict] = {}
    errors: list = []
    barrier = threading.Barrier(16)

    def run(i: int):
        try:
            barrier.wait()
            chunks = list(client_for(served).chat.completions.create(**request(i), stream=True))
            results[i] = accumulate(chunks) | {"id": chunks[0].id}
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append((i, e))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert sorted(results) == list(range(16))
    assert all(results[i]["finish_reason"] == "length" for i in range(16))      # complete
    assert len({results[i]["id"] for i in range(16)}) == 16
    assert len({results[i]["content"] for i in range(16)}) == 16                 # distinct
    assert [results[i]["content"] for i in range(16)] == sequential              # each its own, uncrossed


def test_metrics(served):
    text = httpx.get(served + "/metrics").text
    for family in ("gem4:num_requests_running", "gem4:num_requests_waiting", "gem4:prompt_tokens_total",
                   "gem4:generation_tokens_total", "gem4:time_to_first_token_seconds_bucket",
                   "gem4:inter_token_latency_seconds_count", "gem4:e2e_request_latency_seconds_sum",
                   "gem4:kv_cache_usage_perc", "gem4:num_preemptions_total", "gem4:iteration_tokens_total_bucket",
                   "gem4:iteration_seqs_total_count", "gem4:request_success_total", "gem4:request_rejected_total"):
        assert re.search(rf"^{re.escape(family)}\{{", text, re.MULTILINE), family
    assert "_created" not in text
    assert metric(served, "gem4:prompt_tokens_total") > 0 and metric(served, "gem4:generation_tokens_total") > 0
    assert metric(served, "gem4:iteration_tokens_total_count") == metric(served, "gem4:iteration_seqs_total_count") > 0
    assert metric(served, "gem4:time_to_first_token_seconds_count") > 0
    assert metric(served, "gem4:time_to_first_token_seconds_bucket", le="+Inf") == \
        metric(served, "gem4:time_to_first_token_seconds_count")


def test_serve_refuses_bad_arguments():
    r = subprocess.run([sys.executable, "-m", "gem4.cli", "serve"], capture_output=True, text=True, timeout=60,
                       check=False)
    assert r.returncode == 2 and "MODEL is required" in r.stderr
    r = subprocess.run([sys.executable, "-m", "gem4.cli", "serve", "x", "--default-chat-template-kwargs", "[1]"],
                       capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 2 and "JSON object" in r.stderr


class RecordingEngine(gem4.Engine):
    """gem4.Engine that notes its step count when asked to abort."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.abort_steps: dict[str, int] = {}

    def abort(self, request_id: str, index: int | None = None) -> bool:
        self.abort_steps[request_id] = self.steps
        return super().abort(request_id, index)


def test_real_engine_stops_a_disconnected_stream_within_one_step(tiny_dir):
    engine = RecordingEngine(gem4.load(tiny_dir, dtype="float32"), gem4.Tokenizer.from_file(tiny_dir),
                             max_model_len=MAX_MODEL_LEN)
    with InProcessServer(create_app(ServerConfig(served_model_name="tiny"), engine)) as base:
        body = {"model": "tiny", "messages": user("Go on"), "stream": True, "max_tokens": 400, "ignore_eos": True}
        with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            for _ in range(8):
                next(lines)
        wait_for(lambda: len(engine.abort_steps) == 1)
        wait_for(engine.idle)
        ((_, at_abort),) = engine.abort_steps.items()
        assert engine.steps - at_abort <= 1, (engine.steps, at_abort)
        assert engine.steps < 100
        r = client_for(base).chat.completions.create(model="tiny", messages=user("Next"), max_tokens=3,
                                                     extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 3


class SteppedEngine(gem4.Engine):
    """gem4.Engine whose steps each wait for a permit (`permits`), so a test can look at it between steps;
    `at_gate` counts the steps that reached the gate (the engine is still there until a permit comes)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.permits = threading.Semaphore(0)
        self.at_gate = 0
        self.free = False

    def _step(self):
        self.at_gate += 1
        if not self.free:
            self.permits.acquire()
        super()._step()


def scrape(base: str) -> dict[str, float]:
    """One /metrics scrape: {sample name with its labels other than model_name: value}."""
    out = {}
    for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[re.sub(r',?model_name="[^"]*"', "", key).replace("{}", "")] = float(value)
    return out


def test_engine_metrics_with_a_pool_small_enough_to_preempt(tiny_dir):
    """The engine's own families on a real engine: the running / waiting counts are the scheduler's (not the
    estimate), the KV usage is the pool's and falls back to 0 when idle, preemptions are counted, and both
    per-step histograms observe every step once."""
    model = gem4.load(tiny_dir, dtype="float32")
    size = kv_pool_size(model.config, model.dtype, max_chunk=8, num_seqs=4, max_model_len=64, prefix_caching=True)
    engine = SteppedEngine(model, gem4.Tokenizer.from_file(tiny_dir), prefill_chunk=8, max_num_seqs=4,
                           max_model_len=64,
                           kv_cache_bytes=size.num_sliding_blocks * size.sliding_block_bytes + 6 * size.block_bytes)
    assert engine.pool_size.num_blocks == 6                 # 96 positions for 4 requests of 6 + 40 tokens
    app = create_app(ServerConfig(served_model_name="tiny", max_num_seqs=4), engine)
    usage: list[int] = []

    def complete(i: int) -> None:
        body = {"prompt": [10 + i, 20, 30 + i, 40, 50 + i, 60], "max_tokens": 40, "temperature": 0, "ignore_eos": True}
        r = httpx.post(base + "/v1/completions", json=body, timeout=120)
        usage.append(r.json()["usage"]["completion_tokens"])

    with InProcessServer(app) as base:
        m = scrape(base)
        assert (m["gem4:kv_cache_usage_perc"], m["gem4:num_preemptions_total"], m["gem4:iteration_tokens_total_count"],
                m["gem4:iteration_seqs_total_count"]) == (0, 0, 0, 0)
        threads = [threading.Thread(target=complete, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        try:
            wait_for(lambda: engine.request_counts() == (0, 4), timeout=30)    # all in, the first step held
            m = scrape(base)
            assert (m["gem4:num_requests_running"], m["gem4:num_requests_waiting"]) == (0, 4)   # estimate: (4, 0)
            seen_usage = 0.0
            for _ in range(12):                              # one step at a time, looking between steps
                reached = engine.at_gate
                engine.permits.release()
                wait_for(lambda: engine.at_gate > reached, timeout=30)
                m = scrape(base)
                assert (m["gem4:num_requests_running"], m["gem4:num_requests_waiting"]) == engine.request_counts()
                assert m["gem4:kv_cache_usage_perc"] == engine.kv_cache_usage
                assert m["gem4:iteration_seqs_total_count"] == m["gem4:iteration_tokens_total_count"] == engine.steps
                seen_usage = max(seen_usage, m["gem4:kv_cache_usage_perc"])
            assert 0 < seen_usage <= 1
        finally:
            engine.free = True
            engine.permits.release()
            for t in threads:
                t.join(120)
        assert usage == [40] * 4
        wait_for(engine.idle)
        m = scrape(base)
        assert m["gem4:kv_cache_usage_perc"] == 0
        assert (m["gem4:num_requests_running"], m["gem4:num_requests_waiting"]) == (0, 0)
        assert m["gem4:num_preemptions_total"] == engine.num_preemptions > 0
        steps = engine.steps
        assert m["gem4:iteration_tokens_total_count"] == m["gem4:iteration_seqs_total_count"] == steps
        assert m['gem4:iteration_seqs_total_bucket{le="4.0"}'] == steps              # never above max_num_seqs
        assert m['gem4:iteration_seqs_total_bucket{le="1.0"}'] < steps               # some steps ran several
        assert m["gem4:iteration_seqs_total_sum"] == sum(k * n for k, n in engine.batch_sizes.items())
        assert m['gem4:iteration_tokens_total_bucket{le="8.0"}'] == steps            # the step budget: 8 tokens
        # every prompt token and every generated one but each request's last ran once, and the tokens of
        # preempted sequences that the prefix cache no longer held when they came back ran again
        ran = m["gem4:iteration_tokens_total_sum"]
        assert ran == sum(k * n for k, n in engine.step_tokens.items())
        assert ran >= m["gem4:prompt_tokens_total"] + m["gem4:generation_tokens_total"] - 4
        # the four prompts differ from their first token: 24 prompt tokens looked up, none found
        assert (m["gem4:prefix_cache_queries_total"], m["gem4:prefix_cache_hits_total"]) == (24, 0)


def test_serve_demo(tmp_path):
    """`gem4 serve --demo`: the tiny random demo checkpoint (built into a private cache), no key needed."""
    with gem4_serve(["--demo", "--dtype", "float32"], tmp_path / "stderr.txt",
                    env={"GEM4_CACHE": str(tmp_path / "cache")}) as url:
        client = client_for(url, key="unused")
        assert [m.id for m in client.models.list().data] == ["gem4-demo"]
        r = client.chat.completions.create(model="gem4-demo", messages=user("Hello"), max_tokens=4,
                                           extra_body={"ignore_eos": True})
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4
    assert "RANDOM weights" in (tmp_path / "stderr.txt").read_text()


def test_serve_a_gguf_by_its_names_with_a_summary_and_request_log(tiny_dir, tmp_path):
    """A GGUF is served as its file stem and its file name (plus MODEL as typed); one startup summary line
    comes before the ready line and nothing claims readiness earlier; each request gets a log line, and
    traffic gets a periodic throughput line."""
    from gem4.weights.checkpoint import open_checkpoint
    from gem4.weights.gguf_model import write_gguf

    model = tmp_path / "tiny-q8_0.gguf"
    write_gguf(open_checkpoint(tiny_dir), model, "q8_0")
    log = tmp_path / "stderr.txt"
    with gem4_serve([str(model), "--dtype", "float32", "--log-interval", "0.5", "--max-num-seqs", "2"], log) as url:
        assert httpx.get(url + "/health").status_code == 200        # ready means ready
        client = client_for(url, key="unused")
        assert [m.id for m in client.models.list().data] == ["tiny-q8_0"]
        for name in ("tiny-q8_0", "tiny-q8_0.gguf", str(model)):
            r = client.completions.create(model=name, prompt="Hello", max_tokens=3, extra_body={"ignore_eos": True})
            assert r.model == "tiny-q8_0" and r.usage.completion_tokens == 3
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="tiny", prompt="Hello", max_tokens=3)
        wait_for(lambda: "Avg generation throughput" in log.read_text())
    text = log.read_text()
    assert "Uvicorn running on" not in text and "Application startup complete" not in text
    (summary,) = [line for line in text.splitlines() if line.startswith("gem4: model ")]
    assert re.fullmatch(r"gem4: model tiny-q8_0: Gemma 4 dense, \d+ layers, float32, compiled kernels off, \d+ threads, "
                        r"max_model_len \d+, KV cache [\d.]+ GiB \(\d+ tokens, 2 sequences\), prefix caching on",
                        summary), summary
    requests = re.findall(r"request cmpl-\w+: prompt (\d+) tokens \((\d+) cached\), output (\d+) tokens, "
                          r"TTFT \d+ ms, decode [\d.]+ tok/s, finish length", text)
    assert len(requests) == 3 and all(out == "3" for _, _, out in requests)
    assert [int(cached) for _, cached, _ in requests] == [0] + [int(requests[0][0]) - 1] * 2   # the same prompt
    assert re.search(r"Avg prompt throughput: [\d.]+ tokens/s, Avg generation throughput: [\d.]+ tokens/s, "
                     r"Running: \d+ reqs, Waiting: \d+ reqs", text)


def test_model_ids_of_a_file_a_directory_and_a_hub_name(tmp_path):
    from gem4.argtypes import ArgParser
    from gem4.server.main import add_arguments, model_ids

    parser = ArgParser()
    add_arguments(parser)
    (tmp_path / "m-q4_0.gguf").write_bytes(b"GGUF")
    (tmp_path / "hf").mkdir()
    for model, want in ((str(tmp_path / "m-q4_0.gguf"), ["m-q4_0", "m-q4_0.gguf", str(tmp_path / "m-q4_0.gguf")]),
                        (str(tmp_path / "hf") + "/", ["hf", str(tmp_path / "hf") + "/"]),
                        ("owner/repo-GGUF:Q4_K_M", ["owner/repo-GGUF:Q4_K_M"])):
        assert model_ids(parser.parse_args([model]), model) == want
    assert model_ids(parser.parse_args(["owner/r", "--served-model-name", "a", "b"]), "owner/r") == ["a", "b", "owner/r"]


def test_speculative_decoding_serves_the_plain_text_and_counts_drafts(tiny_dir):
    """--speculative-config through the server: the same greedy text as without it, and vLLM's spec_decode
    families on /metrics (one per draft position)."""
    model = gem4.load(tiny_dir, dtype="float32")
    tok = gem4.Tokenizer.from_file(tiny_dir)
    config = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    body = {"prompt": "one two three one two three one two three", "max_tokens": 24, "temperature": 0}
    texts, metrics = [], []
    for spec in (None, config):
        app = create_app(ServerConfig(served_model_name="tiny"), gem4.Engine(model, tok, speculative_config=spec))
        with InProcessServer(app) as base:
            texts.append(httpx.post(base + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"])
            metrics.append(scrape(base))
    assert texts[0] == texts[1]
    assert "gem4:spec_decode_num_drafts_total" not in metrics[0]
    m = metrics[1]
    assert m["gem4:spec_decode_num_drafts_total"] > 0
    assert m["gem4:spec_decode_num_draft_tokens_total"] >= m["gem4:spec_decode_num_accepted_tokens_total"]
    per_pos = [next(v for k, v in m.items() if k.startswith("gem4:spec_decode_num_accepted_tokens_per_pos_total")
                    and f'position="{i}"' in k) for i in range(3)]
    assert sum(per_pos) == m["gem4:spec_decode_num_accepted_tokens_total"] and per_pos == sorted(per_pos, reverse=True)
