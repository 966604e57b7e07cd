"""What the server tests share (test_server_app.py, test_server_e2e.py, test_soak.py): the official `openai`
client and raw HTTP on 127.0.0.1 only, SSE and OpenAI error checks, the app in-process (uvicorn in a thread),
raw socket exchanges, and `gem4 serve` as a subprocess on the tiny real checkpoint (the `tiny_dir` fixture:
a test module imports it to use it)."""
from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import shutil
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
from text_fixtures import tiny_tokenizer_dir


API_KEY = "test-key"
HOST = "127.0.0.1"          # loopback only, always


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


def wait_for(cond, timeout: float = 10.0) -> None:
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, "condition not reached in time"
        time.sleep(0.01)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# ---------------------------------------------------------------------------------------------
# Raw sockets: what the server does before or without a complete request
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


@contextlib.contextmanager
def serve_checkpoint(directory, name: str, max_model_len: int, **config):
    """A float32 gem4 model loaded from an HF `directory` (with its tokenizer), served in-process under `name` with
    the API key and thinking off (`config`: more ServerConfig fields). Yields (base URL, model, tokenizer)."""
    import gem4
    from gem4.server import ServerConfig, create_app

    model = gem4.load(directory, dtype="float32")
    tok = gem4.Tokenizer.from_file(directory)
    engine = gem4.Engine(model, tok, max_model_len=max_model_len, prefill_chunk=512, block_size=4)
    app = create_app(ServerConfig(served_model_name=name, api_key=API_KEY,
                                  default_chat_template_kwargs={"enable_thinking": False}, **config), engine)
    with InProcessServer(app) as base:
        yield base, model, tok
