"""Replicas of `gem4 serve` behind SMG, the cache-aware router (docs/replicas.md), on 127.0.0.1 only.

Two set-ups, both with the demo model:
- the multi-host recipe on one host: two `gem4 serve --demo` workers and `smg launch` over their URLs, started
  here as separate processes: affinity of each system prompt to one worker (read from the workers' own
  /metrics), prefix hits, streaming with the `openai` client, tokens and logprobs through the router equal to
  those direct, a killed worker and its return;
- `gem4 serve --demo --data-parallel-size 2`: the replicas pinned to their own cores, every listener on the
  host given, SIGTERM stopping everything, a dead replica stopping the rest.

Every loop is bounded; every process is stopped by its pid.
"""
from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from server_helpers import HOST, accumulate, client_for, wait_for

from gem4.server.replicas import die_with_parent, replica_argv, split_cores

# two system prompts of ~600 and ~1100 demo tokens (the study's size: long enough that a prefix hit is most of a
# prompt, so the router's text-prefix match and the worker's token-prefix cache agree)
SYSTEM = {"A": "You are a careful assistant for a shipping company. " * 40,
          "B": "Tu es un poète qui répond toujours en alexandrins rimés. " * 40}
ROUNDS = 8                       # requests per system prompt, the first one cold


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class Proc:
    """A child process whose stdout lines are queued (for its ready line) and whose stderr goes to a file."""

    def __init__(self, cmd: list[str], log: Path):
        self.log = log
        with open(log, "a") as err:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
        self.lines: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=lambda: [self.lines.put(x) for x in self.proc.stdout], daemon=True).start()

    def wait_line(self, pattern: str, timeout: float = 180) -> re.Match:
        deadline = time.monotonic() + timeout
        while True:
            assert time.monotonic() < deadline and self.proc.poll() is None, \
                f"{pattern!r} never came:\n{self.log.read_text()[-4000:]}"
            try:
                m = re.search(pattern, self.lines.get(timeout=0.2))
            except queue.Empty:
                continue
            if m:
                return m

    def stop(self) -> None:
        stop_all([self])


def stop_all(procs: list[Proc]) -> None:
    """SIGTERM to each (by pid), then wait for them together; SIGKILL to any still there after 20 s."""
    for p in procs:
        if p.proc.poll() is None:
            p.proc.terminate()
    for p in procs:
        try:
            p.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.proc.kill()
            p.proc.wait()


def start_worker(port: int, log: Path) -> tuple[Proc, str]:
    w = Proc([sys.executable, "-m", "gem4.cli", "serve", "--demo", "--threads", "1", "--host", HOST,
              "--port", str(port)], log)
    return w, w.wait_line(r"ready at (http://127\.0\.0\.1:\d+)")[1]


def router_workers(base: str) -> list[dict]:
    return httpx.get(base + "/workers", timeout=5).json()["workers"]


def counters(base: str) -> tuple[float, float, float]:
    """A worker's (prompt tokens, prefix-cache queries, hits) from its /metrics."""
    text = httpx.get(base + "/metrics", timeout=10).text

    def value(name: str) -> float:
        return float(re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M)[1])

    return (value("gem4:prompt_tokens_total"), value("gem4:prefix_cache_queries_total"),
            value("gem4:prefix_cache_hits_total"))


def chat(base: str, system: str, question: str, **kw):
    return client_for(base, key="none").chat.completions.create(
        model="gem4-demo", messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
        **{"max_tokens": 4, "temperature": 0, **kw})


def served_by(workers: list[str], router: str, system: str, question: str, stream: bool = False):
    """Send one request through the router; -> (index of the worker that took it, its (queries, hits) deltas)."""
    before = [counters(w) for w in workers]
    if stream:
        chunks = list(chat(router, system, question, stream=True))
        assert accumulate(chunks)["finish_reason"] == "length"
    else:
        assert chat(router, system, question).choices[0].finish_reason == "length"
    after = [counters(w) for w in workers]
    took = [i for i in range(len(workers)) if after[i][0] > before[i][0]]
    assert len(took) == 1, (before, after)
    (i,) = took
    return i, (after[i][1] - before[i][1], after[i][2] - before[i][2])


