"""Compiled CPU kernels of the fast mode, built once per machine on first use.

- `repack(raw, n_out, k_in, ggml_type)`: GGML blocks -> the kernels' layout, once at load, lossless: Q8_0 / Q4_0
  in panels of 16 rows (`panels.h`; the same size, the row count padded to a multiple of 16), Q4_1 / Q5_0 /
  Q5_1 / Q4_K / Q5_K / Q6_K / MLX_A4 / MLX_A8 in "x16" rows (the file's size: a row's last, partial group of 16
  blocks is a tail group, unpadded; Q4_K / Q5_K add 4 bytes per 256 weights, their 6-bit scales unpacked; Q5_0 /
  Q5_1 high bits as Q5_K's; `ggml_gemv.cpp` and `kquants.h` describe it).
  `gemv(x, packed, ...)`: y = x @ W.T read straight from it (decode; on Q8_0 / Q4_0 panels passes of 2-8 rows
  of x run on AMX tiles where the CPU grants them, bit-identical to the VNNI kernel: `set_amx`); `gemv_multi`
  (Q, K, V from one input) and `gemv_glu` (gelu(gate) * up) fuse the calls that share x; `linear` is prefill's
  GEMM (`tile_gemm.cpp`: 32 rows of W at a time turned into bf16 and multiplied while in cache, on AMX tiles where
  granted; row-invariant: a row's result does not depend on the other rows); `dequant`: rows of W in float32 /
  bf16 (token tables).
- `gemv_bf16(x, w)` / `linear_bf16(x, w)`: the same products for bf16 weights as they are stored (`bf16_gemv.cpp`).
- `rms_norm`, `rms_norm_rope`, `attend`, `gelu_mul`, `softcap`: the decode step's small operations,
  one call each instead of several torch ops (`decode_ops.cpp`; shared SIMD helpers in `simd.h`).
- `attend_chunk`: a prefill chunk's attention with bf16 GEMMs, skipping key blocks no query of a block
  sees (`chunk_attention.cpp`).
- `decode_layer`: a whole decoder layer of a decode step in one call, the kernels above in the order the
  Python layer calls them (`decode_layer.cpp`, declarations shared through `ops.h`).

The library is built, loaded and described (`gem4 doctor`) by `build.py`; its sources register the ops under
torch.ops.gem4_kernels, each wrapped here by a function of the same name (`linear` is the op linear_packed).
"""
from __future__ import annotations

import ctypes
import functools

import torch

from gem4.ggml import GGMLType
from gem4.model.kernels import build
from gem4.model.kernels.build import describe

PACKED_TYPES = frozenset({GGMLType.Q4_0, GGMLType.Q8_0,    # formats the compiled kernels read
                          GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1,
                          GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K,
                          GGMLType.MLX_A4, GGMLType.MLX_A8})        # gem4's blocks of MLX affine checkpoints
PANEL_TYPES = frozenset({GGMLType.Q4_0, GGMLType.Q8_0})   # of those, packed in 16-row panels (panels.h):
                                                          # N padded to 16, no padding along k


def available() -> bool:
    """True once the kernels are compiled and loaded (compiles on the first call of the first process,
    announced on stderr; later processes load the cached library). False, with the reason in describe(),
    when disabled, unsupported by the CPU or the build failed (then one warning on stderr)."""
    return build.load()


@functools.lru_cache(maxsize=None)
def _ops():
    if not available():
        raise RuntimeError(f"gem4's compiled kernels are unavailable ({build.status['reason']}); load the model in "
                           "float32 mode")
    return torch.ops.gem4_kernels


# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def keep_heap(keep: bool = True) -> bool:
    """Let this process's heap keep the memory a prefill frees, so the next one reuses it (glibc only;
    False elsewhere, with no effect). keep=False hands it back (blocks from 128 KiB mapped fresh and unmapped
    on free, the heap top trimmed past 128 KiB): what a process within a memory limit wants, where a
    26B-A4B 512-token prefill otherwise leaves ~2 GB of temporaries in the heap. Each call sets the process's
    allocator anew (a model loaded later decides for all).

    By default glibc hands large blocks back to the kernel on free (fresh mmaps, a trimmed heap top),
    and every prefill page-faults its temporaries in again: ~200k faults, 0.1-0.25 s of a 512-token
    prefill (E2B Q8_0), measured. With blocks up to 32 MiB served from the heap and the heap top
    trimmed only past 1 GiB, the first prefill faults ~35k times and later ones a few thousand. The
    cost is resident memory the size of a prefill's temporaries that stays with the process.
    """
    try:
        libc = ctypes.CDLL(None)
        mallopt, malloc_trim = libc.mallopt, libc.malloc_trim
    except (OSError, AttributeError):
        return False
    mmap_threshold, trim_threshold = (32 << 20, 1 << 30) if keep else (128 << 10, 128 << 10)
    done = bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold) and mallopt(_M_TRIM_THRESHOLD, trim_threshold))
    if not keep:
        malloc_trim(0)                                   # what the heap kept so far goes back now
    return done


def repack(raw: torch.Tensor, n_out: int, k_in: int, ggml_type: GGMLType, units: int = 1) -> torch.Tensor:
    """GGML bytes of an [n_out, k_in] weight of a PACKED_TYPES type -> the kernels' layout, uint8 [rows, row_bytes]
    (Q8_0 / Q4_0: panels of 16 rows, the rows padded to a multiple of 16; the other types: x16, whose rows are not
    separable: `units` stacked weights of n_out / units rows each (experts), each a packed weight of its own that
    a slice of those rows gives)."""
    return _ops().repack(raw.contiguous(), n_out, k_in, int(ggml_type), units)


def affine_blocks(q: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """An MLX affine weight as its checkpoint stores it (q int32 [R, k_in * bits / 32], bf16 scales / biases
    [R, k_in / group]) -> gem4's MLX_A4 / MLX_A8 blocks uint8 [R, k_in / 32 * block bytes] (`mlx_affine.cpp`):
    weights/mlx.py's regrouping in one pass, the same bytes."""
    return _ops().affine_blocks(q.contiguous(), scales.contiguous(), biases.contiguous(), bits, group)


def gemv(x: torch.Tensor, packed: torch.Tensor, n_out: int, k_in: int, ggml_type: GGMLType) -> torch.Tensor:
    """x [M, k_in] float32, packed weight -> x @ W.T [M, n_out] float32, activations quantized per 32-block:
    Q8_0 / Q4_0 (panels.h) to int8, scale amax / 127, round to nearest (GGML's Q8_0 activations: each value
    moves by at most half a step, 1/254 of the block's largest); the x16 types to int16 (2^-16 of it)."""
    return _ops().gemv(x, packed, n_out, k_in, int(ggml_type))


def gemv_bf16(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 @ w.T for a bf16 weight w [N, K] -> [M, N] float32; x enters as two bf16 terms
    (hi + lo, ~16 bits), products summed in float32."""
    return _ops().gemv_bf16(x, w)


def linear(x: torch.Tensor, packed: torch.Tensor, n_out: int, k_in: int, ggml_type: GGMLType) -> torch.Tensor:
    """x [T, k_in] (rounded to bf16) @ W.T -> [T, n_out] float32 (prefill), row-invariant: each row's result is the
    same float whatever the other rows (tile_gemm.cpp); W turned into bf16 32 rows at a time."""
    return _ops().linear_packed(x.to(torch.bfloat16).contiguous(), packed, n_out, k_in, int(ggml_type))


def linear_bf16(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, K] (rounded to bf16) @ w.T for a bf16 weight [N, K] -> [T, N] float32 (prefill), row-invariant as `linear`."""
    return _ops().linear_bf16(x.to(torch.bfloat16).contiguous(), w)


def dequant(packed: torch.Tensor, k_in: int, ggml_type: GGMLType, dtype: torch.dtype,
            rows: torch.Tensor | None = None) -> torch.Tensor:
    """A packed weight -> its rows [R, k_in] in float32 (exact) or bfloat16: all the packed tensor's rows (Q8_0 /
    Q4_0 panels: padded to a multiple of 16 with zero rows), or those with the ids `rows` [R]."""
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"dequant gives float32 or bfloat16, not {dtype}")
    ids = None if rows is None else rows.to(torch.int64).contiguous()
    return _ops().dequant(packed.contiguous(), k_in, int(ggml_type), dtype == torch.bfloat16, ids)


def ggml_types() -> dict[str, tuple[int, int, int]]:
    """The GGML types the kernels know (ggml_types.h): name -> (type id, weights per block, bytes per block)."""
    names, ids, block_sizes, type_sizes = _ops().ggml_types()
    return {name: (i, b, t) for name, i, b, t in zip(names, ids, block_sizes, type_sizes)}


def set_amx(enable: bool | None = None) -> bool:
    """Whether GEMV passes of 2-8 rows over Q8_0 / Q4_0 weights and the prefill GEMM (`linear`, `linear_bf16`) run
    on AMX tiles (on by default where the CPU and kernel grant AMX, unless GEM4_NO_AMX is set: gem4.paths, applied
    when the library loads); enable=True / False
    switches (True only where granted). The two GEMVs give the same results bit for bit; the two GEMMs each its
    own (each row-invariant). The switch is for tests and benchmarks."""
    return bool(_ops().set_amx(-1 if enable is None else int(enable)))


def gemv_multi(x: torch.Tensor, packed: list[torch.Tensor], n_outs: list[int], k_in: int,
               ggml_type: GGMLType) -> list[torch.Tensor]:
    """The same x through several packed weights of one type: [x @ W_i.T], one pass over all their rows."""
    return _ops().gemv_multi(x, packed, n_outs, k_in, int(ggml_type))


def gemv_glu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, n_out: int, k_in: int, ggml_type: GGMLType) -> torch.Tensor:
    """gelu_tanh(x @ Gate.T) * (x @ Up.T) [M, n_out] float32, both weights packed, in one pass."""
    return _ops().gemv_glu(x, gate, up, n_out, k_in, int(ggml_type))


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


