"""`gem4 serve --data-parallel-size N`: N engine processes on one host behind SMG's cache-aware router.

Each replica is a plain `gem4 serve` process (the same command line, on a loopback port the kernel picks)
pinned to its own share of this process's cores (and, with `--device cuda`, to one of the visible GPUs);
SMG (`smg`, the SGLang router's lineage, the optional dependency `gem4[router]`) listens on the user's
--host/--port and sends each request to the replica whose prefix cache most likely holds its prompt.
Replicas share nothing, so every guarantee of one `gem4 serve` (exact prefix hits, batch-invariant
tokens, seeded sampling) holds for each request whichever replica serves it. docs/replicas.md is the
user's side; the multi-host recipe there starts the same pieces by hand.

What runs where:

    gem4 serve -dp N (this process)   starts, watches and stops the others; holds no model
    replica i: gem4 serve ... --host 127.0.0.1 --port 0 --data-parallel-size 1 --threads T_i
               cores: contiguous slice i of sched_getaffinity (os.sched_setaffinity right after spawn,
               before its interpreter has started a thread); CUDA_VISIBLE_DEVICES: visible GPU i
    router:    python -m smg launch --host HOST --port PORT --worker-urls ... --policy cache_aware
               --prometheus-host <loopback> --prometheus-port <a free one>

Everything launched stays on the addresses the user chose: the replicas on loopback (::1 when --host is
IPv6), the router on --host, and SMG's own Prometheus listener, which would open 0.0.0.0:29000 by default,
on loopback at a free port (named in the start-up lines). A replica's port is the one it bound itself
(`--port 0`, read from its ready line), so no port is chosen and then lost to another process; the
router's port is checked free by binding it first (as `gem4 serve` does), then handed to SMG.

A replica that exits stops everything (exit status 1), as vLLM does when one of its data-parallel engine
processes dies: restarting is the supervisor's job (systemd, Kubernetes), which then restarts a whole,
known-good set. For a fleet whose replicas come and go on their own, run the router by itself over
independently supervised `gem4 serve` workers (docs/replicas.md): its health checks drop a dead worker
and take it back once it answers again.

Stopping: SIGTERM or Ctrl-C stops the router and every replica (SIGTERM to each pid, SIGKILL to those
still there after --shutdown-timeout + 10 s), waits for them, and exits 0 (130 after Ctrl-C). Each child
also has the kernel's parent-death signal (PR_SET_PDEATHSIG: SIGTERM), so even a SIGKILL of this process
leaves no orphan. Children's output goes to this process's stderr, each line prefixed by its source.

Threads: the main thread starts the children and waits; one thread per child pipe forwards its output.
"""
from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from gem4.server.main import bind

ROUTER_READY_S = 60.0            # from the router's start to every replica registered and healthy
_READY_LINE = re.compile(r"^gem4: serving (?P<names>.*); ready at (?P<url>\S+)$")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")          # SMG colours its log lines even into a pipe
_BANNER = re.compile(r"^[\u2800-\u28ff]")        # SMG's start-up banner: braille art (our own lines say the rest)
_PR_SET_PDEATHSIG = 1            # <linux/prctl.h>


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def split_cores(cores: list[int], n: int) -> list[list[int]]:
    """`cores` in n contiguous slices whose sizes differ by at most one (the first ones get the extra core).
    Contiguous: Linux numbers a socket's cores together, so a slice stays on one socket where it can."""
    if n > len(cores):
        raise ValueError(f"--data-parallel-size {n} is more than the {len(cores)} cores this process may use: "
                         f"each replica needs a core of its own")
    size, extra = divmod(len(cores), n)
    slices, start = [], 0
    for i in range(n):
        end = start + size + (i < extra)
        slices.append(cores[start:end])
        start = end
    return slices


def replica_argv(argv: list[str], host: str, threads: int) -> list[str]:
    """A replica's command line: the user's `gem4 ... serve ...` with one replica, on `host` at a port of its
    choosing, with `threads` threads. argparse keeps the last of a repeated option, so ours go after the
    user's (before a `--`, after which everything is positional)."""
    ours = ["--data-parallel-size", "1", "--host", host, "--port", "0", "--threads", str(threads)]
    cut = argv.index("--") if "--" in argv else len(argv)
    return [*argv[:cut], *ours, *argv[cut:]]


def visible_gpus(n: int) -> list[str]:
    """The CUDA devices for n replicas, one each: CUDA_VISIBLE_DEVICES's entries, or 0..count-1."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        devices = [d.strip() for d in env.split(",") if d.strip()]
    else:
        import torch

        devices = [str(i) for i in range(torch.cuda.device_count())]
    if n > len(devices):
        raise ValueError(f"--data-parallel-size {n} with --device cuda needs {n} GPUs, {len(devices)} visible")
    return devices[:n]


def loopback(host: str) -> str:
    """Where the replicas listen: loopback, of --host's family."""
    return "::1" if ":" in host else "127.0.0.1"


