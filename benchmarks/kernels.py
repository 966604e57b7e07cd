"""Per-op timings of the compiled CPU kernels, the figures kernel commits quote ("one 6144 x 1536 Q4_0 weight,
8 rows: 0.24 ms"), so the next change can be measured the same way.

    python benchmarks/kernels.py                                  # every op, the default shapes
    python benchmarks/kernels.py --ops gemv linear --types q4_0 --rows 1 8 --repeats 7
    python benchmarks/kernels.py --cold                           # weights out of cache (a fresh copy per call)
    python benchmarks/kernels.py --gem4-src ../other/src          # another checkout's kernels, for an A/B

Ops (their Python wrappers in gem4.model.kernels):
- gemv: x [rows, k] @ W.T for W packed in the kernels' layout (the decode GEMV), per type, at 1 / 2 / 8 rows
- linear: the same through the prefill GEMM (W turned into bf16 32 rows at a time), at 32 / 512 rows
- gemv_bf16 / linear_bf16: a bf16 weight as stored
- attend: one decode query row per sequence against a context of --context keys
- attend_chunk: a prefill chunk of --chunk rows against its keys
  (both over a KV cache of each --kv dtype: bfloat16, int8, fp8_e4m3)

Each case runs --warmup calls, then --repeats timed rounds of --calls calls; the table gives the median ms a
call and the min-max of the rounds. AMX: as the machine grants it unless --no-amx. In-cache by default (the
same weight every call: the kernel's compute bound); --cold reads a weight that is not in any cache level
(a new 8-weight ring each call, 8 x the weight > L3 for the large shapes), the memory-bound case decode
lives in. Interleave two checkouts with --gem4-src to compare; never trust a single run on a shared host.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

SHAPES = [(6144, 1536), (1536, 6144), (2048, 1536)]          # E2B's MLP up / down, attention q-ish
TYPES = ["q8_0", "q4_0", "q4_k", "q6_k"]
ROWS = {"gemv": [1, 2, 8], "linear": [32, 512], "gemv_bf16": [1, 8], "linear_bf16": [32, 512]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", nargs="+", default=["gemv", "linear", "gemv_bf16", "linear_bf16", "attend",
                                                 "attend_chunk"])
    ap.add_argument("--types", nargs="+", default=TYPES)
    ap.add_argument("--rows", nargs="+", type=int, default=None, help="rows of x (default: per op)")
    ap.add_argument("--shapes", nargs="+", default=None, help="N:K pairs (default: E2B's)")
    ap.add_argument("--context", type=int, default=512, help="keys an attend query sees")
    ap.add_argument("--chunk", type=int, default=256, help="rows of an attend_chunk call")
    ap.add_argument("--kv", nargs="+", default=["bfloat16"], choices=["bfloat16", "int8", "fp8_e4m3"],
                    help="the KV cache dtypes attend / attend_chunk read")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--cold", action="store_true", help="a weight out of every cache level each call")
    ap.add_argument("--no-amx", action="store_true")
    ap.add_argument("--gem4-src", type=Path, default=None, help="put this directory first on sys.path")
    args = ap.parse_args()
    if args.gem4_src is not None:
        sys.path.insert(0, str(args.gem4_src.resolve()))

    import gem4  # noqa: F401  first: the OpenMP settings before torch loads
    import torch

    from gem4.model import kernels
    from gem4.ggml import GGMLType, quantize

    if not kernels.available():
        sys.exit(f"the compiled kernels are not available here: {kernels.describe()}")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.no_amx:
        kernels.set_amx(False)
    shapes = [tuple(int(v) for v in s.split(":")) for s in args.shapes] if args.shapes else SHAPES
    g = torch.Generator().manual_seed(0)
    rows_of = {op: args.rows or ROWS.get(op, []) for op in args.ops}

    def timed(fn) -> tuple[float, float, float]:
        for _ in range(args.warmup):
            fn()
        rounds = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            for _ in range(args.calls):
                fn()
            rounds.append((time.perf_counter() - start) / args.calls * 1e3)
        return statistics.median(rounds), min(rounds), max(rounds)

    def ring(make):
        """8 copies when --cold (one per call, round robin), else one."""
        items = [make() for _ in range(8 if args.cold else 1)]
        state = [0]

        def next_item():
            state[0] = (state[0] + 1) % len(items)
            return items[state[0]]
        return next_item

    results = []
    for op in args.ops:
        if op in ("gemv", "linear"):
            for t in args.types:
                ggml_type = GGMLType[t.upper()]
                for n, k in shapes:
                    raw = quantize(torch.randn(n, k, generator=g) * 0.05, ggml_type)
                    weight = ring(lambda: kernels.repack(raw, n, k, ggml_type))
                    for m in rows_of[op]:
                        x = torch.randn(m, k, generator=g)
                        fn = getattr(kernels, op)
                        results.append((op, t, f"{n}x{k}", m, timed(lambda: fn(x, weight(), n, k, ggml_type))))
        elif op in ("gemv_bf16", "linear_bf16"):
            for n, k in shapes:
                weight = ring(lambda: (torch.randn(n, k, generator=g) * 0.05).bfloat16())
                for m in rows_of[op]:
                    x = torch.randn(m, k, generator=g)
                    fn = getattr(kernels, op)
                    results.append((op, "bf16", f"{n}x{k}", m, timed(lambda: fn(x, weight()))))
        elif op == "attend":
            from gem4.kv_cache import Attend, kv_cache_dtype, quantize
            for kv in args.kv:                                      # the KV cache's stored dtype
                for nh, nkv, d in ((8, 1, 256), (8, 1, 512)):          # E2B's sliding and full layers
                    for seqs in (1, 8):
                        S = args.context
                        k, ks = quantize(torch.randn(seqs * S, nkv, d, generator=g), kv_cache_dtype(kv, torch.bfloat16))
                        v, vs = quantize(torch.randn(seqs * S, nkv, d, generator=g), k.dtype)
                        a = Attend(torch.arange(seqs * S).view(seqs, S), torch.arange(seqs),
                                   torch.zeros(seqs, dtype=torch.long), torch.full((seqs,), S))
                        q = torch.randn(seqs, nh, d, generator=g)
                        results.append((op, kv, f"{nh}/{nkv}x{d} ctx {S}", seqs,
                                        timed(lambda: kernels.attend(q, k, v, a, ks, vs))))
        elif op == "attend_chunk":
            from gem4.kv_cache import kv_cache_dtype, quantize
            for kv in args.kv:
                for nh, nkv, d in ((8, 1, 256), (8, 1, 512)):
                    T, S = args.chunk, args.context
                    k, ks = quantize(torch.randn(S, nkv, d, generator=g), kv_cache_dtype(kv, torch.bfloat16))
                    v, vs = quantize(torch.randn(S, nkv, d, generator=g), k.dtype)
                    pos = torch.arange(S - T, S)[:, None]
                    mask = torch.arange(S)[None, :] <= pos                 # causal over the last T positions
                    q = torch.randn(T, nh, d, generator=g)
                    results.append((op, kv, f"{nh}/{nkv}x{d} ctx {S}", T,
                                    timed(lambda: kernels.attend_chunk(q, k, v, mask, ks, vs))))
        else:
            sys.exit(f"unknown op {op!r}")

    amx = kernels.set_amx()
    print(f"threads {torch.get_num_threads()}, AMX {'on' if amx else 'off'}, {'cold' if args.cold else 'in cache'}, "
          f"{args.repeats} rounds of {args.calls} calls")
    print("| op | type | shape | rows | ms a call (median) | min-max |")
    print("|---|---|---|---|---|---|")
    for op, t, shape, m, (med, lo, hi) in results:
        print(f"| {op} | {t} | {shape} | {m} | {med:.3f} | {lo:.3f}-{hi:.3f} |")


if __name__ == "__main__":
    main()