def attend(q: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor, a, k_scale: torch.Tensor | None = None,
           v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, nh, d] float32 against the KV storage [R, nkv, d] of several sequences -- bf16, float8_e4m3fn, or int8
    with its scales [R, nkv] float32 (kv_cache.LayerKV) --; `a` (kv_cache.Attend) says which rows each query row
    sees -> [T, nh*d] float32 (layers.attention). 8-bit rows are dequantized as they are read: int8 as
    scale * (q . k_int8) and p * scale for V, fp8 exactly (within float32 rounding of the reference)."""
    return _ops().attend(q.contiguous(), k_store, v_store, a.key_rows, a.q_seq, a.q_lo, a.q_hi, k_scale, v_scale)


def attend_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                 k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """attend() for a prefill chunk, on bf16 dot products with float32 sums: q as two bf16 terms (hi + lo),
    the probabilities rounded to bf16; per block of query rows, the key rows no query of it sees are skipped.
    k / v [S, nkv, d] as attend() takes them: int8 and fp8 values are exact in bf16, an int8 row's scale
    multiplies its scores (K) and its probabilities before their rounding (V)."""
    return _ops().attend_chunk(q.contiguous(), k, v, mask.contiguous(), k_scale, v_scale)


def decode_layer_schema() -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """The names of decode_layer's weights and dims in the order it takes them (decode_layer.cpp): a dense layer's
    weights, its dims (each linear's as "<linear>.<dim>"), and what 26B-A4B layers append to each."""
    return tuple(tuple(names) for names in _ops().decode_layer_schema())


def decode_layer(x: torch.Tensor, ple: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                 k_store: torch.Tensor, v_store: torch.Tensor, rows: torch.Tensor | None, a,
                 weights: list[torch.Tensor], dims: list[int], eps: float, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """One decoder layer for a decode-sized x [T, H] float32 (decode_layer.cpp lists the arguments); writes
    this step's k/v into the storage at `rows` when the layer owns its KV (quantized as kv_cache.quantize does,
    bit for bit: int8 with its scales k_scale / v_scale), then attends as `a` (kv_cache.Attend) says."""
    return _ops().decode_layer(x, ple, cos, sin, k_store, v_store, rows, a.key_rows, a.q_seq, a.q_lo, a.q_hi,
                               weights, dims, eps, k_scale, v_scale)
