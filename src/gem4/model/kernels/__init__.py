"""Compiled CPU kernels of the fast mode, built once per machine on first use.

- `repack(raw, n_out, k_in, ggml_type)`: Q8_0 / Q4_0 GGML blocks -> the kernels' "x16" layout (once at
  load, same size give or take the padding of a row's last 16 blocks; `ggml_gemv.cpp` describes it).
  `gemv(x, packed, ...)`: y = x @ W.T read straight from it (decode); `gemv_multi` (Q, K, V from one
  input) and `gemv_glu` (gelu(gate) * up) fuse the calls that share x; `linear` is prefill's GEMM
  (bf16 tiles of W, each multiplied while in cache); `dequant`: rows of W in float32 / bf16 (token tables).
- `gemv_bf16(x, w)`: the same product for bf16 weights as they are stored (`bf16_gemv.cpp`).
- `rms_norm`, `rms_norm_rope`, `attend`, `gelu_mul`, `softcap`: the decode step's small operations,
  one call each instead of several torch ops (`decode_ops.cpp`; shared SIMD helpers in `simd.h`).
- `attend_chunk`: a prefill chunk's attention with bf16 GEMMs, skipping key blocks no query of a block
  sees (`chunk_attention.cpp`).
- `decode_layer`: a whole decoder layer of a decode step in one call, the kernels above in the order the
  Python layer calls them (`decode_layer.cpp`, declarations shared through `ops.h`).

torch's cpp_extension compiles the C++ sources beside this file with the host's own instruction set
(-march=native, AVX-512 required) into TORCH_EXTENSIONS_DIR. Where that is impossible `available()`
is False and callers keep the reference path (model/layers.py), which these kernels are tested against.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
from pathlib import Path

import torch

from gem4.weights.quants import GGMLType

SOURCES = [Path(__file__).with_name(name) for name in ("ggml_gemv.cpp", "bf16_gemv.cpp", "decode_ops.cpp", "chunk_attention.cpp", "decode_layer.cpp")]
HEADERS = [Path(__file__).with_name(name) for name in ("simd.h", "ops.h")]
CPU_FLAGS = {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "f16c"}   # what the sources use
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
    """True once the kernels are compiled and loaded (compiles on the first call, ~1 min on 2 cores)."""
    if os.environ.get("GEM4_NO_KERNELS") or not CPU_FLAGS <= _cpu_flags():
        return False
    from torch.utils.cpp_extension import load

    # the build is named by its sources' digest: torch rebuilds on a changed source, but not on a changed header
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES + HEADERS)).hexdigest()[:12]
    # -fopenmp: at::parallel_for is an inline OpenMP loop; without the flag it silently runs serially
    load(name=f"gem4_kernels_{digest}", sources=[str(p) for p in SOURCES], extra_cflags=["-O3", "-march=native", "-fopenmp"],
         extra_ldflags=["-fopenmp"],
         is_python_module=False, verbose=False)
    return True


@functools.lru_cache(maxsize=None)
def _ops():
    if not available():
        raise RuntimeError("gem4's compiled kernels are unavailable on this machine (AVX-512 and a C++ compiler "
                           "are needed); load the model in float32 mode")
    return torch.ops.gem4_kernels


# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


@functools.lru_cache(maxsize=None)
def keep_heap() -> bool:
    """Let this process's heap keep the memory a prefill frees, so the next one reuses it (glibc only;
    False elsewhere, with no effect).

    By default glibc hands large blocks back to the kernel on free (fresh mmaps, a trimmed heap top),
    and every prefill page-faults its temporaries in again: ~200k faults, 0.1-0.25 s of a 512-token
    prefill (E2B Q8_0), measured. With blocks up to 32 MiB served from the heap and the heap top
    trimmed only past 1 GiB, the first prefill faults ~35k times and later ones a few thousand. The
    cost is resident memory the size of a prefill's temporaries that stays with the process.
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, 32 << 20) and mallopt(_M_TRIM_THRESHOLD, 1 << 30))


def repack(raw: torch.Tensor, n_out: int, k_in: int, ggml_type: GGMLType) -> torch.Tensor:
    """GGML bytes of an [n_out, k_in] Q8_0 / Q4_0 weight -> its x16 layout [n_out, packed_row_bytes] uint8."""
    return _ops().repack_x16(raw.contiguous(), n_out, k_in, int(ggml_type))


