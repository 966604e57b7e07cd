"""Continuous batching in the engine: N concurrent requests decoded together (issue 13). Not part of CI.

    python benchmarks/batch.py benchmarks/out/e2b-q4_0.gguf --n 1 2 4 8 --repeats 3

For each N, N requests of --prompt random tokens are submitted at once to one `gem4.Engine`
(max_num_seqs = N) and decoded greedily for --output tokens each (ignore_eos). Reported per N, median
over the repeats (the Ns interleaved within each repeat): aggregate decode tok/s (every token after each
request's first, over the time from the last first token to the last token), median time to first token,
median inter-token latency, and the ratio of aggregate decode to N = 1's. One model load for all runs.
"""
from __future__ import annotations

import argparse
import statistics
import threading
import time

import gem4  # noqa: F401  first: sets the OpenMP environment before torch loads
import torch

from gem4 import Engine, SamplingParams


def run_once(engine: Engine, prompts: list[list[int]], output: int) -> dict[str, float]:
    params = SamplingParams(temperature=0, max_tokens=output, ignore_eos=True)
    start = time.perf_counter()
    streams = [engine.submit(p, params) for p in prompts]
    times: list[list[float]] = [[] for _ in prompts]

    def read(i: int) -> None:
        for _ in streams[i]:
            times[i].append(time.perf_counter())

    threads = [threading.Thread(target=read, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    first = max(t[0] for t in times)                 # every request decoding from here on
    last = max(t[-1] for t in times)
    decoded = sum(sum(1 for x in t if x > first) for t in times)
    gaps = [b - a for t in times for a, b in zip(t, t[1:])]
    return {"decode_tps": decoded / (last - first), "ttft_s": statistics.median(t[0] - start for t in times),
            "itl_ms": 1000 * statistics.median(gaps)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--n", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--output", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    model = gem4.load(a.model)
    g = torch.Generator().manual_seed(0)
    engines = {n: Engine(model, max_num_seqs=n, max_model_len=a.prompt + a.output + 8) for n in a.n}
    results: dict[int, list[dict[str, float]]] = {n: [] for n in a.n}
    for r in range(a.repeats):
        for n in a.n:
            prompts = [torch.randint(1000, 200000, (a.prompt,), generator=g).tolist() for _ in range(n)]
            results[n].append(run_once(engines[n], prompts, a.output))
            print(f"repeat {r} N={n}: " + ", ".join(f"{k} {v:.3g}" for k, v in results[n][-1].items()), flush=True)
    base = statistics.median(x["decode_tps"] for x in results[a.n[0]])
    print(f"\n| N | aggregate decode tok/s | x N={a.n[0]} | median TTFT s | median ITL ms |")
    print("|---|---|---|---|---|")
    for n in a.n:
        tps = statistics.median(x["decode_tps"] for x in results[n])
        print(f"| {n} | {tps:.2f} | {tps / base:.2f} | {statistics.median(x['ttft_s'] for x in results[n]):.2f} "
              f"| {statistics.median(x['itl_ms'] for x in results[n]):.1f} |")


if __name__ == "__main__":
    main()
