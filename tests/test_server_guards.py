"""What one client cannot take from the others (issue 34): connections held by clients that never read
(the write timeout), a shutdown that waits for them (the shutdown timeout), malformed HTTP, large
token lists on the event loop, and who may read /metrics.

The write and shutdown timeouts run `gem4 serve` on the tiny real checkpoint (`tiny_dir`), as a
subprocess, with raw sockets that never read: their receive buffer is made small before they
connect, and the replies carry 20 top logprobs a token, so the kernel's buffers (a couple of MiB on
loopback) fill within seconds and the server's own buffer has bytes that cannot be sent. The rest
runs the app in-process over the scripted engine of test_server_app.py.
"""
from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from server_helpers import (  # noqa: F401  (tiny_dir: a fixture)
    InProcessServer,
    assert_openai_error,
    gem4_serve,
    gem4_serve_process,
    metric,
    raw_exchange,
    raw_response,
    tiny_dir,
    user,
    wait_for,
)
from test_server_app import ScriptedEngine

from gem4.server import ServerConfig, create_app
from gem4.server.http11 import guarded_protocol

WRITE_TIMEOUT = 1.0
SHUTDOWN_TIMEOUT = 1.0
TOP_LOGPROBS = {"logprobs": True, "top_logprobs": 20}     # about 1 KB of reply per token


def non_reading(base: str, path: str, body: dict) -> socket.socket:
    """A connection that sends one request and never reads: its receive buffer is set as small as the
    kernel allows before it connects, so the window it offers is closed after a few hundred bytes."""
    host, port = base.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    sock.connect((host, int(port)))
    data = json.dumps(body).encode()
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def health(base: str) -> int:
    try:
        return httpx.get(base + "/health", timeout=10).status_code
    except httpx.TransportError:          # refused over the cap: the 503 may race the close
        return 503


# ---------------------------------------------------------------------------------------------
# The write timeout and the shutdown bound, on `gem4 serve`
# ---------------------------------------------------------------------------------------------


def test_clients_that_do_not_read_are_cut_after_the_write_timeout(tiny_dir, tmp_path):
    """Under --max-connections 2, two streams whose clients never read hold both connections (/health gets
    503) until the write timeout aborts them; their engine requests are aborted (running back to 0, far fewer
    tokens generated than asked), and /health answers again. The same for two whole replies that were
    generated to the end but cannot be sent. A client that reads its long stream is not cut."""
    log = tmp_path / "log.txt"
    max_tokens, n = 4000, 8                      # 8 choices: the buffers fill 8 times sooner than with one
    with gem4_serve([str(tiny_dir), "--dtype", "float32", "--max-connections", "2", "--max-num-seqs", "16",
                     "--write-timeout", str(WRITE_TIMEOUT)], log) as url:
        stream = {"messages": user("Go on"), "stream": True, "max_tokens": max_tokens, "ignore_eos": True, "n": n,
                  **TOP_LOGPROBS}
        socks = [non_reading(url, "/v1/chat/completions", stream) for _ in range(2)]
        try:
            wait_for(lambda: health(url) == 503, timeout=10)      # both slots held
            # each is cut once the kernel's buffers (1.5 to 4 MB on loopback) are full and 1 s has passed
            wait_for(lambda: log.read_text().count("write timeout") == 2, timeout=120)
            assert health(url) == 200
            wait_for(lambda: metric(url, "gem4:num_requests_running") == 0, timeout=10)
            assert metric(url, "gem4:generation_tokens_total") < 2 * n * max_tokens   # both cut before the end
        finally:
            for s in socks:
                s.close()
        text = log.read_text()
        assert text.count("write timeout") == 2 and text.count("finish abort") == 2, text

        # generated to the end (finish length), ~4 MB each, and nobody reads it
        whole = {"messages": user("Go on"), "max_tokens": 1000, "ignore_eos": True, "n": 4, **TOP_LOGPROBS}
        socks = [non_reading(url, "/v1/chat/completions", whole) for _ in range(2)]
        try:
            wait_for(lambda: health(url) == 503, timeout=10)
            wait_for(lambda: log.read_text().count("finish length") == 2, timeout=120)
            wait_for(lambda: log.read_text().count("write timeout") == 4, timeout=60)
            assert health(url) == 200
        finally:
            for s in socks:
                s.close()
        text = log.read_text()
        assert text.count("write timeout") == 4, text
        assert text.rindex("finish length") < text.rindex("write timeout")    # cut after it was generated

        # a client that reads gets its whole stream, megabytes past what the kernel buffers
        with httpx.stream("POST", url + "/v1/chat/completions", timeout=120,
                          json={**stream, "max_tokens": 2000, "n": 1}) as r:
            lines = [line for line in r.iter_lines() if line]
        assert lines[-1] == "data: [DONE]" and sum(map(len, lines)) > 2 * 2**20
        assert '"finish_reason":"length"' in lines[-2] or '"finish_reason":"length"' in lines[-3]
        assert log.read_text().count("write timeout") == 4