def url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def cores_text(cores: list[int]) -> str:
    return f"{cores[0]}-{cores[-1]}" if len(cores) > 1 and cores == list(range(cores[0], cores[-1] + 1)) \
        else ",".join(map(str, cores))


def die_with_parent():
    """A child's pre-exec step: SIGTERM when this process dies, whatever kills it (the flag survives exec).
    prctl is looked up here, before any fork; the child only calls it."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def arm() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:          # the parent died before the flag was set
            os._exit(1)

    return arm


@dataclass
class Child:
    name: str                          # "replica 0", "router"
    proc: subprocess.Popen
    cores: list[int] = field(default_factory=list)              # a replica's, from split_cores
    ready: queue.Queue = field(default_factory=queue.Queue)     # a replica's ready line's (names, url)
    threads: list[threading.Thread] = field(default_factory=list)

    def forward(self, stream, watch_ready: bool) -> None:
        """Copy `stream`'s lines to stderr, prefixed; a replica's ready line goes to `ready` instead."""
        def run() -> None:
            for line in stream:
                line = _ANSI.sub("", line.rstrip("\n"))
                m = _READY_LINE.match(line) if watch_ready else None
                if m is not None:
                    self.ready.put((m["names"], m["url"]))
                elif line.strip() and not _BANNER.match(line):
                    _log(f"[{self.name}] {line}")
            stream.close()
        thread = threading.Thread(target=run, name=f"gem4-{self.name.replace(' ', '-')}-output", daemon=True)
        thread.start()
        self.threads.append(thread)


class Replicas:
    """The router and the replicas, as processes; `run()` is `gem4 serve --data-parallel-size N`."""

    def __init__(self, args: argparse.Namespace, argv: list[str]):
        self.args, self.argv = args, argv
        self.children: list[Child] = []
        self.signal: int | None = None

    # ---- start ----

    def _spawn(self, name: str, cmd: list[str], env: dict | None = None, watch_ready: bool = False) -> Child:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, errors="replace", bufsize=1, env=env, preexec_fn=die_with_parent())
        child = Child(name, proc)
        self.children.append(child)
        child.forward(proc.stdout, watch_ready)
        child.forward(proc.stderr, False)
        return child

    def _start_replicas(self) -> list[Child]:
        args, n = self.args, self.args.data_parallel_size
        slices = split_cores(sorted(os.sched_getaffinity(0)), n)
        gpus = visible_gpus(n) if str(args.device).startswith("cuda") else None
        host = loopback(args.host)
        replicas = []
        for i, cores in enumerate(slices):
            cmd = [sys.executable, "-m", "gem4.cli",
                   *replica_argv(self.argv, host, getattr(args, "threads", None) or len(cores))]
            env = dict(os.environ)
            if gpus is not None:
                env["CUDA_VISIBLE_DEVICES"] = gpus[i]
            child = self._spawn(f"replica {i}", cmd, env, watch_ready=True)
            os.sched_setaffinity(child.proc.pid, cores)   # its interpreter is starting: no thread yet
            child.cores = cores
            replicas.append(child)
        return replicas

    def _wait_ready(self, replicas: list[Child]) -> list[tuple[str, str]] | None:
        """Each replica's (names, url) once it is ready; None if one exits first or a signal came."""
        found: dict[int, tuple[str, str]] = {}
        while len(found) < len(replicas):
            if self._stopped():
                return None
            for i, child in enumerate(replicas):
                if i not in found:
                    try:
                        found[i] = child.ready.get_nowait()
                    except queue.Empty:
                        pass
            time.sleep(0.05)
        return [found[i] for i in range(len(replicas))]

    def _start_router(self, reserved, workers: list[str]) -> Child:
        """SMG on the port of `reserved` (--host/--port, bound but not listening), closed just before."""
        args = self.args
        port = reserved.getsockname()[1]
        metrics = bind(loopback(args.host), 0)
        metrics_port = metrics.getsockname()[1]
        metrics.close()
        level = {"debug": "debug", "error": "error", "critical": "error"}.get(args.log_level, "warn")
        cmd = [sys.executable, "-m", "smg", "launch", "--host", args.host, "--port", str(port),
               "--worker-urls", *workers, "--policy", args.router_policy,
               "--prometheus-host", loopback(args.host), "--prometheus-port", str(metrics_port),
               "--disable-tokenizer-autoload",            # it routes text; no tokenizer download
               "--shutdown-grace-period-secs", str(max(1, round(args.shutdown_timeout))),
               "--log-level", level]
        if args.api_key is not None:                     # clients must send it; the router sends it on
            cmd += ["--api-key", args.api_key]
        reserved.close()
        child = self._spawn("router", cmd)
        _log(f"gem4: router: SMG {_smg_version()} (pid {child.proc.pid}), policy {args.router_policy}, "
             f"its metrics at {url(loopback(args.host), metrics_port)}/metrics")
        return child

    def _wait_router(self, base: str, n: int) -> bool:
        """True once the router lists n healthy workers; False if a child exits or a signal comes first."""
        headers = {} if self.args.api_key is None else {"Authorization": f"Bearer {self.args.api_key}"}
        deadline = time.monotonic() + ROUTER_READY_S
        while time.monotonic() < deadline:
            if self._stopped():
                return False
            try:
                with urllib.request.urlopen(urllib.request.Request(base + "/workers", headers=headers),
                                            timeout=2) as r:
                    workers = json.load(r).get("workers", [])
                if sum(1 for w in workers if w.get("is_healthy") and w.get("status") == "ready") == n:
                    return True
            except (OSError, ValueError, urllib.error.URLError):
                pass
            time.sleep(0.1)
        _log(f"gem4: error: the router did not list the {n} replicas as healthy within {ROUTER_READY_S:g} s")
        return False

    # ---- watch and stop ----

    def _stopped(self) -> bool:
        """A signal came, or a child exited (said on stderr)."""
        if self.signal is not None:
            return True
        for child in self.children:
            code = child.proc.poll()
            if code is not None:
                how = f"signal {signal.Signals(-code).name}" if code < 0 else f"status {code}"
                _log(f"gem4: {child.name} (pid {child.proc.pid}) exited with {how}: stopping the others "
                     f"(restarting is the supervisor's job, docs/replicas.md)")
                return True
        return False

    def _on_signal(self, sig: int, frame) -> None:
        if self.signal is None:
            self.signal = sig
            _log(f"gem4: {signal.Signals(sig).name}: stopping the router and the replicas")

    def stop(self) -> None:
        """SIGTERM to every child still running, then SIGKILL to those left after the grace period."""
        for child in self.children:
            if child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.args.shutdown_timeout + 10
        for child in self.children:
            try:
                child.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _log(f"gem4: {child.name} (pid {child.proc.pid}) did not stop in time: killed")
                child.proc.kill()
                child.proc.wait()
        for child in self.children:
            for thread in child.threads:
                thread.join(5)

    def run(self) -> int:
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            return self._run()
        finally:
            self.stop()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _run(self) -> int:
        args = self.args
        reserved = bind(args.host, args.port)    # first, as `gem4 serve`: a busy port is said before anything loads
        port = reserved.getsockname()[1]         # and the port stays ours while the replicas load
        try:
            return self._serve(reserved, port)
        finally:
            reserved.close()

    def _serve(self, reserved, port: int) -> int:
        args = self.args
        replicas = self._start_replicas()
        for i, child in enumerate(replicas):
            _log(f"gem4: replica {i}: pid {child.proc.pid}, cores {cores_text(child.cores)}")
        ready = self._wait_ready(replicas)
        if ready is None:
            return self._code()
        for i, (_, where) in enumerate(ready):
            _log(f"gem4: replica {i} ready at {where}")
        self._start_router(reserved, [where for _, where in ready])
        reachable = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(args.host, args.host)   # a wildcard: via loopback
        if not self._wait_router(url(reachable, port), len(replicas)):
            return self._code()
        print(f"gem4: serving {ready[0][0]}; ready at {url(args.host, port)} (router over {len(replicas)} replicas)",
              flush=True)
        while not self._stopped():
            time.sleep(0.1)
        return self._code()

    def _code(self) -> int:
        if self.signal is None:
            return 1                                   # a child exited, or the router never became ready
        return 130 if self.signal == signal.SIGINT else 0


def _smg_version() -> str:
    from importlib.metadata import version

    return version("smg")


def serve_replicas(args: argparse.Namespace) -> int:
    """`gem4 serve --data-parallel-size N` (N > 1). Returns the process exit code."""
    if importlib.util.find_spec("smg") is None:
        raise ValueError("--data-parallel-size needs SMG, the router in front of the replicas: "
                         "pip install 'gem4[router]'")
    argv = getattr(args, "argv", None)
    if argv is None:
        raise ValueError("--data-parallel-size starts replicas with the command line it was given: "
                         "run it as `gem4 serve`")
    if args.demo:                                       # built once here, not raced by N replicas
        from gem4.demo import ensure_demo

        ensure_demo(_log)
    elif args.model is not None:                        # a hub id downloaded once, here, with its progress
        from gem4.weights.hub import resolve

        resolve(args.model, _log)
    return Replicas(args, argv).run()
