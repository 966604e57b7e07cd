"""x16 tail groups (issue 37): resident bytes of a 26B-A4B-width Q4_K_M slice and the decode GEMV at its shapes.

    python benchmarks/tail_groups.py sizes [--experts 32] [--layers 2] [--out benchmarks/out]
    python benchmarks/tail_groups.py gemv [--calls 6] [--threads 1]
    python benchmarks/tail_groups.py linear [--threads 1]
    python benchmarks/tail_groups.py decode [--steps 32] [--save logits.pt]

Run each against two checkouts, alternating processes (PYTHONPATH=<old>/src, then <new>/src, ...): the script
measures the code it imports.

- sizes: the slice of experts_slice.py (hidden 2816, dense branch 2112, experts 704, `--experts` experts a layer)
  written by gem4's writer in llama.cpp's Q4_K_M mix (Q4_K, Q6_K, and Q5_0 / Q8_0 where rows are not whole
  256-blocks), loaded in the fast mode: the bytes of every packed weight against the same tensors' bytes in the
  file, by type.
- gemv: one decode row through kernels.gemv at the slice's shapes, each weight repeated in copies that add up to
  256 MB so that every call reads its weight from memory, not from cache; median ms per call.
- linear: a 128-token prefill chunk through kernels.linear at the same shapes (the weight in cache: what the
  tail groups change here is the dequantization into bf16 tiles); median ms of 15 calls.
- decode: the slice in the fast mode, a 64-token prefill and `--steps` greedy decode steps (each layer one
  kernels.decode_layer call): ms per step; `--save` keeps the logits, to compare two checkouts' bit for bit.
Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import gem4  # first: it sets torch's runtime environment (GOMP_SPINCOUNT) before torch loads
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

# (name, n_out, k_in, type): 26B-A4B's expert gate_up and down (704 inputs: Q5_0 in Q4_K_M), the dense branch's
# gate / up and down (2112 inputs: Q5_0), and the attention's v projection in Q6_K
SHAPES = [("experts.gate_up Q4_K", 1408, 2816, "Q4_K"), ("experts.down Q5_0", 2816, 704, "Q5_0"),
          ("mlp.gate Q4_K", 2112, 2816, "Q4_K"), ("mlp.down Q5_0", 2816, 2112, "Q5_0"),
          ("v_proj Q6_K", 2048, 2816, "Q6_K")]


def build(out: Path, experts: int, layers: int) -> Path:
    from gem4.weights.checkpoint import open_checkpoint
    from gem4.weights.gguf_model import write_gguf
    from model_fixtures import build_hf

    path = out / f"a4b-slice-{layers}L-{experts}E-q4_k_m.gguf"
    if path.exists():
        return path
    types = ["sliding_attention"] * (layers - 1) + ["full_attention"]
    causal, _ = build_hf("moe", hidden_size=2816, intermediate_size=2112, num_hidden_layers=layers, layer_types=types,
                         num_attention_heads=16, num_key_value_heads=8, head_dim=256, global_head_dim=512,
                         num_global_key_value_heads=2, num_experts=experts, top_k_experts=8,
                         moe_intermediate_size=704, sliding_window=1024)
    causal.save_pretrained(out / "a4b-slice-hf-kq")
    del causal
    write_gguf(open_checkpoint(out / "a4b-slice-hf-kq"), path, "q4_k_m")
    return path


def sizes(args) -> dict:
    from gem4.ggml import GGMLType
    from gem4.gguf import GGUFReader
    from gem4.model import kernels
    from gem4.model.cpu import KernelExperts

    path = build(args.out, args.experts, args.layers)
    file_bytes = {t.name: (t.ggml_type, t.nbytes) for t in GGUFReader(path).tensors.values()}
    model = gem4.load(path)
    by_type = defaultdict(lambda: [0, 0])               # type -> [file bytes, packed bytes]
    for module in model.modules():
        if isinstance(module, KernelExperts):
            for what, t in module.packed_types.items():
                by_type[t.name][1] += getattr(module, what).numel()
        elif getattr(module, "layout", None) == "packed":
            by_type[GGMLType(module.ggml_type).name][1] += module.packed.numel()
    counts = [0, 0]                                     # tensors of the kernels' types: in the file, packed
    for module in model.modules():
        counts[1] += len(module.packed_types) if isinstance(module, KernelExperts) else getattr(module, "layout", None) == "packed"
    for t, n in file_bytes.values():
        if GGMLType(t) in kernels.PACKED_TYPES:
            by_type[GGMLType(t).name][0] += n
            counts[0] += 1
    assert counts[0] == counts[1], f"{counts[0]} tensors of the kernels' types in the file, {counts[1]} packed"
    file_total = sum(f for f, _ in by_type.values())
    packed = sum(p for _, p in by_type.values())
    return {"file": str(path), "by_type": {k: {"file": f, "packed": p, "ratio": round(p / f, 4)} for k, (f, p) in by_type.items()},
            "file_bytes": file_total, "packed_bytes": packed, "ratio": round(packed / file_total, 4)}


def gemv(args) -> dict:
    from gem4.ggml import GGMLType, quantize
    from gem4.model import kernels

    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    out = {}
    for name, n, k, tname in SHAPES:
        t = GGMLType[tname]
        raw = quantize(torch.randn(n, k, generator=g) * 0.1, t).reshape(-1)
        one = kernels.repack(raw, n, k, t)
        copies = [one.clone() for _ in range(max(2, (256 << 20) // one.numel()))]
        x = torch.randn(1, k, generator=g)
        for w in copies[:4]:
            kernels.gemv(x, w, n, k, t)
        times = []
        for _ in range(args.calls):
            for w in copies:
                t0 = time.perf_counter()
                kernels.gemv(x, w, n, k, t)
                times.append(time.perf_counter() - t0)
        out[name] = {"ms": round(statistics.median(times) * 1e3, 4), "bytes": one.numel(),
                     "GB/s": round(one.numel() / statistics.median(times) / 1e9, 2)}
        del copies
    return out


def linear(args) -> dict:
    from gem4.ggml import GGMLType, quantize
    from gem4.model import kernels

    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    out = {}
    for name, n, k, tname in SHAPES:
        t = GGMLType[tname]
        w = kernels.repack(quantize(torch.randn(n, k, generator=g) * 0.1, t).reshape(-1), n, k, t)
        x = torch.randn(128, k, generator=g)
        kernels.linear(x, w, n, k, t)
        times = []
        for _ in range(15):
            t0 = time.perf_counter()
            kernels.linear(x, w, n, k, t)
            times.append(time.perf_counter() - t0)
        out[name] = {"ms": round(statistics.median(times) * 1e3, 3)}
    return out


def decode(args) -> dict:
    torch.set_num_threads(args.threads)
    model = gem4.load(build(args.out, args.experts, args.layers))
    prompt = torch.randint(0, 512, (64,), generator=torch.Generator().manual_seed(0))
    cache = model.new_cache()
    out = [model.extend(prompt, cache)]
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        out.append(model.extend(out[-1].argmax(-1).reshape(1), cache))
        times.append(time.perf_counter() - t0)
    if args.save:
        torch.save(torch.cat(out), args.save)
    return {"decode ms/step": round(statistics.median(times) * 1e3, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["sizes", "gemv", "linear", "decode"])
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks/out")
    ap.add_argument("--calls", type=int, default=6)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--save", type=Path)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    print(json.dumps({"sizes": sizes, "gemv": gemv, "linear": linear, "decode": decode}[args.what](args)))


if __name__ == "__main__":
    main()
