"""Compiled CPU kernels for packed GGML weights, built once per machine on first use.

`ggml_gemv(x, raw, n_out, ggml_type)`: y = x @ W.T with W read straight from Q8_0 / Q4_0 blocks
(raw: [N, row_bytes] uint8, x: [M, K] float32). The C++ source is `ggml_gemv.cpp` beside this file;
torch's cpp_extension compiles it with the host's own instruction set (-march=native, AVX-512
required) into TORCH_EXTENSIONS_DIR. Where that is impossible `available()` is False and callers
keep the reference path (dequantize + float matmul), which these kernels are tested against.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

from gem4.weights.quants import GGMLType

SOURCE = Path(__file__).with_name("ggml_gemv.cpp")
PACKED_TYPES = frozenset({GGMLType.Q4_0, GGMLType.Q8_0})   # formats the compiled kernels read


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """True once the kernels are compiled and loaded (compiles on the first call, ~30 s)."""
    if os.environ.get("GEM4_NO_KERNELS") or not {"avx512f", "f16c"} <= _cpu_flags():
        return False
    from torch.utils.cpp_extension import load

    # -fopenmp: at::parallel_for is an inline OpenMP loop; without the flag it silently runs serially
    load(name="gem4_ggml_gemv", sources=[str(SOURCE)], extra_cflags=["-O3", "-march=native", "-fopenmp"],
         extra_ldflags=["-fopenmp"],
         is_python_module=False, verbose=False)
    return True


def _ops():
    if not available():
        raise RuntimeError("gem4's compiled kernels are unavailable on this machine (AVX-512 and a C++ compiler "
                           "are needed); load the model in float32 mode")
    return torch.ops.gem4_kernels


def ggml_gemv(x: torch.Tensor, raw: torch.Tensor, n_out: int, ggml_type: int) -> torch.Tensor:
    """x [M, K] float32, raw [N, row_bytes] uint8 GGML blocks -> [M, N] float32."""
    return _ops().ggml_gemv(x, raw, n_out, ggml_type)


def dequant_bf16(raw: torch.Tensor, n_out: int, k_in: int, ggml_type: int) -> torch.Tensor:
    """raw [N, row_bytes] Q8_0 / Q4_0 blocks -> [N, K] bf16 in one pass (equal to dequantize(...).bfloat16())."""
    return _ops().dequant_bf16(raw, n_out, k_in, ggml_type)
