"""Checkpoint tensors -> a module tree's weights, through the backend chosen at load (model/backends.py).

What becomes of one tensor is decided here, once, for every part gem4 binds: the text model (`loader.bind`), the
assistant (weights/assistant.py) and the media towers (weights/towers.py, weights/audio.py). A weight in a GGML
type the backend reads packed (`Backend.packed_types`: the CPU backend's Q8_0, Q4_0, the K-quants) is handed to
`Backend.pack` as the file stores it -- a Q8_0 tower stays Q8_0 and runs through the same GEMM kernels as the text
model --, every other one is dequantized once into its compute dtype (`weight_dtype`). `bind_weights` is the whole
sequence for a module tree with no special tensors (the towers): prepare, pack or densify each weight, bind,
finish.
"""
from __future__ import annotations

import torch
from torch import nn

from gem4.ggml import GGMLType
from gem4.model.backends import Backend
from gem4.weights.checkpoint import TensorEntry

PLE_TABLE = "embed_tokens_per_layer.weight"
# 26B-A4B's routed expert weights, one [E, rows, k] tensor each (Experts.pack in fast mode).
EXPERT_WEIGHTS = ("experts.gate_up_proj", "experts.down_proj")


def weight_dtype(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.dtype:
    """Kept in float32 in every mode (as llama.cpp's converter keeps them): vectors, scalars (the towers' clip
    bounds) and the 26B-A4B router; the other weights in the model's dtype."""
    return torch.float32 if len(shape) <= 1 or name.endswith("router.proj.weight") else dtype


def block_storage(name: str, entry: TensorEntry | None, packed_types: frozenset[GGMLType]) -> str | None:
    """How a GGML-block tensor is kept instead of being dequantized: "blocks", "packed", "experts" or None (dense).

    The per-layer embedding table is only read by rows, so it always stays in its blocks, in the mmap.
    Projection weights (and the token table, which is also the tied head) are packed when the backend reads
    their format (`packed_types`, model/backends.py); so are 26B-A4B's expert weights ("experts").
    """
    if entry is None or entry.raw is None:
        return None
    if name == PLE_TABLE:
        return "blocks"
    if GGMLType[entry.stored] in packed_types:
        if len(entry.shape) == 2:
            return "packed"
        if name.endswith(EXPERT_WEIGHTS):                  # 26B-A4B: [E, rows, k], packed as E * rows rows
            return "experts"
    return None


def pack(model: nn.Module, name: str, entry: TensorEntry, backend: Backend) -> None:
    """Bind the weight `name` of `model` packed by the backend from the file's bytes (block_storage "packed" or
    "experts"); the file's pages of it are released (the backend holds its own copy)."""
    raw, ggml_type = entry.raw()
    parent, attr = name.rsplit(".", 1)
    backend.pack(model.get_submodule(parent), attr, raw, ggml_type)
    entry.release()


def aligned(t: torch.Tensor) -> torch.Tensor:
    """t, or a copy of it at a 64-byte aligned address (torch's allocator aligns to 64). A weight whose dtype
    the file already holds is a view into the file, at whatever offset the file put it (safetensors: 8-byte
    steps); torch's float32 matmul rounds differently by its operands' alignment on some CPUs (AMD Zen 5: one
    checkpoint as one file and as two shards gave logits 7e-6 apart), so outputs would depend on where a
    tensor lies in its file."""
    return t if t.device.type != "cpu" or t.data_ptr() % 64 == 0 else t.clone()


def bind_weights(model: nn.Module, entries: dict[str, TensorEntry], backend: Backend, dtype: torch.dtype,
                 device: str | torch.device) -> None:
    """Bind every parameter of `model` (built on the meta device; `entries` holds one checked entry per parameter
    name) through `backend`: its modules prepared, each weight packed where the backend reads the file's type, else
    dense in `weight_dtype` (a copy: the file can close), then the backend's finish."""
    backend.prepare(model)
    state = {}
    for name, shape in [(name, tuple(p.shape)) for name, p in model.named_parameters()]:
        entry = entries[name]
        if block_storage(name, entry, backend.packed_types) == "packed":
            pack(model, name, entry, backend)
        else:
            state[name] = entry.dense().to(device=device, dtype=weight_dtype(name, shape, dtype)).clone()
    model.load_state_dict(state, strict=True, assign=True)
    backend.finish(model)
