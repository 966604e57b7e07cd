"""Soak (issue 12): valid streams beside every kind of bad request, on `gem4 serve`, for a bounded time.

Every valid request must come back with exactly the text it gets alone, every bad one with a 4xx
OpenAI error (or, for a connection that never sends its request, a closed connection), the server must
stay healthy, and its resident memory must come back to where it was before the soak.
"""
from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import httpx

from server_helpers import API_KEY, client_for, gem4_serve_process, tiny_dir, user  # noqa: F401  (tiny_dir: a fixture)

SOAK_SECONDS = 20.0
BODY_MIB = 1                 # --max-request-body-mb
HEADER_TIMEOUT = 1.0         # --header-timeout


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def valid_request(i: int) -> dict:
    return dict(model="soak", messages=user(f"Soak client {i} says hello"), max_tokens=12, seed=1000 + i,
                temperature=1.0, extra_body={"ignore_eos": True})


# (what is wrong, a body, the expected status); each is sent with the API key unless it is about the key
BAD = [
    ("top_k beyond int64", {"model": "soak", "messages": user("x"), "top_k": 9223372036854775808}, 400),
    ("top_k 1e30", {"model": "soak", "messages": user("x"), "top_k": 1e30}, 400),
    ("temperature NaN", '{"model": "soak", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}', 400),
    ("tiny repetition penalty with logprobs", {"model": "soak", "messages": user("x"), "max_tokens": 3,
                                               "repetition_penalty": 1e-300, "logprobs": True}, 200),
    ("logit_bias superscript key", {"model": "soak", "messages": user("x"), "logit_bias": {"²": 1}}, 400),
    ("logit_bias Arabic digit", {"model": "soak", "messages": user("x"), "logit_bias": {"٣": 1}}, 400),
    ("logit_bias 5000 digits", {"model": "soak", "messages": user("x"), "logit_bias": {"9" * 5000: 1}}, 400),
    ("seed 2^64", {"model": "soak", "messages": user("x"), "seed": 2**64}, 400),
    ("unknown model", {"model": "nope", "messages": user("x")}, 404),
    ("no messages", {"model": "soak"}, 400),
    ("not JSON", "{this is not json", 400),
    ("prompt too long for the context", {"model": "soak", "prompt": "word " * 20000}, 400),
    ("body over the limit", {"model": "soak", "prompt": "x" * (BODY_MIB * 2**20 + 10)}, 413),
]


def send_bad(base: str, what: str, body, status: int) -> None:
    data = body if isinstance(body, str) else json.dumps(body)
    path = "/v1/completions" if isinstance(body, dict) and "prompt" in body else "/v1/chat/completions"
    r = httpx.post(base + path, content=data.encode(), timeout=30,
                   headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
    assert r.status_code == status, (what, r.status_code, r.text[:200])
    if status != 200:
        assert r.json()["error"]["message"], what
    else:
        r.json()                                        # valid JSON: no NaN reached the wire


def silent_connection(base: str) -> None:
    """Open a connection, say nothing: the server closes it after its header timeout."""
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=HEADER_TIMEOUT * 10) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")      # headers never finished
        assert s.recv(4096) is not None                                        # closed (408 or EOF) in time


def test_valid_requests_are_unhurt_by_bad_ones_and_memory_comes_back(tiny_dir, tmp_path):
    log = tmp_path / "stderr.txt"
    args = [str(tiny_dir), "--dtype", "float32", "--api-key", API_KEY, "--served-model-name", "soak",
            "--max-num-seqs", "4", "--max-model-len", "256", "--max-request-body-mb", str(BODY_MIB),
            "--header-timeout", str(HEADER_TIMEOUT), "--log-level", "warning"]
    with gem4_serve_process(args, log) as (base, proc):
        pid = proc.pid
        client = client_for(base)
        alone = {i: client.chat.completions.create(**valid_request(i)).choices[0].message.content for i in range(6)}
        for what, body, status in BAD:                                       # every kind once, then measure
            send_bad(base, what, body, status)
        before = rss_bytes(pid)

        failures: list = []
        counts = {"valid": 0, "bad": 0, "silent": 0}
        stop = time.monotonic() + SOAK_SECONDS

        def valid_worker(k: int) -> None:
            c = client_for(base)
            i = k
            while time.monotonic() < stop:
                try:
                    chunks = list(c.chat.completions.create(**valid_request(i % 6), stream=True))
                    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
                    if text != alone[i % 6]:
                        failures.append(("valid text differs", i % 6))
                    counts["valid"] += 1
                except Exception as e:  # noqa: BLE001 - collected, asserted below
                    failures.append(("valid request failed", repr(e)))
                i += 1

        def bad_worker(k: int) -> None:
            i = k
            while time.monotonic() < stop:
                what, body, status = BAD[i % len(BAD)]
                try:
                    send_bad(base, what, body, status)
                    counts["bad"] += 1
                except Exception as e:  # noqa: BLE001
                    failures.append(("bad request", what, repr(e)))
                i += 1

        def silent_worker() -> None:
            while time.monotonic() < stop:
                try:
                    silent_connection(base)
                    counts["silent"] += 1
                except Exception as e:  # noqa: BLE001
                    failures.append(("silent connection", repr(e)))

        threads = ([threading.Thread(target=valid_worker, args=(k,)) for k in range(4)]
                   + [threading.Thread(target=bad_worker, args=(k,)) for k in range(2)]
                   + [threading.Thread(target=silent_worker)])
        for t in threads:
            t.start()
        for t in threads:
            t.join(SOAK_SECONDS + 120)
        assert not failures, failures[:5]
        assert counts["valid"] >= 8 and counts["bad"] >= len(BAD) and counts["silent"] >= 2, counts
        assert httpx.get(base + "/health").json() == {"status": "ok"}
        time.sleep(1.0)
        after = rss_bytes(pid)
        print(f"soak: {counts}, RSS {before / 2**20:.0f} MiB before, {after / 2**20:.0f} MiB after")
        assert after <= before * 1.1 + 32 * 2**20, (before, after)