def test_sigterm_with_clients_that_do_not_read_exits_within_the_shutdown_timeout(tiny_dir, tmp_path):
    """SIGTERM while two clients do not read: a stream (ended by the shutdown, with nobody to read its end)
    and a whole reply generated to the end whose megabytes cannot be sent. Their connections cannot be
    flushed, so the server waits --shutdown-timeout for them, aborts them and exits 0: no sooner, and
    not much later."""
    log = tmp_path / "log.txt"
    with gem4_serve_process([str(tiny_dir), "--dtype", "float32", "--shutdown-timeout", str(SHUTDOWN_TIMEOUT),
                             "--write-timeout", "600"], log) as (url, proc):
        stream = non_reading(url, "/v1/chat/completions", {"messages": user("Go on"), "stream": True,
                                                            "max_tokens": 4000, "ignore_eos": True, **TOP_LOGPROBS})
        whole = non_reading(url, "/v1/chat/completions", {"messages": user("Go on"), "max_tokens": 1000, "n": 4,
                                                           "ignore_eos": True, **TOP_LOGPROBS})
        try:
            wait_for(lambda: "finish length" in log.read_text(), timeout=120)     # the whole reply, ~4 MB ...
            assert health(url) == 200              # ... built and written (the loop that builds it answers this)
            start = time.perf_counter()
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == 0, log.read_text()
            elapsed = time.perf_counter() - start
        finally:
            stream.close()
            whole.close()
    text = log.read_text()
    assert SHUTDOWN_TIMEOUT <= elapsed < SHUTDOWN_TIMEOUT + 8, (elapsed, text)     # + the engine's and Python's end
    assert "stopped 1 running request" in text
    assert re.search(rf"aborted [12] connections? that did not close within {SHUTDOWN_TIMEOUT:g} s", text), text
    assert "Traceback" not in text


# ---------------------------------------------------------------------------------------------
# In process, over the scripted engine
# ---------------------------------------------------------------------------------------------


def guarded(app, **kwargs) -> InProcessServer:
    settings = {"header_timeout": 30.0, "body_timeout": 30.0, "max_connections": None, **kwargs}
    return InProcessServer(app, http=guarded_protocol(**settings))


