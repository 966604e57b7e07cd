"""What every checkpoint reader hands the loader: a ModelConfig and canonical tensors, not yet materialised.

Canonical names are the model's parameter names (HF names without the `model.` prefix). A reader
lists each tensor with its shape and stored type, and a way to read it: `dense()` gives a float
tensor (a zero-copy view where the stored dtype allows, else dequantized to float32); `raw()` gives
the GGML block bytes for formats that are kept packed (lookup tables, later fast kernels).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from gem4.config import ModelConfig
from gem4.ggml import GGMLType


class CheckpointError(ValueError):
    """The checkpoint cannot be used: names the file and the tensor or field at fault."""


@dataclass(frozen=True)
class TensorEntry:
    name: str                    # canonical name
    shape: tuple[int, ...]       # PyTorch order
    stored: str                  # stored type as the file names it: "F32", "BF16", "Q4_0", ...
    nbytes: int
    dense: Callable[[], torch.Tensor]
    raw: Callable[[], tuple[torch.Tensor, GGMLType]] | None = None   # GGML block formats only
    # Drop the tensor's mapped file pages from the process once the loader holds its own copy (they
    # would otherwise count twice in its memory); views taken earlier stay valid. No-op where not mmapped.
    release: Callable[[], None] = lambda: None
    offset: int | None = None    # absolute byte offset of the stored bytes in the file (GGUF; streamed experts)
    # MLX checkpoints' expert weights: (packed, dtype) -> a reader of one expert at a time (weights/mlx.py
    # StreamedExperts), what streamed experts read instead of the GGUF range at `offset`
    stream: Callable[[bool, torch.dtype], object] | None = None
    # MLX checkpoints' quantized tensors: () -> (q, scales, biases, bits, group_size) as the file has them (tables
    # read by rows keep them so: QuantLinear.keep_affine)
    affine: Callable[[], tuple] | None = None


@dataclass
class Checkpoint:
    path: Path
    format: str                                   # "gguf" | "safetensors"
    config: ModelConfig
    tensors: dict[str, TensorEntry]               # canonical name -> entry
    ignored: list[str] = field(default_factory=list)   # file tensors deliberately not loaded (vestigial, towers)
    metadata: dict[str, object] = field(default_factory=dict)  # format-level facts for tools (inspect, convert)
    towers: dict[str, TensorEntry] = field(default_factory=dict)   # the media towers' tensors, by canonical name
    tower_configs: dict[str, object] = field(default_factory=dict)  # tower -> its config ("vision": VisionConfig)
    close: Callable[[], None] = lambda: None


def open_checkpoint(path: str | Path, mmproj: str | Path | None = None) -> Checkpoint:
    """A `.gguf` file or an HF directory (config.json + *.safetensors); `mmproj`: llama.cpp's tower file beside a
    `.gguf` (weights/mmproj.py)."""
    p = Path(path)
    if p.is_dir():
        from gem4.weights.hf import open_hf
        ckpt = open_hf(p)
    elif p.is_file():
        from gem4.weights.gguf_model import open_gguf
        ckpt = open_gguf(p)
    else:
        raise CheckpointError(f"{p}: no such file or directory (expected a .gguf file or an HF checkpoint directory)")
    if mmproj is not None:
        from gem4.weights.mmproj import attach_mmproj
        try:
            attach_mmproj(ckpt, mmproj)
        except BaseException:
            ckpt.close()
            raise
    return ckpt

