"""One-row GEMV (a decode step's product) on the same random weights as Q4_0, MLX_A4, Q4_1, Q8_0 and MLX_A8 (issue 31),
interleaved call by call, min and median of 40 calls, 2 threads, E2B shapes (MLX ones quantized by mlx, groups of 64).

    python benchmarks/affine_gemv.py
"""
from __future__ import annotations

import statistics
import time

import gem4  # noqa: F401  first: torch's runtime environment
import mlx.core as mx
import numpy as np
import torch

from gem4.ggml import GGMLType, quantize
from gem4.model import kernels
from gem4.weights.mlx import AffineTensor

TYPES = [GGMLType.Q4_0, GGMLType.MLX_A4, GGMLType.Q4_1, GGMLType.Q8_0, GGMLType.MLX_A8]


def packed(w: torch.Tensor, t: GGMLType) -> torch.Tensor:
    """w [N, K] in type t, in the kernels' layout."""
    if t in (GGMLType.MLX_A4, GGMLType.MLX_A8):
        bits = 4 if t == GGMLType.MLX_A4 else 8
        q, s, b = mx.quantize(mx.array(w.numpy()).astype(mx.bfloat16), group_size=64, bits=bits)
        at = AffineTensor("w", lambda: torch.from_numpy(np.array(q)), lambda: torch.from_numpy(np.array(s.astype(mx.float32))).bfloat16(),
                          lambda: torch.from_numpy(np.array(b.astype(mx.float32))).bfloat16(), 64, bits)
        raw, _ = at.blocks()
        return kernels.repack(raw.reshape(-1), w.shape[0], w.shape[1], t)
    return kernels.repack(quantize(w, t), w.shape[0], w.shape[1], t)


def main() -> None:
    torch.set_num_threads(2)
    for N, K in ((6144, 1536), (1536, 6144), (65536, 1536)):
        w = torch.randn(N, K, generator=torch.Generator().manual_seed(N)) * 0.02
        ps = {t: packed(w, t) for t in TYPES}
        x = torch.randn(1, K)
        times: dict[GGMLType, list[float]] = {t: [] for t in TYPES}
        for _ in range(40):
            for t in TYPES:
                t0 = time.perf_counter()
                kernels.gemv(x, ps[t], N, K, t)
                times[t].append(time.perf_counter() - t0)
        print(f"{N} x {K}: " + "  ".join(f"{t.name} {1e3 * min(v):.3f} / {1e3 * statistics.median(v):.3f}"
                                          for t, v in times.items()) + "  (ms, min / median)")


if __name__ == "__main__":
    main()