MALFORMED = [
    # (what is wrong, the raw request, the status h11 suggests)
    ("not a request line", b"GARBAGE\r\n\r\n", 400),
    ("a header line without a colon", b"GET /health HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n", 400),
    ("a 5000-byte header line without a colon", b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"x" * 5000 + b"\r\n\r\n",
     400),
    ("no Host header in HTTP/1.1", b"GET /health HTTP/1.1\r\n\r\n", 400),
    ("a space before the colon", b"GET /health HTTP/1.1\r\nHost : x\r\n\r\n", 400),
    ("a bad Content-Length", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n", 400),
    ("headers past 16 KiB, unfinished", b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20000, 431),
    ("an unsupported Transfer-Encoding", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n",
     501),
]


@pytest.mark.parametrize("what, data, status", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_http_gets_an_openai_error_object(what, data, status):
    app = create_app(ServerConfig(served_model_name="m"), ScriptedEngine())
    with guarded(app) as base:
        got, closed_after = raw_exchange(base, data)
        assert closed_after is not None, got                        # answered and closed
        code, headers, payload = raw_response(got)
        assert (code, headers["content-type"], headers["connection"]) == (status, "application/json", "close"), got
        err = payload["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["code"] == "invalid_http_request" and err["message"].startswith("Invalid HTTP request: "), err
        assert len(err["message"]) < 300                            # h11 quotes the bad line: not all of it
        assert httpx.get(base + "/health").status_code == 200


def test_detokenize_and_tokenize_leave_the_event_loop_free():
    """A 1M-id /detokenize decodes in the thread pool: the longest stall of the server's event loop while it
    runs is no longer (+50 %, +20 ms) than while the same body is only parsed and refused (unknown model),
    whereas decoding it on the loop (what it did) holds it several times longer. The results are the same
    as the tokenizer's own."""
    engine = ScriptedEngine()
    app = create_app(ServerConfig(served_model_name="m", max_request_body=64 * 2**20), engine)
    tok = engine.tokenizer
    ids = [i % tok.vocab_size for i in range(1_000_000)]
    body = json.dumps({"tokens": ids}).encode()
    refused = json.dumps({"tokens": ids, "model": "other"}).encode()
    loops: list[asyncio.AbstractEventLoop] = []

    @app.get("/test-loop")                        # the server's event loop, for the stall watcher
    async def _loop():
        loops.append(asyncio.get_running_loop())
        return {}

    with InProcessServer(app) as base:
        httpx.get(base + "/test-loop")
        loop = loops[0]

        def longest_stall(content: bytes) -> tuple[float, httpx.Response]:
            longest = [0.0]
            done = threading.Event()

            async def watch():
                while not done.is_set():
                    t = loop.time()
                    await asyncio.sleep(0.001)
                    longest[0] = max(longest[0], loop.time() - t - 0.001)

            watcher = asyncio.run_coroutine_threadsafe(watch(), loop)
            time.sleep(0.05)
            r = httpx.post(base + "/detokenize", content=content, headers={"Content-Type": "application/json"},
                           timeout=60)
            time.sleep(0.05)
            done.set()
            watcher.result(timeout=10)
            return longest[0], r

        base_stalls, stalls = [], []
        for _ in range(5):                        # interleaved, medians
            s, r = longest_stall(refused)
            assert r.status_code == 404
            base_stalls.append(s)
            s, r = longest_stall(body)
            assert r.status_code == 200 and r.json() == {"prompt": tok.decode(ids)}
            stalls.append(s)
        t = time.perf_counter()
        tok.decode(ids)
        decode_s = time.perf_counter() - t
        baseline, got = statistics.median(base_stalls), statistics.median(stalls)
        assert got <= 1.5 * baseline + 0.02, (got, baseline, decode_s)

        # /tokenize's reply (ids and their strings) is built off the loop too, and reads as before
        r = httpx.post(base + "/tokenize", json={"prompt": "Hello world", "return_token_strs": True})
        want = tok.encode("Hello world", add_bos=True, parse_special=True)
        assert r.json() == {"count": len(want), "max_model_len": engine.max_model_len, "tokens": want,
                            "token_strs": [tok.id_to_piece(i) for i in want]}
        assert_openai_error(httpx.post(base + "/detokenize", json={"tokens": [0, tok.vocab_size]}), 400,
                            param="tokens")


def test_metrics_is_open_unless_it_has_its_own_key():
    """/metrics is open under --api-key (as vLLM's), and takes --metrics-api-key when one is set; the API
    key still guards the rest and is not the metrics key."""
    open_metrics = create_app(ServerConfig(served_model_name="m", api_key="k"), ScriptedEngine())
    with InProcessServer(open_metrics) as base:
        assert httpx.get(base + "/metrics").status_code == 200
        assert_openai_error(httpx.get(base + "/v1/models"), 401, code="invalid_api_key")
    keyed = create_app(ServerConfig(served_model_name="m", api_key="k", metrics_api_key="mk"), ScriptedEngine())
    with InProcessServer(keyed) as base:
        assert_openai_error(httpx.get(base + "/metrics"), 401, code="invalid_api_key")
        assert_openai_error(httpx.get(base + "/metrics", headers={"Authorization": "Bearer k"}), 401,
                            code="invalid_api_key")
        r = httpx.get(base + "/metrics", headers={"Authorization": "Bearer mk"})
        assert r.status_code == 200 and "gem4:num_requests_running" in r.text
        assert httpx.get(base + "/v1/models", headers={"Authorization": "Bearer k"}).status_code == 200
        assert_openai_error(httpx.get(base + "/v1/models", headers={"Authorization": "Bearer mk"}), 401)
        assert httpx.get(base + "/health").status_code == 200


def test_serve_options_for_the_guards():
    from gem4.argtypes import ArgParser
    from gem4.server.main import add_arguments

    parser = ArgParser()
    add_arguments(parser)
    args = parser.parse_args(["m"])
    assert (args.write_timeout, args.shutdown_timeout, args.metrics_api_key) == (30.0, 2.0, None)
    args = parser.parse_args(["m", "--write-timeout", "5", "--shutdown-timeout", "0.5", "--metrics-api-key", "mk"])
    assert (args.write_timeout, args.shutdown_timeout, args.metrics_api_key) == (5.0, 0.5, "mk")


def test_a_token_id_prompt_is_echoed_as_its_text():
    """/v1/completions with a token-id prompt and `echo` (the prompt decoded in the thread pool)."""
    engine = ScriptedEngine()
    app = create_app(ServerConfig(served_model_name="m"), engine)
    ids = engine.tokenizer.encode("Say PLAIN please", add_bos=True)
    with InProcessServer(app) as base:
        plain = httpx.post(base + "/v1/completions", json={"prompt": ids, "max_tokens": 50}).json()
        echoed = httpx.post(base + "/v1/completions", json={"prompt": ids, "max_tokens": 50, "echo": True}).json()
    assert plain["choices"][0]["text"]
    assert echoed["choices"][0]["text"] == engine.tokenizer.decode(ids) + plain["choices"][0]["text"]
