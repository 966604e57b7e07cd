"""GGML tensor types: block geometry, reference dequantization and quantization.

The type table is the single owner of "how many bytes does a GGML tensor of N elements take";
the GGUF reader uses it to bounds-check tensor extents.

`dequantize` / `quantize` below are the *reference* implementations: plain vectorized torch, written
for clarity, and bit-exact against gguf-py's numpy code (``gguf.quants``), which mirrors ggml's C
reference. The fast kernels are tested against them. Float operations are performed in float32 in
exactly the order gguf-py uses (e.g. Q4_1 is ``(d * q) + m``; K-quants compute ``d * scale`` and
``dmin * min`` first, then ``(d*scale) * q - dmin*min``), and fp16 fields are widened to float32
first. fp16 NaNs keep their payload (no quieting), like numpy's conversion. (An fp16 significand
(11 bits) times the small integer sub-scales and quants (<= 13 bits together) fits float32's 24,
so every product here is exact and only the final add/sub rounds.)
Known non-exactness: when *both* operands of that final add/sub are NaN (NaN in d and in m/dmin),
which NaN payload survives depends on the kernel's operand order; all other inputs, ±Inf included,
are bit-exact.

Byte layout of one block (all multi-byte fields little-endian; "f16" is an IEEE half).
Tensor rows (last PyTorch dim) are contiguous and split into consecutive blocks.

    F32   1 elem,    4 B: float32
    F16   1 elem,    2 B: float16
    BF16  1 elem,    2 B: top 16 bits of a float32
    Q4_0  32 elems, 18 B: d:f16 | qs[16]
          elem j = lo nibble of qs[j], elem 16+j = hi nibble;      y = d * (q - 8)
    Q4_1  32 elems, 20 B: d:f16 | m:f16 | qs[16]   (nibbles as Q4_0)  y = d * q + m
    Q5_0  32 elems, 22 B: d:f16 | qh[4] | qs[16]
          bit i of qh (as u32) is bit 4 of elem i; nibbles as Q4_0;   y = d * (q - 16)
    Q5_1  32 elems, 24 B: d:f16 | m:f16 | qh[4] | qs[16]              y = d * q + m
    Q8_0  32 elems, 34 B: d:f16 | qs:int8[32]                         y = d * q
    Q2_K 256 elems, 84 B: scales[16] | qs[64] | d:f16 | dmin:f16
          16 sub-blocks of 16; scales[i] = sc (lo nibble) | min (hi nibble).
          2-bit q: half h in {0,1} uses qs[32h:32h+32]; bits 2s..2s+1 of qs[32h+l] give elem
          128h + 32s + l.                                            y = (d*sc) * q - (dmin*min)
    Q3_K 256 elems, 110 B: hmask[32] | qs[64] | scales[12] | d:f16
          16 sub-blocks of 16; 6-bit scales: lo 4 bits from nibbles of scales[0:8]
          (sub-block i<8: lo nibble of byte i, i>=8: hi nibble of byte i-8), hi 2 bits from
          scales[8 + i%4] >> 2*(i//4).  2-bit q as Q2_K; bit k of hmask[l] belongs to elem 32k + l,
          and a CLEAR bit subtracts 4.                             y = (d * (sc - 32)) * q
    Q4_K 256 elems, 144 B: d:f16 | dmin:f16 | scales[12] | qs[128]
          8 sub-blocks of 32; 6-bit sc/min packed in scales[12] (see _unpack_k_scale_min);
          sub-block 2c = lo nibbles of qs[32c:32c+32], 2c+1 = hi nibbles.   y = (d*sc) * q - (dmin*min)
    Q5_K 256 elems, 176 B: d:f16 | dmin:f16 | scales[12] | qh[32] | qs[128]
          as Q4_K, plus bit g of qh[l] is bit 4 of elem l of sub-block g.
    Q6_K 256 elems, 210 B: ql[128] | qh[64] | scales:int8[16] | d:f16
          16 sub-blocks of 16; half h: ql[64h:64h+64] lo nibbles = elems 128h+0..63, hi nibbles =
          128h+64..127; bits 2s..2s+1 of qh[32h+l] are bits 4-5 of elem 128h + 32s + l.
                                                                     y = (d * sc) * (q - 32)

Two block types are gem4's own, not GGML's (ids from 1000 on; never read from or written to a GGUF file): the
32-weight blocks an MLX affine checkpoint's weights are regrouped into at load (weights/mlx.py), losslessly (a
group of 64 or 128 weights repeats its scale and bias in each of its 32-weight blocks):
    MLX_A4 32 elems, 20 B: s:bf16 | b:bf16 | qs[16] (nibbles as Q4_0)   y = (s * q) + b   (Q4_1, bf16 fields)
    MLX_A8 32 elems, 36 B: s:bf16 | b:bf16 | q:uint8[32]               y = (s * q) + b
(s * q is exact in float32: 8 significant bits times at most 8; only the sum rounds.)
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Callable

import torch


class GGMLType(enum.IntEnum):
    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    BF16 = 30
    MLX_A4 = 1004      # gem4's own (above): MLX affine checkpoints, never in a GGUF file
    MLX_A8 = 1008


GEM4_TYPES = frozenset({GGMLType.MLX_A4, GGMLType.MLX_A8})   # not GGML's: a GGUF reader refuses them


@dataclass(frozen=True)
class BlockInfo:
    block_size: int   # elements per block
    type_size: int    # bytes per block


BLOCK_INFO: dict[GGMLType, BlockInfo] = {
    GGMLType.F32: BlockInfo(1, 4),
    GGMLType.F16: BlockInfo(1, 2),
    GGMLType.BF16: BlockInfo(1, 2),
    GGMLType.F64: BlockInfo(1, 8),
    GGMLType.I8: BlockInfo(1, 1),
    GGMLType.I16: BlockInfo(1, 2),
    GGMLType.I32: BlockInfo(1, 4),
    GGMLType.I64: BlockInfo(1, 8),
    GGMLType.Q4_0: BlockInfo(32, 2 + 16),
    GGMLType.Q4_1: BlockInfo(32, 2 + 2 + 16),
    GGMLType.Q5_0: BlockInfo(32, 2 + 4 + 16),
    GGMLType.Q5_1: BlockInfo(32, 2 + 2 + 4 + 16),
    GGMLType.Q8_0: BlockInfo(32, 2 + 32),
    GGMLType.Q8_1: BlockInfo(32, 4 + 32),
    GGMLType.Q2_K: BlockInfo(256, 16 + 64 + 2 + 2),
    GGMLType.Q3_K: BlockInfo(256, 32 + 64 + 12 + 2),
    GGMLType.Q4_K: BlockInfo(256, 2 + 2 + 12 + 128),
    GGMLType.Q5_K: BlockInfo(256, 2 + 2 + 12 + 32 + 128),
    GGMLType.Q6_K: BlockInfo(256, 128 + 64 + 16 + 2),
    GGMLType.Q8_K: BlockInfo(256, 4 + 256 + 32),
    GGMLType.MLX_A4: BlockInfo(32, 2 + 2 + 16),
    GGMLType.MLX_A8: BlockInfo(32, 2 + 2 + 32),
}


def tensor_nbytes(ggml_type: GGMLType, n_elements: int) -> int:
    """Bytes of a tensor with `n_elements` (must be a whole number of blocks)."""
    info = BLOCK_INFO[ggml_type]
    if n_elements % info.block_size:
        raise ValueError(f"{ggml_type.name}: {n_elements} elements is not a multiple of the block size {info.block_size}")
    return n_elements // info.block_size * info.type_size


# ----------------------------------------------------------------------------------------------
# bit-level helpers
# ----------------------------------------------------------------------------------------------

_INT32_SIGN = -(2 ** 31)   # 0x80000000 as an int32


def _f16_bits_to_f32(h: torch.Tensor) -> torch.Tensor:
    """int16 tensor of IEEE-half bit patterns -> float32 tensor, exact (NaN payloads kept, not quieted).

    torch's own conversion canonicalizes/quiets NaNs (and drops their sign on some paths);
    numpy keeps sign and payload, so NaN lanes are rebuilt from the bits."""
    f = h.view(torch.float16).to(torch.float32)
    b = h.to(torch.int32)                                   # sign-extended
    mant = b & 0x3FF
    is_nan = ((b & 0x7C00) == 0x7C00) & (mant != 0)
    nan_bits = (0x7F800000 | (mant << 13)) | ((b < 0).to(torch.int32) * _INT32_SIGN)
    return torch.where(is_nan, nan_bits.view(torch.float32), f)


def _f32_to_f16_bytes(x: torch.Tensor) -> torch.Tensor:
    """float32 tensor (...,) -> uint8 (..., 2): IEEE half, round-to-nearest-even, as numpy's astype.

    NaNs: numpy keeps the sign and the top 10 payload bits (0x7C01 if those are all zero)."""
    out = x.to(torch.float16).view(torch.uint8).reshape(*x.shape, 2)
    bits = x.view(torch.int32)
    nan_h = (0x7C00 | torch.clamp_min((bits & 0x7FFFFF) >> 13, 1)) | ((bits < 0).to(torch.int32) << 15)
    nan_bytes = torch.stack([nan_h & 0xFF, nan_h >> 8], dim=-1).to(torch.uint8)
    return torch.where(torch.isnan(x).unsqueeze(-1), nan_bytes, out)


def _f16_field(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """(n_blocks, type_size) uint8 -> (n_blocks, 1) float32 from the f16 at byte `start` of each block."""
    # clone: a fresh contiguous (n, 2) buffer, so the int16 view is aligned whatever `raw`'s offset was
    h = blocks[:, start:start + 2].clone(memory_format=torch.contiguous_format).view(torch.int16)
    return _f16_bits_to_f32(h)


def _shifts(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(n, k) uint8 -> (n, 2k): first the k low nibbles, then the k high nibbles."""
    n, k = qs.shape
    return ((qs.reshape(n, 1, k) >> _shifts(0, 4).reshape(1, 2, 1)) & 0x0F).reshape(n, 2 * k)


