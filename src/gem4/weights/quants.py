"""GGML tensor types: block geometry (this module), reference dequantization and quantization.

The type table is the single owner of "how many bytes does a GGML tensor of N elements take";
the GGUF reader uses it to bounds-check tensor extents.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass


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
}


def tensor_nbytes(ggml_type: GGMLType, n_elements: int) -> int:
    """Bytes of a tensor with `n_elements` (must be a whole number of blocks)."""
    info = BLOCK_INFO[ggml_type]
    if n_elements % info.block_size:
        raise ValueError(f"{ggml_type.name}: {n_elements} elements is not a multiple of the block size {info.block_size}")
    return n_elements // info.block_size * info.type_size
