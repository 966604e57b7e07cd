"""The OpenAI-compatible server on a tiny real checkpoint, tested with the official `openai` client on
127.0.0.1 only.

`gem4 serve` runs as a subprocess on the `dense_plain` fixture model with the 512-token real-vocab
tokenizer and the official chat template copied beside it (`tiny_dir`). Its output is random text,
so correctness is checked against an in-process `gem4.Engine` + output parser on the same
checkpoint (the oracle), and against the server itself (stream == non-stream, concurrent ==
sequential). A few tests run the app in-process over a real `gem4.Engine` instead, where they need
the engine itself (its step count between steps, its metrics, speculative decoding).
"""
from __future__ import annotations

import json
import re
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

sys.path.insert(0, str(Path(__file__).parent))
from server_helpers import (  # noqa: F401  (tiny_dir: a fixture)
    API_KEY,
    HOST,
    InProcessServer,
    accumulate,
    assert_openai_error,
    client_for,
    gem4_serve,
    gem4_serve_process,
    metric,
    raw_exchange,
    raw_response,
    request_head,
    sse_data,
    sse_lines,
    tiny_dir,
    user,
    wait_for,
)
from text_fixtures import tiny_tokenizer

import gem4
from gem4.chat import encode_prompt
from gem4.engine.pool import kv_pool_size
from gem4.parser import Gemma4Parser
from gem4.sampling import SamplingParams
from gem4.server import ServerConfig, create_app

MAX_MODEL_LEN = 512


# ---------------------------------------------------------------------------------------------
# `gem4 serve` on a tiny real checkpoint, as a subprocess
# ---------------------------------------------------------------------------------------------


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
        {"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}}]}]}, None, 400,
     "messages[0].content[0]", None),
    ("bad tool schema", "/v1/chat/completions", {**OK_CHAT, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "string"}}}]}, None, 400, "tools[0].function.parameters", None),
    ("bad tool name", "/v1/chat/completions", {**OK_CHAT, "tools": [{"type": "function", "function": {
        "name": "my tool"}}]}, None, 400, "tools[0].function.name", None),
    ("tool_choice required without tools", "/v1/chat/completions", {**OK_CHAT, "tool_choice": "required"}, None,
     400, "tool_choice", None),
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
                   "gem4:iteration_seqs_total_count", "gem4:request_success_total", "gem4:request_rejected_total",
                   "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                   "vllm:cache_config_info"):
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
        for prefix in ("gem4", "vllm"):        # the block size llm-d's endpoint picker reads
            assert m[f'{prefix}:cache_config_info{{block_size="16",enable_prefix_caching="True",num_gpu_blocks="6"}}'] == 1
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
                for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
                    assert m["vllm:" + name] == m["gem4:" + name], name      # vLLM's names, the same values
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
    traffic gets a periodic throughput line. The summary names the KV cache's dtype (--kv-cache-dtype int8 here:
    its prefix cache is reused as a bf16 one is)."""
    from gem4.weights.checkpoint import open_checkpoint
    from gem4.weights.gguf_model import write_gguf

    model = tmp_path / "tiny-q8_0.gguf"
    write_gguf(open_checkpoint(tiny_dir), model, "q8_0")
    log = tmp_path / "stderr.txt"
    with gem4_serve([str(model), "--dtype", "float32", "--log-interval", "0.5", "--max-num-seqs", "2",
                     "--kv-cache-dtype", "int8"], log) as url:
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
                        r"max_model_len \d+, KV cache [\d.]+ GiB int8 \(\d+ tokens, 2 sequences\), prefix caching on",
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