def _bits_of_bytes(qh: torch.Tensor) -> torch.Tensor:
    """(n, k) uint8 -> (n, 8k): bit i%8 of byte i//8 (little-endian bit order of a k-byte integer)."""
    n, k = qh.shape
    return ((qh.reshape(n, k, 1) >> torch.arange(8, dtype=torch.uint8).reshape(1, 1, 8)) & 1).reshape(n, 8 * k)


def _planes(q: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """Bit-plane unpacking used by the K-quants.

    (n, m) uint8 -> (n, m*8/bits): bytes are taken in runs of `group`; each run yields 8/bits
    consecutive runs of elements: first the lowest `bits` of every byte, then the next `bits`, ..."""
    n, m = q.shape
    per_byte = 8 // bits
    shifts = _shifts(*range(0, 8, bits)).reshape(1, 1, per_byte, 1)
    planes = (q.reshape(n, m // group, 1, group) >> shifts) & ((1 << bits) - 1)
    return planes.reshape(n, m * per_byte)


def _unpack_k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K 12-byte scale field -> (sc, min), each (n, 8) uint8 in 0..63.

    bytes 0-3:  sc[0..3] low 6 bits, their top 2 bits = hi 2 bits of sc[4..7]
    bytes 4-7:  min[0..3] low 6 bits, their top 2 bits = hi 2 bits of min[4..7]
    bytes 8-11: lo nibble = low 4 bits of sc[4..7], hi nibble = low 4 bits of min[4..7]"""
    s = scales.reshape(-1, 3, 4)
    a, b, c = s[:, 0], s[:, 1], s[:, 2]                      # (n, 4) each
    sc = torch.cat([a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)], dim=-1)
    mn = torch.cat([b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)], dim=-1)
    return sc, mn


# ----------------------------------------------------------------------------------------------
# per-format block dequantizers: (n_blocks, type_size) uint8 -> (n_blocks, block_size) float32
# ----------------------------------------------------------------------------------------------

def _dequant_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16_field(blocks, 0)                                 # (n, 1)
    q = blocks[:, 2:34].view(torch.int8).to(torch.float32)    # (n, 32)
    return q * d


def _dequant_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16_field(blocks, 0)                                 # (n, 1)
    q = _nibbles(blocks[:, 2:18]).to(torch.float32) - 8       # (n, 32), -8..7
    return d * q


def _dequant_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16_field(blocks, 0)                                 # (n, 1)
    m = _f16_field(blocks, 2)                                 # (n, 1)
    q = _nibbles(blocks[:, 4:20]).to(torch.float32)           # (n, 32), 0..15
    return (d * q) + m


def _bf16_field(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """(n_blocks, type_size) uint8 -> (n_blocks, 1) float32 from the bf16 at byte `start` of each block (exact)."""
    h = blocks[:, start:start + 2].clone(memory_format=torch.contiguous_format).view(torch.int16)
    return (h.to(torch.int32) * 65536).view(torch.float32)


def _dequant_mlx_a4(blocks: torch.Tensor) -> torch.Tensor:
    s, b = _bf16_field(blocks, 0), _bf16_field(blocks, 2)    # (n, 1) each
    q = _nibbles(blocks[:, 4:20]).to(torch.float32)           # (n, 32), 0..15
    return (s * q) + b


def _dequant_mlx_a8(blocks: torch.Tensor) -> torch.Tensor:
    s, b = _bf16_field(blocks, 0), _bf16_field(blocks, 2)
    q = blocks[:, 4:36].to(torch.float32)                     # (n, 32), 0..255
    return (s * q) + b


def dequantize_affine(q: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """MLX's affine quantization as its checkpoints store it -> float32 [..., rows, in] (weights/mlx.py):
    q int32/uint32 [..., rows, in * bits / 32], weight j of a row at bits (j * bits) % 32 of word j * bits / 32
    (little-endian, low bits first); scales / biases [..., rows, in / group] (bf16, f16 or f32);
    w = (scale * q) + bias, scale * q exact in float32 for 16-bit scales."""
    w = q.contiguous().view(torch.uint8)                      # byte k holds weights of bits 8k.. of the row
    if bits == 4:
        w = torch.stack([w & 0x0F, w >> 4], dim=-1).reshape(*w.shape[:-1], w.shape[-1] * 2)
    elif bits != 8:
        raise ValueError(f"affine quantization: {bits} bits is not 4 or 8")
    g = w.to(torch.float32).reshape(*w.shape[:-1], -1, group)
    return (scales.float().unsqueeze(-1) * g + biases.float().unsqueeze(-1)).reshape(*w.shape)


def _dequant_q5_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16_field(blocks, 0)                                 # (n, 1)
    qh = _bits_of_bytes(blocks[:, 2:6])                       # (n, 32), 0/1
    ql = _nibbles(blocks[:, 6:22])                            # (n, 32), 0..15
    q = (ql | (qh << 4)).to(torch.float32) - 16               # -16..15
    return d * q


def _dequant_q5_1(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16_field(blocks, 0)                                 # (n, 1)
    m = _f16_field(blocks, 2)                                 # (n, 1)
    qh = _bits_of_bytes(blocks[:, 4:8])                       # (n, 32)
    ql = _nibbles(blocks[:, 8:24])                            # (n, 32)
    q = (ql | (qh << 4)).to(torch.float32)                    # 0..31
    return (d * q) + m


def _dequant_q2_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    scales = blocks[:, 0:16]                                  # (n, 16)
    q = _planes(blocks[:, 16:80], bits=2, group=32)           # (n, 256), 0..3
    d = _f16_field(blocks, 80)                                # (n, 1)
    dmin = _f16_field(blocks, 82)                             # (n, 1)
    dl = (d * (scales & 0x0F).to(torch.float32)).reshape(n, 16, 1)
    ml = (dmin * (scales >> 4).to(torch.float32)).reshape(n, 16, 1)
    y = dl * q.reshape(n, 16, 16).to(torch.float32) - ml
    return y.reshape(n, 256)


def _dequant_q3_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    hbit = _planes(blocks[:, 0:32], bits=1, group=32)         # (n, 256): bit k of hmask[l] -> elem 32k+l
    low = _planes(blocks[:, 32:96], bits=2, group=32)         # (n, 256), 0..3
    packed = blocks[:, 96:108]                                # (n, 12)
    d = _f16_field(blocks, 108)                               # (n, 1)

    sc_lo = _nibbles(packed[:, 0:8])                          # (n, 16) low 4 bits
    sc_hi = _planes(packed[:, 8:12], bits=2, group=4)         # (n, 16) high 2 bits
    sc = (sc_lo | (sc_hi << 4)).to(torch.float32) - 32        # (n, 16), -32..31

    q = low.to(torch.float32) - 4 * (1 - hbit).to(torch.float32)   # clear hmask bit -> -4; -4..3
    dl = (d * sc).reshape(n, 16, 1)
    return (dl * q.reshape(n, 16, 16)).reshape(n, 256)


def _dequant_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d = _f16_field(blocks, 0)                                 # (n, 1)
    dmin = _f16_field(blocks, 2)                              # (n, 1)
    sc, mn = _unpack_k_scale_min(blocks[:, 4:16])             # (n, 8) each
    q = _planes(blocks[:, 16:144], bits=4, group=32)          # (n, 256), 0..15
    dl = (d * sc.to(torch.float32)).reshape(n, 8, 1)
    ml = (dmin * mn.to(torch.float32)).reshape(n, 8, 1)
    return (dl * q.reshape(n, 8, 32).to(torch.float32) - ml).reshape(n, 256)


def _dequant_q5_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d = _f16_field(blocks, 0)                                 # (n, 1)
    dmin = _f16_field(blocks, 2)                              # (n, 1)
    sc, mn = _unpack_k_scale_min(blocks[:, 4:16])             # (n, 8) each
    qh = _planes(blocks[:, 16:48], bits=1, group=32)          # (n, 256), bit 4
    ql = _planes(blocks[:, 48:176], bits=4, group=32)         # (n, 256), bits 0-3
    q = (ql | (qh << 4)).to(torch.float32)                    # 0..31
    dl = (d * sc.to(torch.float32)).reshape(n, 8, 1)
    ml = (dmin * mn.to(torch.float32)).reshape(n, 8, 1)
    return (dl * q.reshape(n, 8, 32) - ml).reshape(n, 256)


def _dequant_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    ql = _planes(blocks[:, 0:128], bits=4, group=64)          # (n, 256), bits 0-3
    qh = _planes(blocks[:, 128:192], bits=2, group=32)        # (n, 256), bits 4-5
    sc = blocks[:, 192:208].view(torch.int8).to(torch.float32)   # (n, 16)
    d = _f16_field(blocks, 208)                               # (n, 1)
    q = (ql | (qh << 4)).to(torch.float32) - 32               # (n, 256), -32..31
    dl = (d * sc).reshape(n, 16, 1)
    return (dl * q.reshape(n, 16, 16)).reshape(n, 256)


_BLOCK_DEQUANT: dict[GGMLType, Callable[[torch.Tensor], torch.Tensor]] = {
    GGMLType.Q8_0: _dequant_q8_0,
    GGMLType.Q4_0: _dequant_q4_0,
    GGMLType.Q4_1: _dequant_q4_1,
    GGMLType.Q5_0: _dequant_q5_0,
    GGMLType.Q5_1: _dequant_q5_1,
    GGMLType.Q2_K: _dequant_q2_k,
    GGMLType.Q3_K: _dequant_q3_k,
    GGMLType.Q4_K: _dequant_q4_k,
    GGMLType.Q5_K: _dequant_q5_k,
    GGMLType.Q6_K: _dequant_q6_k,
    GGMLType.MLX_A4: _dequant_mlx_a4,
    GGMLType.MLX_A8: _dequant_mlx_a8,
}

_FLOAT_DTYPES: dict[GGMLType, torch.dtype] = {
    GGMLType.F32: torch.float32,
    GGMLType.F16: torch.float16,
    GGMLType.BF16: torch.bfloat16,
}

DEQUANT_TYPES: frozenset[GGMLType] = frozenset({*_FLOAT_DTYPES, *_BLOCK_DEQUANT})
QUANT_TYPES: frozenset[GGMLType] = frozenset({*_FLOAT_DTYPES, GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0,
                                               GGMLType.Q5_1, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K})


# ----------------------------------------------------------------------------------------------
# argument checking
# ----------------------------------------------------------------------------------------------

def _as_type(ggml_type) -> GGMLType:
    try:
        return GGMLType(ggml_type)
    except ValueError:
        raise ValueError(f"unknown GGML type {ggml_type!r}") from None


def _check_raw(raw: torch.Tensor, t: GGMLType, shape: tuple[int, ...]) -> torch.Tensor:
    """Validate `raw` against (type, shape); return it flattened to 1-D uint8."""
    if not isinstance(raw, torch.Tensor) or raw.dtype != torch.uint8:
        raise ValueError(f"{t.name}: raw data must be a uint8 tensor, got {getattr(raw, 'dtype', type(raw))}")
    block = BLOCK_INFO[t].block_size
    if block > 1 and (len(shape) == 0 or shape[-1] % block):
        raise ValueError(f"{t.name}: last dim of shape {tuple(shape)} is not a multiple of the block size {block}")
    expected = tensor_nbytes(t, math.prod(shape))
    if raw.numel() != expected:
        raise ValueError(f"{t.name} tensor of shape {tuple(shape)}: expected {expected} bytes, got {raw.numel()}")
    return raw.reshape(-1)


# ----------------------------------------------------------------------------------------------
# public API
# ----------------------------------------------------------------------------------------------

def dequantize(raw: torch.Tensor, ggml_type: GGMLType, shape: tuple[int, ...]) -> torch.Tensor:
    """GGML bytes -> float32 tensor of `shape` (PyTorch order: rows along the last dim are contiguous).

    Always returns a new tensor (never aliases `raw`); see `ggml_dtype_view` for zero-copy access.
    Raises ValueError for unsupported types and for a byte count that does not match `shape`."""
    t = _as_type(ggml_type)
    if t not in DEQUANT_TYPES:
        raise ValueError(f"dequantize: unsupported GGML type {t.name}")
    shape = tuple(int(s) for s in shape)
    flat = _check_raw(raw, t, shape)

    if t == GGMLType.F32:
        return flat.clone().view(torch.float32).reshape(shape)
    if t == GGMLType.F16:
        return _f16_bits_to_f32(flat.clone().view(torch.int16)).reshape(shape)
    if t == GGMLType.BF16:
        # bf16 is the top half of a float32: widen the int16 bits (exact for NaNs too)
        bits = flat.clone().view(torch.int16).to(torch.int32) * 65536
        return bits.view(torch.float32).reshape(shape)

    info = BLOCK_INFO[t]
    blocks = flat.reshape(-1, info.type_size)                 # (n_blocks, type_size)
    return _BLOCK_DEQUANT[t](blocks).reshape(shape)


def _round_half_away(x: torch.Tensor) -> torch.Tensor:
    """Round to nearest, ties away from zero (C roundf), computed exactly as gguf-py's np_roundf."""
    a = x.abs()
    fl = torch.floor(a)
    return torch.sign(x) * (fl + torch.floor(2 * (a - fl)))


def _safe_reciprocal(d: torch.Tensor) -> torch.Tensor:
    """1/d, with 0 where d == 0 (gguf-py: np.where(d == 0, 0, 1 / d))."""
    return torch.where(d == 0, 0.0, torch.ones_like(d) / d)


def _quant_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    """(n, 32) float32 -> (n, 34) uint8."""
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127         # (n, 1) float32 scale
    q = _round_half_away(blocks * _safe_reciprocal(d))        # (n, 32), -127..127
    return torch.cat([_f32_to_f16_bytes(d.squeeze(-1)), q.to(torch.int8).view(torch.uint8)], dim=-1)


def _quant_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    """(n, 32) float32 -> (n, 18) uint8.  d = (signed value of largest magnitude, first one) / -8."""
    imax = blocks.abs().argmax(dim=-1, keepdim=True)          # first index of max |x|
    d = blocks.gather(-1, imax) / -8                          # (n, 1)
    q = torch.trunc(blocks * _safe_reciprocal(d) + 8.5)       # (n, 32), 0..16
    q = q.to(torch.uint8).clamp(0, 15)
    packed = q[:, :16] | (q[:, 16:] << 4)                     # (n, 16)
    return torch.cat([_f32_to_f16_bytes(d.squeeze(-1)), packed], dim=-1)


def _high_bits(q: torch.Tensor) -> torch.Tensor:
    """(n, 32) values 0..31 -> (n, 4) qh bytes: bit i (little-endian) = bit 4 of element i (np.packbits, little)."""
    bits = (q >> 4).reshape(-1, 4, 8)
    return (bits << torch.arange(8, dtype=torch.uint8)).sum(dim=-1, dtype=torch.uint8)


def _quant_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    """(n, 32) float32 -> (n, 20) uint8.  d = (max - min) / 15, m = min, q = trunc((x - min) / d + 0.5)."""
    mx, mn = blocks.amax(dim=-1, keepdim=True), blocks.amin(dim=-1, keepdim=True)
    d = (mx - mn) / 15
    q = torch.trunc((blocks - mn) * _safe_reciprocal(d) + 0.5).to(torch.uint8).clamp(0, 15)
    return torch.cat([_f32_to_f16_bytes(d.squeeze(-1)), _f32_to_f16_bytes(mn.squeeze(-1)),
                      q[:, :16] | (q[:, 16:] << 4)], dim=-1)


def _quant_q5_0(blocks: torch.Tensor) -> torch.Tensor:
    """(n, 32) float32 -> (n, 22) uint8.  d = (signed value of largest magnitude, first one) / -16."""
    imax = blocks.abs().argmax(dim=-1, keepdim=True)
    d = blocks.gather(-1, imax) / -16
    q = torch.trunc(blocks * _safe_reciprocal(d) + 16.5).to(torch.uint8).clamp(0, 31)
    return torch.cat([_f32_to_f16_bytes(d.squeeze(-1)), _high_bits(q), (q[:, :16] & 0x0F) | (q[:, 16:] << 4)], dim=-1)


def _quant_q5_1(blocks: torch.Tensor) -> torch.Tensor:
    """(n, 32) float32 -> (n, 24) uint8.  d = (max - min) / 31, m = min, q = trunc((x - min) / d + 0.5)."""
    mx, mn = blocks.amax(dim=-1, keepdim=True), blocks.amin(dim=-1, keepdim=True)
    d = (mx - mn) / 31
    q = torch.trunc((blocks - mn) * _safe_reciprocal(d) + 0.5).to(torch.uint8).clamp(0, 31)
    return torch.cat([_f32_to_f16_bytes(d.squeeze(-1)), _f32_to_f16_bytes(mn.squeeze(-1)), _high_bits(q),
                      (q[:, :16] & 0x0F) | (q[:, 16:] << 4)], dim=-1)


def _f16_round(x: torch.Tensor) -> torch.Tensor:
    """float32 -> the float32 value of its fp16 rounding (what a block's stored scale will be)."""
    return x.to(torch.float16).to(torch.float32)


def _k_scale_min_bytes(sc: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    """(n, 8) 6-bit sub-block scales and mins -> the (n, 12) scale field (inverse of _unpack_k_scale_min)."""
    sc, mn = sc.to(torch.uint8), mn.to(torch.uint8)
    a = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    b = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    c = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    return torch.cat([a, b, c], dim=-1)


def _quant_k_affine(blocks: torch.Tensor, levels: int) -> tuple[torch.Tensor, ...]:
    """Q4_K / Q5_K: (n, 256) float32 -> d, dmin (n, 1) fp16-representable, sc, mn (n, 8) in 0..63, q (n, 256).

    Per sub-block of 32 the range [min(x, 0), max(x)] is split in `levels` steps (scale = range / levels,
    min = -min(x, 0)); the 8 scales and mins are themselves quantized to 6 bits against the super-block's
    d = max scale / 63 and dmin = max min / 63 (round to nearest), and each weight is rounded to the nearest
    level of the scale and min it will be read with. Plain round-to-nearest, no search (llama.cpp's
    make_qkx2_quants searches; this is simpler and a little less accurate)."""
    n = blocks.shape[0]
    sub = blocks.reshape(n, 8, 32)
    lo = sub.amin(dim=-1).clamp(max=0)                        # (n, 8), <= 0
    hi = sub.amax(dim=-1)
    scale, minv = (hi - lo) / levels, -lo                     # (n, 8), >= 0
    d = _f16_round(scale.amax(dim=-1, keepdim=True) / 63)     # (n, 1)
    dmin = _f16_round(minv.amax(dim=-1, keepdim=True) / 63)
    sc = torch.clamp(torch.round(scale * _safe_reciprocal(d)), 0, 63)
    mn = torch.clamp(torch.round(minv * _safe_reciprocal(dmin)), 0, 63)
    dl, ml = (d * sc).unsqueeze(-1), (dmin * mn).unsqueeze(-1)   # (n, 8, 1): exactly what dequantize uses
    q = torch.clamp(torch.round((sub + ml) * _safe_reciprocal(dl)), 0, levels)
    return d, dmin, sc, mn, q.reshape(n, 256).to(torch.uint8)


def _nibble_pairs_k(q: torch.Tensor) -> torch.Tensor:
    """(n, 256) values 0..15 -> (n, 128) bytes: sub-block 2c in the low nibbles of qs[32c:32c+32], 2c+1 high."""
    n = q.shape[0]
    pairs = q.reshape(n, 4, 2, 32)
    return (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(n, 128)


def _quant_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    """(n, 256) float32 -> (n, 144) uint8."""
    d, dmin, sc, mn, q = _quant_k_affine(blocks, 15)
    return torch.cat([_f32_to_f16_bytes(d.squeeze(-1)), _f32_to_f16_bytes(dmin.squeeze(-1)),
                      _k_scale_min_bytes(sc, mn), _nibble_pairs_k(q)], dim=-1)


def _quant_q5_k(blocks: torch.Tensor) -> torch.Tensor:
    """(n, 256) float32 -> (n, 176) uint8: as Q4_K with 32 levels, bit 4 of each q in qh."""
    d, dmin, sc, mn, q = _quant_k_affine(blocks, 31)
    n = q.shape[0]
    high = (q >> 4).reshape(n, 8, 32)                                   # bit j of qh[l]: element 32 j + l
    qh = (high << torch.arange(8, dtype=torch.uint8).reshape(1, 8, 1)).sum(dim=1, dtype=torch.uint8)
    return torch.cat([_f32_to_f16_bytes(d.squeeze(-1)), _f32_to_f16_bytes(dmin.squeeze(-1)),
                      _k_scale_min_bytes(sc, mn), qh, _nibble_pairs_k(q & 0x0F)], dim=-1)


def _quant_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    """(n, 256) float32 -> (n, 210) uint8.

    Per sub-block of 16 the value of largest magnitude maps to -32 (scale = that value / -32, as Q4_0 does
    with -8); the 16 scales are quantized to int8 against d = max |scale| / 127; each weight is rounded to
    the nearest level of the scale it will be read with, q in 0..63 (q - 32 = -32..31)."""
    n = blocks.shape[0]
    sub = blocks.reshape(n, 16, 16)
    imax = sub.abs().argmax(dim=-1, keepdim=True)
    scale = sub.gather(-1, imax).squeeze(-1) / -32                     # (n, 16), signed
    d = _f16_round(scale.abs().amax(dim=-1, keepdim=True) / 127)       # (n, 1)
    sc = torch.clamp(torch.round(scale * _safe_reciprocal(d)), -128, 127)
    dl = (d * sc).unsqueeze(-1)                                        # (n, 16, 1)
    q = (torch.clamp(torch.round(sub * _safe_reciprocal(dl)), -32, 31) + 32).reshape(n, 2, 128).to(torch.uint8)
    ql = (q[:, :, :64] & 0x0F) | ((q[:, :, 64:] & 0x0F) << 4)          # (n, 2, 64): elems r and 64 + r of a half
    hi = (q >> 4).reshape(n, 2, 4, 32)                                 # bits 2s of qh[32h + l]: elem 128h + 32s + l
    qh = (hi << torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)).sum(dim=2, dtype=torch.uint8)
    return torch.cat([ql.reshape(n, 128), qh.reshape(n, 64), sc.to(torch.int8).view(torch.uint8),
                      _f32_to_f16_bytes(d.squeeze(-1))], dim=-1)


_BLOCK_QUANT: dict[GGMLType, Callable[[torch.Tensor], torch.Tensor]] = {
    GGMLType.Q8_0: _quant_q8_0,
    GGMLType.Q4_0: _quant_q4_0,
    GGMLType.Q4_1: _quant_q4_1,
    GGMLType.Q5_0: _quant_q5_0,
    GGMLType.Q5_1: _quant_q5_1,
    GGMLType.Q4_K: _quant_q4_k,
    GGMLType.Q5_K: _quant_q5_k,
    GGMLType.Q6_K: _quant_q6_k,
}


def _quant_bf16(x: torch.Tensor) -> torch.Tensor:
    """float32 (N,) -> uint8 (N, 2): round to nearest even; NaNs are quieted (ggml_compute_fp32_to_bf16)."""
    n = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    is_nan = (n & 0x7FFFFFFF) > 0x7F800000
    n = torch.where(is_nan, (n & 0xFFFF0000) | (64 << 16), n)
    h = (n + (0x7FFF + ((n >> 16) & 1))) >> 16               # 0..0xFFFF
    return torch.stack([h & 0xFF, h >> 8], dim=-1).to(torch.uint8)


def quantize(x: torch.Tensor, ggml_type: GGMLType) -> torch.Tensor:
    """float32 tensor (last dim a multiple of the block size) -> 1-D uint8 tensor of GGML bytes.

    Supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 (bytes identical to gguf.quants.quantize) and Q4_K, Q5_K, Q6_K
    (gem4's own round-to-nearest quantizers, see _quant_k_affine and _quant_q6_k; gguf-py has none).
    Other floating dtypes are converted to float32 first."""
    t = _as_type(ggml_type)
    if t not in QUANT_TYPES:
        raise ValueError(f"quantize: unsupported GGML type {t.name}")
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise ValueError(f"quantize {t.name}: expected a floating-point tensor")
    block = BLOCK_INFO[t].block_size
    if block > 1 and (x.dim() == 0 or x.shape[-1] % block):
        raise ValueError(f"quantize {t.name}: last dim of shape {tuple(x.shape)} is not a multiple of the block size {block}")
    flat = x.detach().to(device="cpu", dtype=torch.float32).contiguous().reshape(-1)

    if t == GGMLType.F32:
        return flat.clone().view(torch.uint8)
    if t == GGMLType.F16:
        return _f32_to_f16_bytes(flat).reshape(-1)
    if t == GGMLType.BF16:
        return _quant_bf16(flat).reshape(-1)
    blocks = flat.reshape(-1, block)
    return _BLOCK_QUANT[t](blocks).reshape(-1)


def ggml_dtype_view(raw: torch.Tensor, ggml_type: GGMLType, shape: tuple[int, ...]) -> torch.Tensor | None:
    """Zero-copy typed view of F32/F16/BF16 bytes (raw uint8 -> view(dtype).reshape(shape)).

    Returns None for every other type (block formats need `dequantize` or a kernel).
    `raw` must be contiguous and suitably aligned (GGUF aligns tensor data to >= 32 bytes)."""
    t = _as_type(ggml_type)
    dtype = _FLOAT_DTYPES.get(t)
    if dtype is None:
        return None
    shape = tuple(int(s) for s in shape)
    _check_raw(raw, t, shape)
    if not raw.is_contiguous():
        raise ValueError(f"ggml_dtype_view {t.name}: raw must be contiguous for a zero-copy view")
    return raw.reshape(-1).view(dtype).reshape(shape)
