"""Decode steps and prefill chunks of several checkpoints of the same weights, interleaved step by step in one
process (issue 31: MLX affine vs GGUF Q4_0): on a shared host, where whole runs (formats.py) swing with the other
processes' load, alternating single steps puts every model under the same load, and the minimum over many steps
is what each costs undisturbed.

    python benchmarks/steps.py benchmarks/out/e2b-q4_0.gguf benchmarks/out/e2b-mlx-4bit --steps 64 --prefill 5

Per model (fast mode, --threads): a --prompt token prompt is prefilled, then --steps greedy decode steps are taken
in turn with the other models (A B A B ...); then --prefill rounds of a fresh --prompt token prefill, in turn.
Reported: decode ms per step (median, min) and tok/s of the median, prefill tok/s (median, best), and each
median's ratio to the first model's.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import gem4  # noqa: F401  first: torch's runtime environment
import torch


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", type=Path, nargs="+")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--prefill", type=int, default=5, help="prefill rounds")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    ids = torch.tensor([2] + torch.randint(3, 262144, (a.prompt - 1,), generator=torch.Generator().manual_seed(0)).tolist())
    models = {m: gem4.load(m) for m in a.models}
    caches, tok = {}, {}
    for m, model in models.items():
        caches[m] = model.new_cache()
        tok[m] = int(model.extend(ids, caches[m])[-1].argmax())
    decode: dict[Path, list[float]] = {m: [] for m in models}
    for _ in range(a.steps):
        for m, model in models.items():
            t = time.perf_counter()
            tok[m] = int(model.extend(torch.tensor([tok[m]]), caches[m])[-1].argmax())
            decode[m].append(time.perf_counter() - t)
    prefill: dict[Path, list[float]] = {m: [] for m in models}
    for _ in range(a.prefill):
        for m, model in models.items():
            cache = model.new_cache()
            t = time.perf_counter()
            model.extend(ids, cache)
            prefill[m].append(time.perf_counter() - t)
    first = a.models[0]
    print(f"# steps.py {' '.join(argv)}")
    print("| model | decode ms/step median (min) | decode tok/s | prefill tok/s median (best) |")
    print("|---|---|---|---|")
    for m in a.models:
        d, p = statistics.median(decode[m]), statistics.median(prefill[m])
        rd = "" if m == first else f", {statistics.median(decode[first]) / d:.2f}x"
        rp = "" if m == first else f", {statistics.median(prefill[first]) / p:.2f}x"
        print(f"| {m.name} | {1e3 * d:.1f} ({1e3 * min(decode[m]):.1f}) | {1 / d:.2f}{rd} | "
              f"{a.prompt / p:.0f} ({a.prompt / min(prefill[m]):.0f}){rp} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