@pytest.fixture()
def fleet(tmp_path):
    """Two demo workers and SMG (cache_aware, health checks every second) over them, all on 127.0.0.1."""
    procs: list[Proc] = []
    try:
        ports = [free_port(), free_port()]
        starts = [Proc([sys.executable, "-m", "gem4.cli", "serve", "--demo", "--threads", "1", "--host", HOST,
                        "--port", str(p)], tmp_path / f"worker{i}.log") for i, p in enumerate(ports)]
        procs += starts
        workers = [w.wait_line(r"ready at (http://127\.0\.0\.1:\d+)")[1] for w in starts]
        router_port = free_port()
        router = Proc([sys.executable, "-m", "smg", "launch", "--host", HOST, "--port", str(router_port),
                       "--worker-urls", *workers, "--policy", "cache_aware",
                       "--prometheus-host", HOST, "--prometheus-port", str(free_port()),
                       "--health-check-interval-secs", "1", "--disable-tokenizer-autoload", "--log-level", "warn"],
                      tmp_path / "router.log")
        procs.append(router)
        base = f"http://{HOST}:{router_port}"

        def all_healthy() -> bool:
            with contextlib.suppress(httpx.HTTPError):
                return sum(w["is_healthy"] for w in router_workers(base)) == 2
            return False

        wait_for(all_healthy, timeout=30)
        yield base, workers, starts, procs, tmp_path
    finally:
        stop_all(procs)


def test_router_keeps_each_prompt_on_one_worker_exact_and_survives_a_dead_worker(fleet):
    router, workers, starts, procs, tmp_path = fleet
    # affinity: a prompt's first request lands where SMG picks (on a miss: an idle worker, at random or by
    # load); each later one must follow it there, and find its prefix in that worker's cache
    home: dict[str, int] = {}
    cache = {name: [0.0, 0.0] for name in SYSTEM}               # prefix-cache (queries, hits) of its requests
    for r in range(ROUNDS):
        for name, system in SYSTEM.items():
            i, (queries, hits) = served_by(workers, router, system, f"Question {r}?", stream=r % 2 == 1)
            home.setdefault(name, i)
            assert i == home[name], f"prompt {name}'s request {r} went to worker {i}, not {home[name]}"
            cache[name][0] += queries
            cache[name][1] += hits
    for name, (queries, hits) in cache.items():
        assert hits / queries >= 0.8, (name, hits, queries)             # the cold first request included

    # exactness: greedy tokens and logprobs through the router equal those of each worker alone
    kw = {"logprobs": True, "top_logprobs": 3, "max_tokens": 8}
    direct = [chat(w, "Be brief.", "Name three rivers.", **kw) for w in workers]
    routed = chat(router, "Be brief.", "Name three rivers.", **kw)

    def tokens(r) -> list:
        return [(t.token, t.logprob, [(c.token, c.logprob) for c in t.top_logprobs]) for t in r.choices[0].logprobs.content]

    assert tokens(routed) == tokens(direct[0]) == tokens(direct[1])
    assert len(tokens(routed)) == 8

    # a dead worker: the router's retries and health checks send the next 10 requests to the other one
    dead = home["A"]
    port = int(workers[dead].rsplit(":", 1)[1])
    starts[dead].proc.kill()
    starts[dead].proc.wait()
    for r in range(10):
        assert chat(router, SYSTEM["A"], f"After the crash {r}?").choices[0].finish_reason == "length"

    # back on its port: the router's health checks take it again, and requests reach it
    back, _ = start_worker(port, tmp_path / f"worker{dead}-again.log")
    procs.append(back)
    wait_for(lambda: all(w["is_healthy"] for w in router_workers(router) if w["url"] == workers[dead]), timeout=30)
    for r in range(10):
        chat(router, SYSTEM["A"], f"Welcome back {r}?")
        if counters(workers[dead])[0] > 0:
            break
        chat(router, f"A fresh prompt number {r}. " * 30, "Hello?")
        if counters(workers[dead])[0] > 0:
            break
    assert counters(workers[dead])[0] > 0, "the restarted worker was never used again"


# ---------------------------------------------------------------------------------------------
# gem4 serve --data-parallel-size
# ---------------------------------------------------------------------------------------------


def test_split_cores_and_replica_argv():
    assert split_cores([0, 1], 2) == [[0], [1]]
    assert split_cores([0, 1, 2, 3, 4], 2) == [[0, 1, 2], [3, 4]]
    assert split_cores([4, 5, 6, 7, 8, 9, 10], 3) == [[4, 5, 6], [7, 8], [9, 10]]
    with pytest.raises(ValueError, match="more than the 2 cores"):
        split_cores([0, 1], 3)
    ours = ["--data-parallel-size", "1", "--host", "127.0.0.1", "--port", "0", "--threads", "2"]
    assert replica_argv(["serve", "m.gguf", "--port", "9000", "-dp", "2"], "127.0.0.1", 2) == \
        ["serve", "m.gguf", "--port", "9000", "-dp", "2", *ours]              # ours come last: they win
    assert replica_argv(["serve", "--port", "9000", "--", "m.gguf"], "127.0.0.1", 2) == \
        ["serve", "--port", "9000", *ours, "--", "m.gguf"]


