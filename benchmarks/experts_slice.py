"""A 26B-A4B-shaped slice with streamed experts (issue 17): exactness and the cost of the slot path.

    python benchmarks/experts_slice.py [--experts 32] [--layers 2] [--out benchmarks/out]

Real 26B-A4B widths (docs/gemma4.md §1.3: hidden 2816, 16 q heads, sliding 8 x 256 / full 2 x 512 K/V,
k_eq_v, dense branch 2112, expert width 704, top-8) on `--layers` layers (sliding then full) and `--experts`
experts per layer (128 in the real model; fewer here so the float32 transformers model that seeds the
file fits on the machine), vocabulary 512, seeded random weights (tests/model_fixtures.randomize), written
as Q4_0 by gem4's writer. Reports:

- exactness: logits of a 64-token prefill and 16 decode steps, resident vs streamed for several slot
  counts (torch.equal), fast mode;
- decode ms/token: resident (each layer one kernels.decode_layer call), resident through the Python layer
  ("resident-py", the path streamed layers take), streamed with 8, 12 and every expert in slots;
- a miss's cost: bytes read into the slots per second (on the read pool, from the repacked copy in the fast
  mode).
Runs are interleaved (A, B, C, A, B, C, ...; median of 3): the machine's cores may be shared.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import gem4  # first: it sets torch's runtime environment (GOMP_SPINCOUNT) before torch loads
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from gem4.weights.checkpoint import open_checkpoint  # noqa: E402
from gem4.weights.gguf_model import write_gguf  # noqa: E402


def build(out: Path, experts: int, layers: int) -> Path:
    from model_fixtures import build_hf

    path = out / f"a4b-slice-{layers}L-{experts}E-q4_0.gguf"
    if path.exists():
        return path
    types = ["sliding_attention"] * (layers - 1) + ["full_attention"]
    causal, _ = build_hf("moe", hidden_size=2816, intermediate_size=2112, num_hidden_layers=layers, layer_types=types,
                         num_attention_heads=16, num_key_value_heads=8, head_dim=256, global_head_dim=512,
                         num_global_key_value_heads=2, num_experts=experts, top_k_experts=8,
                         moe_intermediate_size=704, sliding_window=1024)
    causal.save_pretrained(out / "a4b-slice-hf")
    del causal
    write_gguf(open_checkpoint(out / "a4b-slice-hf"), path, "q4_0")
    return path


def steps(model, prompt: torch.Tensor, n: int) -> tuple[torch.Tensor, float]:
    """-> (logits of the prefill's last row and n greedy decode steps [n + 1, V], decode ms per token)."""
    cache = model.new_cache()
    out = [model.extend(prompt, cache)]
    t0 = time.perf_counter()
    for _ in range(n):
        out.append(model.extend(out[-1].argmax(-1).reshape(1), cache))
    return torch.cat(out), (time.perf_counter() - t0) / n * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks/out")
    ap.add_argument("--steps", type=int, default=16)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    path = build(args.out, args.experts, args.layers)
    prompt = torch.randint(3, 512, (64,), generator=torch.Generator().manual_seed(0))
    models = {"resident": gem4.load(path), "resident-py": gem4.load(path)}
    for layer in models["resident-py"].layers:          # the Python layer, as streamed layers decode
        layer.plan = None
    for slots in (8, 12, args.experts):
        models[f"slots={slots}"] = gem4.load(path, expert_cache_slots=slots)
    want, _ = steps(models["resident"], prompt, args.steps)
    for name, model in models.items():
        got, _ = steps(model, prompt, args.steps)
        print(f"{name:>10}: logits {'bit-identical' if torch.equal(got, want) else 'DIFFER'}", flush=True)
    times = {name: [] for name in models}
    for _ in range(3):
        for name, model in models.items():
            times[name].append(steps(model, prompt, args.steps)[1])
    for name, model in models.items():
        line = f"{name:>10}: decode {statistics.median(times[name]):7.1f} ms/token"
        if model.expert_cache is not None:
            s = model.expert_cache.stats
            line += (f" | hits {s.hits}, misses {s.misses} ({100 * s.hits / (s.hits + s.misses):.0f}% hit), "
                     f"{s.bytes_read / 1e6:.0f} MB read")
        print(line, flush=True)
    # a miss's cost: one layer's top_k experts read into cold slots each time, from the store's source (the
    # repacked copy in the fast mode, else the GGUF with a conversion)
    cache = models["slots=8"].layers[0].experts.store
    t0, n = time.perf_counter(), 0
    for start in range(0, args.experts - 8 + 1, 8):
        cache.load(list(range(start, start + 8)))
        n += 8
    dt = time.perf_counter() - t0
    per = cache.source.nbytes
    print(f"miss ({type(cache.source).__name__}): {n} experts of {per / 1e6:.2f} MB in {dt * 1000:.0f} ms = "
          f"{n * per / dt / 1e9:.2f} GB/s ({dt / n * 1000:.2f} ms per expert)")


if __name__ == "__main__":
    main()
