"""Two replicas behind SMG: `cache_aware` against `round_robin` on multi-turn chats (issue 32; not CI).

    python benchmarks/router.py --model benchmarks/out/e2b-q4_0.gguf         # the issue's run (make_e2b.py)
    python benchmarks/router.py --demo --conversations 4 --turns 3           # a quick look

For each policy, `gem4 serve MODEL --data-parallel-size 2 --router-policy P` (on a 2-core host: one core and
one thread per replica). Then:

- Workload: C conversations run at once, each T turns in sequence; every request is the shared system prompt
  (~2k tokens), the conversation's turns so far (its user turns and the replies it got) and a new user turn,
  streamed, greedy, `max_tokens` replies (ignore_eos). Per request: TTFT (request sent -> first content
  delta), prompt tokens and `cached_tokens` (the replica's prefix-cache hits). Reported: hit rate (cached /
  prompt tokens), TTFT p50 / p99, generated tokens per second of wall time over the whole workload.
- Router overhead: N one-token requests of one short prompt, in turn straight to the replica that serves it
  and through the router, sequentially; the difference of the medians (and of the p99s) is what the hop
  through the router costs.

Everything listens on 127.0.0.1; the replicas and the router are stopped by the launcher's SIGTERM.
"""
from __future__ import annotations

import argparse
import json
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
WORDS = ("the of and to in is was for on with as by at from that this which river harbour ledger cargo "
         "vessel manifest customs tariff crane berth tide anchor freight route weather invoice schedule "
         "container pallet warehouse clearance broker insurance draft hull deck signal").split()


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def start(args, policy: str, log: Path) -> tuple[subprocess.Popen, str, list[str]]:
    model = ["--demo"] if args.demo else [args.model]
    cmd = [sys.executable, "-m", "gem4.cli", "serve", *model, "--data-parallel-size", "2", "--router-policy", policy,
           "--host", "127.0.0.1", "--port", "0", "--max-model-len", str(args.max_model_len),
           "--max-num-seqs", str(args.max_num_seqs), "--log-level", "warning"]
    err = open(log, "w")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
    for line in proc.stdout:
        m = re.search(r"serving ([^,;]+).*; ready at (http://\S+) \(router", line)
        if m:
            args.served = m[1]                               # the router routes by model name: use the real one
            text = log.read_text()
            return proc, m[2], re.findall(r"^gem4: replica \d ready at (\S+)", text, re.M)
    raise SystemExit(f"gem4 serve -dp 2 did not start:\n{log.read_text()[-3000:]}")


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)


def stream_chat(client: httpx.Client, base: str, model: str, messages: list[dict], max_tokens: int) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, text, usage = None, [], None
    with client.stream("POST", base + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                delta = choice["delta"]
                if any(v for k, v in delta.items() if k != "role") and ttft is None:   # text, reasoning or a call
                    ttft = time.perf_counter() - t0
                text.append(delta.get("content") or "")
    if ttft is None:                     # a reply of tokens that print as nothing (random weights): its end
        ttft = time.perf_counter() - t0
    return {"ttft": ttft, "text": "".join(text), "prompt": usage["prompt_tokens"],
            "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
            "generated": usage["completion_tokens"]}


def workload(args, base: str, system: str) -> dict:
    results: list[dict] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def conversation(c: int) -> None:
        try:
            turns(c)
        except BaseException as e:  # noqa: BLE001 - raised below, in the main thread
            errors.append(e)

    def turns(c: int) -> None:
        rng = random.Random(1000 + c)
        history = [{"role": "system", "content": system}]
        with httpx.Client() as client:
            for t in range(args.turns):
                history.append({"role": "user", "content": f"Conversation {c}, turn {t}: {words(rng, 24)}?"})
                r = stream_chat(client, base, args.served, history, args.max_tokens)
                history.append({"role": "assistant", "content": r["text"]})
                with lock:
                    results.append(r)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=conversation, args=(c,)) for c in range(args.conversations)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    ttfts = sorted(r["ttft"] for r in results)
    return {"requests": len(results), "hit_rate": sum(r["cached"] for r in results) / sum(r["prompt"] for r in results),
            "ttft_p50": statistics.median(ttfts), "ttft_p99": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
            "tok_s": sum(r["generated"] for r in results) / wall, "wall_s": wall,
            "prompt_tokens_first": min(r["prompt"] for r in results)}


def overhead(args, base: str, replicas: list[str]) -> dict:
    """p50/p99 of one-token requests straight to the replica that serves the prompt, and through the router."""
    body = {"model": args.served, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "temperature": 0}
    times: dict[str, list[float]] = {"direct": [], "router": []}
    with httpx.Client() as client:
        def once(url: str) -> float:
            t0 = time.perf_counter()
            client.post(url + "/v1/chat/completions", json=body, timeout=60).raise_for_status()
            return time.perf_counter() - t0

        def served(url: str) -> float:
            text = client.get(url + "/metrics").text
            return float(re.search(r"^gem4:prompt_tokens_total\{[^}]*\} (\S+)$", text, re.M)[1])

        before = [served(u) for u in replicas]
        once(base)                                        # where the router sends it (and it stays, cached)
        target = next(u for u, b in zip(replicas, before) if served(u) > b)
        once(target)
        for _ in range(args.overhead_requests):
            times["direct"].append(once(target))
            times["router"].append(once(base))

    def pct(xs: list[float], q: float) -> float:
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(q * len(xs)))]

    out = {}
    for k, xs in times.items():
        out[f"{k}_p50_ms"] = 1000 * statistics.median(xs)
        out[f"{k}_p99_ms"] = 1000 * pct(xs, 0.99)
    out["overhead_p50_ms"] = out["router_p50_ms"] - out["direct_p50_ms"]
    out["overhead_p99_ms"] = out["router_p99_ms"] - out["direct_p99_ms"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(REPO / "benchmarks/out/e2b-q4_0.gguf"))
    ap.add_argument("--demo", action="store_true", help="the demo model instead of --model")
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system-words", type=int, default=1800, help="the shared system prompt's length in words")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--overhead-requests", type=int, default=200)
    ap.add_argument("--policies", nargs="+", default=["cache_aware", "round_robin"])
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    system = "You answer questions about a shipping company's records. " + words(random.Random(7), args.system_words)
    results = {}
    for policy in args.policies:
        log = Path(f"/tmp/gem4-router-bench-{policy}.log")
        proc, base, replicas = start(args, policy, log)
        try:
            res = workload(args, base, system)
            if policy == args.policies[0]:
                res |= overhead(args, base, replicas)
        finally:
            stop(proc)
        results[policy] = res
        print(policy, json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in res.items()}), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