def test_a_child_dies_with_its_parent_even_on_sigkill():
    """The pre-exec step every child of `gem4 serve -dp N` gets: the kernel sends it SIGTERM when its parent
    dies, so a SIGKILL of the launcher leaves no orphan."""
    middle = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time\n"
                               "from gem4.server.replicas import die_with_parent\n"
                               "child = subprocess.Popen(['sleep', '60'], preexec_fn=die_with_parent())\n"
                               "print(child.pid, flush=True)\n"
                               "time.sleep(60)\n"], stdout=subprocess.PIPE, text=True)
    try:
        child = int(middle.stdout.readline())
        assert alive(child)
        middle.kill()
        middle.wait()
        wait_for(lambda: not alive(child), timeout=10)
    finally:
        middle.kill()
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)


def listeners(pid: int) -> set[str]:
    """The addresses (host:port) of the TCP sockets process `pid` listens on, from /proc."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            m = re.match(r"socket:\[(\d+)\]", os.readlink(fd))
            if m:
                inodes.add(m[1])
    out = set()
    for table, size in (("tcp", 4), ("tcp6", 16)):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:                  # 0A: LISTEN
                hex_host, hex_port = fields[1].split(":")
                raw = bytes.fromhex(hex_host)
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))   # each word little-endian
                host = socket.inet_ntop(socket.AF_INET if size == 4 else socket.AF_INET6, raw)
                out.add(f"{host}:{int(hex_port, 16)}")
    return out


def alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, dead and not yet reaped by whoever adopted it, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def start_data_parallel(tmp_path: Path, name: str) -> tuple[Proc, str, list[int], int]:
    """`gem4 serve --demo -dp 2 --port 0`; -> (it, its URL, the replicas' pids, the router's pid)."""
    launcher = Proc([sys.executable, "-m", "gem4.cli", "serve", "--demo", "--data-parallel-size", "2",
                     "--host", HOST, "--port", "0"], tmp_path / f"{name}.log")
    base = launcher.wait_line(r"ready at (http://127\.0\.0\.1:\d+) \(router over 2 replicas\)")[1]
    log = launcher.log.read_text()
    replicas = [int(re.search(rf"^gem4: replica {i}: pid (\d+)", log, re.M)[1]) for i in range(2)]
    router = int(re.search(r"^gem4: router: SMG [\d.]+ \(pid (\d+)\)", log, re.M)[1])
    return launcher, base, replicas, router


def test_data_parallel_serve_pins_its_replicas_stays_on_its_host_and_stops_on_sigterm(tmp_path):
    launcher, base, replicas, router = start_data_parallel(tmp_path, "dp")
    try:
        want = split_cores(sorted(os.sched_getaffinity(0)), 2)
        for pid, cores in zip(replicas, want):
            assert sorted(os.sched_getaffinity(pid)) == cores                # each replica on its own cores
        for pid in [*replicas, router]:                                      # every listener on 127.0.0.1
            assert listeners(pid) and all(a.startswith(HOST + ":") for a in listeners(pid)), (pid, listeners(pid))
        r = chat(base, "You are terse.", "Hi?")
        assert r.choices[0].finish_reason == "length" and r.model == "gem4-demo"
        assert accumulate(list(chat(base, "You are terse.", "Hi again?", stream=True)))["finish_reason"] == "length"
        launcher.proc.send_signal(signal.SIGTERM)
        assert launcher.proc.wait(timeout=60) == 0
        for pid in [*replicas, router]:
            assert not alive(pid), pid                                       # no orphan
        assert "gem4: SIGTERM: stopping the router and the replicas" in launcher.log.read_text()
    finally:
        launcher.stop()
        for pid in [*replicas, router]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_data_parallel_serve_stops_everything_when_a_replica_dies(tmp_path):
    """As vLLM does when a data-parallel engine dies: the rest stop and the exit status says so (restarting
    is the supervisor's job)."""
    launcher, base, replicas, router = start_data_parallel(tmp_path, "dp-death")
    try:
        os.kill(replicas[0], signal.SIGKILL)
        assert launcher.proc.wait(timeout=60) == 1
        for pid in [replicas[1], router]:
            assert not alive(pid), pid
        assert f"gem4: replica 0 (pid {replicas[0]}) exited with signal SIGKILL" in launcher.log.read_text()
    finally:
        launcher.stop()
        for pid in [*replicas, router]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
