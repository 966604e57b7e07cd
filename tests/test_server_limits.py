"""What a chat request may cost the server, on the demo checkpoint in-process (127.0.0.1 only): the turns
bound refuses thousands of messages before they render, the render budget stops what it lets through,
a client that leaves stops its render, and hostile tools are refused (server/inputs.py, server/protocol.py).

The demo model's context is 8192 tokens (`gem4 serve --demo`), the one these limits are derived from.
"""
from __future__ import annotations

import json
import socket
import statistics
import threading
import time
from pathlib import Path

import httpx
import pytest

from gem4 import Engine, load
from gem4.demo import DEMO_VERSION, ensure_demo
from gem4.paths import cache_root
from gem4.server import ServerConfig, create_app
from gem4.tokenizer import Tokenizer
from server_helpers import HOST, InProcessServer, assert_openai_error, gem4_serve, raw_response

DEMO_CONTEXT = 8192


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """A private GEM4_CACHE with the demo checkpoint built in it, and this session's compiled kernels
    linked in (`gem4 serve` would otherwise build them again: minutes)."""
    cache = tmp_path_factory.mktemp("gem4-cache")
    kernels = cache_root() / "kernels"
    kernels.mkdir(parents=True, exist_ok=True)
    (cache / "kernels").symlink_to(kernels, target_is_directory=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GEM4_CACHE", str(cache))
        assert ensure_demo() == cache / f"demo-{DEMO_VERSION}"
    return cache


@pytest.fixture(scope="module")
def engine(cache):
    demo = cache / f"demo-{DEMO_VERSION}"
    with Engine(load(demo), Tokenizer.from_file(demo), max_num_seqs=4) as e:
        assert e.max_model_len == DEMO_CONTEXT
        assert e.tokenizer.chat_template is None or "<|turn>" in e.tokenizer.chat_template
        yield e


@pytest.fixture(scope="module")
def server(engine):
    """(base URL, app) with the default render budget (10 s)."""
    app = create_app(ServerConfig(served_model_name="demo", max_num_seqs=4), engine)
    with InProcessServer(app) as base:
        yield base, app


def chat_bytes(messages: list[dict], **extra) -> bytes:
    return json.dumps({"messages": messages, **extra}).encode()


def raw_post(base: str, body: bytes, path: str = "/v1/chat/completions") -> tuple[int, dict, float]:
    """POST a prepared body on a fresh connection (little client work: the attack is the server's cost):
    (status, JSON body, seconds until the whole response was read)."""
    host, port = base.removeprefix("http://").split(":")
    head = (f"POST {path} HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    start = time.perf_counter()
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(head + body)
        got = b""
        while chunk := sock.recv(65536):
            got += chunk
    took = time.perf_counter() - start
    status, _, payload = raw_response(got)
    return status, payload, took


MANY = chat_bytes([{"role": "user", "content": "a"}] * 4000)            # 136 KB; rendering it took a minute
# fits the context (1 + 5 + 2 * 3000 tokens) and renders for ~30 s: only the budget stops it
QUADRATIC = [{"role": "user", "content": "a"}] + [{"role": "assistant", "content": ""}] * 3000
NORMAL = {"model": "demo", "messages": [{"role": "user", "content": "Tell me a story about a lighthouse."}],
          "max_tokens": 96, "temperature": 0, "ignore_eos": True}


def test_thousands_of_messages_get_their_400_at_once_and_a_neighbour_is_not_delayed(server):
    """The issue's attack: 4,000 one-character messages. The turns bound refuses them (20,001 tokens at
    least) within 1 s, and a normal chat sent at the same moment takes at most 20 % longer than alone:
    medians over rounds in ABBA order (alone, beside, beside, alone, ...), so that the load of a busy
    machine drifting during the test weighs on both sides; a measurement spoilt by a burst of load
    elsewhere is taken again, up to three times (a real delay fails every one)."""
    base, _ = server
    assert len(MANY) > 130_000
    status, body, took = raw_post(base, MANY)
    assert status == 400 and took < 1.0, (status, took)
    err = body["error"]
    assert err["param"] == "messages" and err["code"] == "context_length_exceeded"
    assert "4000 messages" in err["message"] and "at least 20001 tokens" in err["message"]

    attacks = []
    with httpx.Client(timeout=60) as client:
        def normal(with_attack: bool) -> float:
            attack = threading.Thread(target=lambda: attacks.append(raw_post(base, MANY)))
            start = time.perf_counter()
            if with_attack:
                attack.start()
            r = client.post(base + "/v1/chat/completions", json=NORMAL)
            took = time.perf_counter() - start
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 96, r.text
            if with_attack:
                attack.join()
            return took

        normal(False)                                   # warm-up
        tries = []
        for _ in range(3):
            times: dict[bool, list[float]] = {False: [], True: []}
            for beside in [False, True, True, False] * 4:
                times[beside].append(normal(beside))
            alone, beside = statistics.median(times[False]), statistics.median(times[True])
            tries.append((round(alone, 3), round(beside, 3)))
            if beside <= 1.2 * alone:
                break
    # beside a running chat on 2 busy cores one may pass a second now and then: the median may not
    assert {a[0] for a in attacks} == {400} and statistics.median(a[2] for a in attacks) < 1.0, attacks
    assert tries[-1][1] <= 1.2 * tries[-1][0], f"(alone, beside) medians per try: {tries}"


def test_six_such_requests_at_once_are_all_answered_within_a_second(server):
    """The issue's six concurrent bodies once held every chat, completion and /tokenize for 20 s+; /tokenize
    takes the same bound (it leaves no room for output)."""
    base, _ = server
    results = []
    threads = [threading.Thread(target=lambda path=path: results.append(raw_post(base, MANY, path)))
               for path in ["/v1/chat/completions"] * 5 + ["/tokenize"]]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert time.perf_counter() - start < 1.5
    assert sorted(r[0] for r in results) == [400] * 6 and max(r[2] for r in results) < 1.0
    assert {r[1]["error"]["code"] for r in results} == {"context_length_exceeded"}
    r = httpx.post(base + "/tokenize", json={"prompt": "still here"}, timeout=10)
    assert r.status_code == 200 and r.json()["count"] > 0


def test_a_render_past_the_budget_gets_its_400(engine):
    """What the turns bound lets through is stopped by --max-render-seconds (here 0.5 s of CPU), and the
    server goes on serving."""
    app = create_app(ServerConfig(served_model_name="demo", max_num_seqs=4, max_render_s=0.5), engine)
    with InProcessServer(app) as base:
        status, body, took = raw_post(base, chat_bytes(QUADRATIC))
        err = body["error"]
        assert status == 400 and err["param"] == "messages" and err["code"] == "render_time_exceeded", body
        assert "0.5 s" in err["message"] and "--max-render-seconds" in err["message"]
        assert took < 5.0                               # 0.5 s of CPU, on a busy machine
        r = httpx.post(base + "/v1/chat/completions", json={**NORMAL, "max_tokens": 4}, timeout=60)
        assert r.status_code == 200


def test_serve_takes_the_render_budget_option(cache, tmp_path):
    """`gem4 serve --demo --max-render-seconds 0.3`: the option reaches the server."""
    with gem4_serve(["--demo", "--max-render-seconds", "0.3"], tmp_path / "serve.log",
                    env={"GEM4_CACHE": str(cache)}) as base:
        status, body, _ = raw_post(base, chat_bytes(QUADRATIC))
        assert status == 400 and body["error"]["code"] == "render_time_exceeded", body
        assert "(0.3 s, --max-render-seconds)" in body["error"]["message"]
        status, body, _ = raw_post(base, MANY)
        assert status == 400 and body["error"]["code"] == "context_length_exceeded", body


def render_cpu() -> float:
    """CPU seconds used so far by the server's render threads (this process: the server is in-process)."""
    return sum(time.clock_gettime(time.pthread_getcpuclockid(t.ident)) for t in threading.enumerate()
               if t.name.startswith("gem4-render") and t.ident is not None and t.is_alive())


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_mid_render_stops_the_render(engine, stream):
    """A render that would take ~30 s (under a 60 s budget) stops within half a second of its client
    closing the connection: the render threads' CPU time stops growing."""
    app = create_app(ServerConfig(served_model_name="demo", max_num_seqs=4, max_render_s=60), engine)
    with InProcessServer(app) as base:
        host, port = base.removeprefix("http://").split(":")
        body = chat_bytes(QUADRATIC, stream=stream)
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        before = render_cpu()
        sock = socket.create_connection((host, int(port)), timeout=30)
        sock.sendall(head + body)
        deadline = time.time() + 20
        while render_cpu() - before < 0.3:             # the render is well under way
            assert time.time() < deadline, "the render did not start"
            time.sleep(0.05)
        sock.close()
        time.sleep(0.5)
        settled = render_cpu()
        time.sleep(1.0)
        assert render_cpu() - settled < 0.05, "the render kept running after its client left"
        assert app.state.gem4.metrics.in_flight == 0
        r = httpx.post(base + "/v1/chat/completions", json={**NORMAL, "max_tokens": 4}, timeout=60)
        assert r.status_code == 200


def deep_schema(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


def tool(name: str, parameters: dict | None = None, description: str = "d") -> dict:
    fn: dict = {"name": name, "description": description}
    if parameters is not None:
        fn["parameters"] = parameters
    return {"type": "function", "function": fn}


def nested_arguments(levels: int) -> str:
    return '{"a":' * levels + "1" + "}" * levels


HOSTILE = [
    ({"tools": [tool(f"f{i}") for i in range(129)]}, "tools", "at most 128 tools"),
    ({"tools": [tool("f", {"type": "object", "properties": {"a": deep_schema(40)}})]},
     "tools[0].function.parameters", "at most 64 levels"),
    ({"tools": [tool("f", description="x" * 70_000)]}, "tools[0]", "at most 65536 bytes"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": nested_arguments(100)}}]}]},
     "messages[1].tool_calls[0].function.arguments", "at most 64 levels"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": nested_arguments(5000)}}]}]},
     "messages[1].tool_calls[0].function.arguments", "more than 64 deep"),
]


@pytest.mark.parametrize("fields,param,says", HOSTILE, ids=["many", "deep", "large", "deep_args", "deeper_args"])
def test_hostile_tools_are_refused(server, fields, param, says):
    base, _ = server
    body = {"model": "demo", "messages": [{"role": "user", "content": "x"}], **fields}
    r = httpx.post(base + "/v1/chat/completions", json=body, timeout=10)
    err = assert_openai_error(r, 400, param=param)
    assert says in err["message"], err


def test_tools_real_agents_send_are_accepted(server):
    """60 tools of a few KB each, schemas nested 10 levels: well inside the bounds."""
    base, _ = server
    params = {"type": "object",
              "properties": {"a": deep_schema(10), "b": {"type": "string", "description": "y" * 2000}}}
    tools = [tool(f"tool_{i}", params, description="z" * 1000) for i in range(60)]
    r = httpx.post(base + "/tokenize", json={"messages": [{"role": "user", "content": "x"}], "tools": tools},
                   timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["count"] > 60 * 100
