"""(config, tensors) -> bound model: the strict manifest check and every load-time transform.

`load(path)` opens a GGUF file or an HF directory, builds the model's module tree on the meta
device, checks the checkpoint's canonical tensors against the tree's parameters (missing, unexpected
and mis-shaped tensors are refused by name), then materialises each tensor once in the compute dtype.
"""
from __future__ import annotations

from pathlib import Path

import torch
from tqdm import tqdm

from gem4.model.gemma4 import Model
from gem4.model.layers import RowTable
from gem4.weights.checkpoint import Checkpoint, CheckpointError, open_checkpoint

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PLE_TABLE = "embed_tokens_per_layer.weight"

# Kept in float32 in every mode (as llama.cpp's converter keeps them): vectors and the 26B-A4B router.
def _weight_dtype(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if len(shape) == 1 or name.endswith("router.proj.weight") else dtype


# Tensors a file may omit, with the value llama.cpp's loader assumes (GEMMA4.md §3.2).
OPTIONAL_ONES = ("layer_scalar", "router.per_expert_scale")


def _check_manifest(ckpt: Checkpoint, expected: dict[str, tuple[int, ...]]) -> None:
    where = ckpt.path
    for name, shape in expected.items():
        entry = ckpt.tensors.get(name)
        if entry is None:
            if name.endswith(OPTIONAL_ONES):
                continue
            raise CheckpointError(f"{where}: missing required tensor {name!r} (expected shape {shape})")
        if tuple(entry.shape) != tuple(shape):
            raise CheckpointError(f"{where}: tensor {name!r} has shape {tuple(entry.shape)}, "
                                  f"the model's metadata needs {tuple(shape)}")
    unexpected = sorted(set(ckpt.tensors) - set(expected))
    if unexpected:
        raise CheckpointError(f"{where}: unexpected tensor {unexpected[0]!r}"
                              + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else "")
                              + " for this model's metadata")


def bind(ckpt: Checkpoint, dtype: str = "float32", device: str = "cpu", progress: bool = False) -> Model:
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    torch_dtype = DTYPES[dtype]
    config = ckpt.config
    with torch.device("meta"):
        model = Model(config, torch_dtype)
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()}
    if config.ple_dim:
        expected[PLE_TABLE] = (config.ple_vocab_size, config.num_layers * config.ple_dim)
    _check_manifest(ckpt, expected)

    state = {}
    names = [n for n in expected if n != PLE_TABLE]
    for name in tqdm(names, desc="loading weights", unit="tensor", disable=not progress):
        entry = ckpt.tensors.get(name)
        target = _weight_dtype(name, expected[name], torch_dtype)
        if entry is None:                                  # optional scalars default to 1 (OPTIONAL_ONES)
            state[name] = torch.ones(expected[name], dtype=target, device=device)
        else:
            state[name] = entry.dense().to(device=device, dtype=target)
    model.load_state_dict(state, strict=True, assign=True)
    for layer_type, inv_freq in config.rope_inv_freq:    # non-persistent buffers were built on meta
        setattr(model, f"inv_freq_{layer_type}", torch.tensor(inv_freq, dtype=torch.float32, device=device))
    if config.ple_dim:                                     # E2B/E4B: kept in stored form, rows read on demand
        entry = ckpt.tensors[PLE_TABLE]
        if entry.raw is not None:
            raw, ggml_type = entry.raw()
            model.embed_tokens_per_layer = RowTable(entry.shape, raw=raw.to(device), ggml_type=ggml_type)
        else:
            model.embed_tokens_per_layer = RowTable(entry.shape, dense=entry.dense().to(device))
    model.eval()
    return model


def load(path: str | Path, dtype: str = "float32", device: str = "cpu", progress: bool = False) -> Model:
    """Load a Gemma 4 text model from a `.gguf` file or an HF checkpoint directory.

    dtype "float32" is the reference mode (matches transformers to ~1e-4); "bfloat16" runs
    activations and weights in bf16.
    """
    ckpt = open_checkpoint(path)
    return bind(ckpt, dtype=dtype, device=device, progress=progress)