def gemv(x: torch.Tensor, packed: torch.Tensor, n_out: int, k_in: int, ggml_type: GGMLType) -> torch.Tensor:
    """x [M, k_in] float32, packed x16 weight -> x @ W.T [M, n_out] float32 (activations quantized per
    32-block to int16: relative error <= 2^-16 of the block's largest value)."""
    return _ops().gemv_x16(x, packed, n_out, k_in, int(ggml_type))


def gemv_bf16(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 @ w.T for a bf16 weight w [N, K] -> [M, N] float32; x enters as two bf16 terms
    (hi + lo, ~16 bits), products summed in float32."""
    return _ops().gemv_bf16(x, w)


def linear(x: torch.Tensor, packed: torch.Tensor, n_out: int, k_in: int, ggml_type: GGMLType) -> torch.Tensor:
    """x [T, k_in] bf16 @ W.T -> [T, n_out] bf16 (prefill): W turned into bf16 a cache-sized tile at a time."""
    return _ops().linear_x16(x.contiguous(), packed, n_out, k_in, int(ggml_type))


def dequant(packed: torch.Tensor, k_in: int, ggml_type: GGMLType, dtype: torch.dtype) -> torch.Tensor:
    """Rows of a packed x16 weight [R, packed_row_bytes] -> [R, k_in] in float32 (exact) or bfloat16."""
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"dequant gives float32 or bfloat16, not {dtype}")
    return _ops().dequant_x16(packed.contiguous(), packed.shape[0], k_in, int(ggml_type), dtype == torch.bfloat16)


def gemv_multi(x: torch.Tensor, packed: list[torch.Tensor], n_outs: list[int], k_in: int,
               ggml_type: GGMLType) -> list[torch.Tensor]:
    """The same x through several packed weights of one type: [x @ W_i.T], one pass over all their rows."""
    return _ops().gemv_x16_multi(x, packed, n_outs, k_in, int(ggml_type))


def gemv_glu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, n_out: int, k_in: int, ggml_type: GGMLType) -> torch.Tensor:
    """gelu_tanh(x @ Gate.T) * (x @ Up.T) [M, n_out] float32, both weights packed, in one pass."""
    return _ops().gemv_x16_glu(x, gate, up, n_out, k_in, int(ggml_type))


def gelu_mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(a) * b for float32 tensors of one shape."""
    return _ops().gelu_mul(a.contiguous(), b.contiguous())


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(x / cap), float32."""
    return _ops().softcap(x.contiguous(), cap)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., D] float32 -> x * (mean(x^2) + eps)^-1/2 [* weight] [+ residual] (layers.rms_norm, one call)."""
    return _ops().rms_norm(x.contiguous(), weight, eps, None if residual is None else residual.contiguous())


def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, d] float32, cos/sin [T, 1, d] -> apply_rope(rms_norm(x, weight, eps), cos, sin)."""
    return _ops().rms_norm_rope(x.contiguous(), weight, eps, cos, sin)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q [T, nh, d] float32, k/v [S, nkv, d] bf16, mask [T, S] bool -> [T, nh*d] float32 (layers.attention)."""
    return _ops().attend(q.contiguous(), k, v, mask.contiguous())


def attend_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """attend() for a prefill chunk, on bf16 dot products with float32 sums: q as two bf16 terms (hi + lo),
    the probabilities rounded to bf16; per block of query rows, the key rows no query of it sees are skipped."""
    return _ops().attend_chunk(q.contiguous(), k, v, mask.contiguous())


def decode_layer(x: torch.Tensor, ple: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                 k_store: torch.Tensor, v_store: torch.Tensor, rows: torch.Tensor | None, span: int,
                 weights: list[torch.Tensor], dims: list[int], eps: float) -> torch.Tensor:
    """One decoder layer for a decode-sized x [T, H] float32 (decode_layer.cpp lists the arguments); writes
    this step's k/v into the cache stores at `rows` when the layer owns its KV."""
    return _ops().decode_layer(x, ple, cos, sin, mask, k_store, v_store, rows, span, weights, dims, eps)
