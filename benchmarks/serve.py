"""Serving benchmark (issue 13): `gem4 serve` vs llama.cpp's `llama-server`, N concurrent streaming clients.
Not part of CI.

    python benchmarks/serve.py benchmarks/out/e2b-q4_0.gguf --llama-server /tmp/lcpp/build/bin/llama-server \\
        --n 1 2 4 8 --prompt 128 --output 128 --repeats 3 --threads 2

For every repeat, every N and every engine (interleaved: repeat r runs N = 1 gem4, N = 1 llama, N = 2 gem4, ...)
one fresh server is started on a free port, waited for (GET /health answers 200), warmed with one short
request (8 prompt tokens, 4 output), and then N clients start together, each streaming one
POST /v1/completions: `prompt` a list of --prompt token ids (BOS + seeded random ids, different for every
client, repeat and N, the same for both engines), temperature 0, `max_tokens` --output, `ignore_eos`.
Then the server's peak RSS (VmHWM of its process) is read and the server is stopped.

Choices made:
- Both servers get the same per-sequence context C (--ctx, default P+O+16): gem4 `--max-model-len C` (its KV
  pool defaults to --max-num-seqs such sequences), llama-server `-np N -c N*C` (the context is split among the
  slots), and the same threads (`--threads T` / `-t T -tb T`). llama-server runs with `--cache-ram 0` and
  requests set `cache_prompt: false` (no prompt reuse; the prompts are distinct anyway).
- Each SSE event that carries text counts as one arrival. Both servers hold back a token whose text is
  an incomplete UTF-8 sequence and send it with the next one, so an event can carry two tokens; token
  counts come from the final `usage` (stream_options.include_usage), arrivals from the events.
- Reported per N and engine, medians over the repeats: aggregate output tok/s (all completion tokens over
  the time from the requests' start to the last token), aggregate decode tok/s (as benchmarks/batch.py:
  the events after the last client's first token, over the time from then to the last token), median
  TTFT over the clients, median inter-token latency (gaps between a client's consecutive events, all
  clients pooled), peak RSS.
- Raw runs are saved as JSON under benchmarks/out/ (--save).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

BOS = 2          # Gemma's <bos>
SLACK = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(engine: str, a: argparse.Namespace, n: int, port: int) -> list[str]:
    ctx = a.ctx or a.prompt + a.output + SLACK
    if engine == "gem4":
        return [sys.executable, "-m", "gem4.cli", "serve", a.model, "--port", str(port), "--max-num-seqs", str(n),
                "--max-model-len", str(ctx), "--threads", str(a.threads), "--log-level", "warning"]
    return [a.llama_server, "-m", a.model, "--port", str(port), "-np", str(n), "-c", str(n * ctx),
            "-t", str(a.threads), "-tb", str(a.threads), "--no-webui", "--cache-ram", "0", "--log-disable"]


def vm_hwm_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmHWM for pid {pid}")


def wait_ready(proc: subprocess.Popen, url: str, timeout: float) -> float:
    start = time.perf_counter()
    while time.perf_counter() - start < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return time.perf_counter() - start
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"server not ready after {timeout} s")


def body(engine: str, prompt: list[int], max_tokens: int, stream: bool) -> dict:
    b = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
         "stream": stream}
    if stream:
        b["stream_options"] = {"include_usage": True}
    if engine == "llama":
        b["cache_prompt"] = False
    return b


def client(url: str, payload: dict, barrier: threading.Barrier, out: dict) -> None:
    times: list[float] = []
    usage = None
    text = []
    with httpx.Client(timeout=600) as c:
        barrier.wait()
        with c.stream("POST", url + "/v1/completions", json=payload) as r:
            if r.status_code != 200:
                r.read()
                out["error"] = f"{r.status_code}: {r.text[:300]}"
                return
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter()
                ev = json.loads(line[6:])
                if ev.get("usage"):
                    usage = ev["usage"]
                for ch in ev.get("choices") or []:
                    if ch.get("text"):
                        times.append(now)
                        text.append(ch["text"])
    out.update(times=times, usage=usage, text="".join(text))


def run_one(engine: str, a: argparse.Namespace, n: int, prompts: list[list[int]]) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(server_command(engine, a, n, port), stdout=subprocess.DEVNULL,
                            stderr=open(a.log, "ab"), start_new_session=True)
    try:
        ready_s = wait_ready(proc, url, a.ready_timeout)
        r = httpx.post(url + "/v1/completions", json=body(engine, prompts[0][:8], 4, False), timeout=300)
        r.raise_for_status()
        outs = [{} for _ in prompts]
        barrier = threading.Barrier(n + 1)
        threads = [threading.Thread(target=client, args=(url, body(engine, p, a.output, True), barrier, o))
                   for p, o in zip(prompts, outs)]
        for t in threads:
            t.start()
        barrier.wait()
        start = time.perf_counter()
        for t in threads:
            t.join()
        rss_kb = vm_hwm_kb(proc.pid)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    errors = [o["error"] for o in outs if "error" in o]
    if errors:
        raise RuntimeError(f"{engine} N={n}: {errors[0]}")
    times = [o["times"] for o in outs]
    tokens = [o["usage"]["completion_tokens"] for o in outs]
    prompt_tokens = [o["usage"]["prompt_tokens"] for o in outs]
    first, last = max(t[0] for t in times), max(t[-1] for t in times)
    decoded = sum(sum(1 for x in t if x > first) for t in times)
    gaps = [y - x for t in times for x, y in zip(t, t[1:])]
    return {"engine": engine, "n": n, "ready_s": ready_s, "output_tps": sum(tokens) / (last - start),
            "decode_tps": decoded / (last - first), "ttft_s": statistics.median(t[0] - start for t in times),
            "itl_ms": 1000 * statistics.median(gaps), "rss_gb": rss_kb * 1024 / 1e9,
            "completion_tokens": tokens, "prompt_tokens": prompt_tokens, "events": [len(t) for t in times],
            "texts": [o["text"] for o in outs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--llama-server", default="/tmp/lcpp/build/bin/llama-server")
    ap.add_argument("--engines", default="gem4,llama")
    ap.add_argument("--n", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--output", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=None,
                    help=f"context per sequence (default: prompt + output + {SLACK}); e.g. 1024 for the RSS target")
    ap.add_argument("--ready-timeout", type=float, default=300)
    ap.add_argument("--log", default="benchmarks/out/serve-servers.log", help="the servers' stderr")
    ap.add_argument("--save", default="benchmarks/out/serve-runs.json")
    a = ap.parse_args()
    engines = a.engines.split(",")
    for e in engines:
        if e not in ("gem4", "llama"):
            ap.error(f"unknown engine {e!r} (gem4, llama)")
    if "llama" in engines and not os.access(a.llama_server, os.X_OK):
        ap.error(f"--llama-server {a.llama_server} is not an executable")
    Path(a.log).parent.mkdir(parents=True, exist_ok=True)
    runs: list[dict] = []
    for r in range(a.repeats):
        for n in a.n:
            rng = random.Random(f"{r}-{n}")
            prompts = [[BOS] + [rng.randrange(1000, 200000) for _ in range(a.prompt - 1)] for _ in range(n)]
            for e in engines:
                res = run_one(e, a, n, prompts)
                res["repeat"] = r
                runs.append(res)
                print(f"repeat {r} N={n} {e}: output {res['output_tps']:.2f} tok/s, decode {res['decode_tps']:.2f}, "
                      f"TTFT {res['ttft_s']:.2f} s, ITL {res['itl_ms']:.1f} ms, RSS {res['rss_gb']:.2f} GB, "
                      f"tokens {res['completion_tokens']}, events {res['events']}, prompt {res['prompt_tokens'][0]}",
                      flush=True)
                Path(a.save).write_text(json.dumps({"args": vars(a), "runs": runs}, indent=1))
    med = {}
    for e in engines:
        for n in a.n:
            rs = [x for x in runs if x["engine"] == e and x["n"] == n]
            med[e, n] = {k: statistics.median(x[k] for x in rs)
                         for k in ("output_tps", "decode_tps", "ttft_s", "itl_ms", "rss_gb")}
    cols = [("output_tps", "output tok/s", 2), ("decode_tps", "decode tok/s", 2), ("ttft_s", "TTFT s", 2),
            ("itl_ms", "ITL ms", 1), ("rss_gb", "peak RSS GB", 2)]
    print(f"\nmedians of {a.repeats} repeats; prompt {a.prompt}, output {a.output}, threads {a.threads}, "
          f"context per sequence {a.ctx or a.prompt + a.output + SLACK}\n")
    head = "| N | " + " | ".join(f"{e} {c}" for _, c, _ in cols for e in engines)
    if engines == ["gem4", "llama"]:
        head += " | " + " | ".join(f"gem4/llama {c}" for _, c, _ in cols)
    print(head + " |")
    print("|---" * (head.count("|")) + "|")
    for n in a.n:
        row = [f"{med[e, n][k]:.{d}f}" for k, _, d in cols for e in engines]
        if engines == ["gem4", "llama"]:
            row += [f"{med['gem4', n][k] / med['llama', n][k]:.2f}" for k, _, _ in cols]
        print(f"| {n} | " + " | ".join(row) + " |")
    for e in engines:
        base = med[e, a.n[0]]
        print(f"\n{e}: aggregate decode x N={a.n[0]}: " + ", ".join(
            f"N={n} {med[e, n]['decode_tps'] / base['decode_tps']:.2f}" for n in a.n)
            + "; ITL x N=1: " + ", ".join(f"N={n} {med[e, n]['itl_ms'] / base['itl_ms']:.2f}" for n in a.n))


if __name__ == "__main__":
    main()
