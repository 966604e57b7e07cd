"""Backends: what computes the reference model (model/gemma4.py, model/assistant.py), chosen once at load.

- "torch": the reference itself, plain torch ops. The float32 mode, and the bfloat16 mode wherever the CPU
  kernels do not run (another device, a CPU without AVX-512 BF16/VNNI, GEM4_NO_KERNELS=1).
- "cpu": gem4's compiled AVX-512 kernels (model/cpu.py), the fast mode on CPUs that run them.

A backend is a load-time transformation with three steps the loader calls (`Backend`): `prepare` the module
tree before its weights are bound (replace modules by its own), `pack` the weights it keeps in a layout of its
own as they are bound (`packed_types`: the GGML types it reads packed; the others are dequantized), and
`finish` once every weight is bound (per-layer plans, the model's decode_rows). The reference never asks which
backend runs it; the forward tells every layer the same things whatever the backend (model/layers.py). A new
backend (CUDA: Triton / cuBLAS; tensor-parallel shards) is one more entry in `BACKENDS`, tested against the
reference as model/cpu.py is.

What the engine needs of a model, whatever its backend, is `EngineModel`.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import nn

from gem4.config import ModelConfig
from gem4.kv_cache import KVPool, StepLayout
from gem4.ggml import GGMLType


class Backend(Protocol):
    name: str
    packed_types: frozenset[GGMLType]        # GGML types whose weights it binds packed (`pack`), not dequantized

    def prepare(self, model: nn.Module) -> None:
        """Before the weights are bound: replace the modules it computes differently."""

    def pack(self, module: nn.Module, name: str, raw: torch.Tensor, ggml_type: GGMLType) -> None:
        """Bind the weight `name` of `module` from its GGML bytes, in the backend's layout."""

    def finish(self, model: nn.Module, keep_heap: bool = True) -> None:
        """After every weight is bound: plans, decode_rows; sets model.backend to its name."""


class TorchBackend:
    """The reference: nothing to replace, nothing packed."""

    name = "torch"
    packed_types: frozenset[GGMLType] = frozenset()

    def prepare(self, model: nn.Module) -> None:
        pass

    def pack(self, module: nn.Module, name: str, raw: torch.Tensor, ggml_type: GGMLType) -> None:
        raise RuntimeError("the torch backend keeps no packed weights")

    def finish(self, model: nn.Module, keep_heap: bool = True) -> None:
        model.backend = self.name


def choose(dtype: torch.dtype, device: str | torch.device) -> Backend:
    """The backend for a model in `dtype` on `device`: the CPU kernels for bfloat16 on a CPU that runs them
    (they compile on first use: model/kernels), else the torch reference."""
    if dtype == torch.bfloat16 and torch.device(device).type == "cpu":
        from gem4.model import kernels

        if kernels.available():
            from gem4.model.cpu import CpuBackend

            return CpuBackend()
    return TorchBackend()


@runtime_checkable
class EngineModel(Protocol):
    """What the engine (engine/runner.py, engine/mtp.py) uses of a model; `gem4.model.gemma4.Model` is one."""

    config: ModelConfig
    dtype: torch.dtype                       # the weights' and the KV pool's
    backend: str                             # "torch" | "cpu" (`choose`)
    decode_rows: int                         # the most rows of a decode pass (the runner packs passes by it)
    expert_cache: object | None              # 26B-A4B with streamed experts: the slot cache's counters

    @property
    def device(self) -> torch.device: ...

    def forward(self, ids: torch.Tensor, step: StepLayout, pool: KVPool, hidden: bool = False):
        """One step over the pool: ids [T] -> logits [M, V] of the step's logit rows (hidden=True: and their
        final-normed hidden states [M, H]). A model with media towers also takes `media=` (model/gemma4.py
        StepEmbeds: the step's soft tokens), passed only when a step has some."""

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] -> the scaled input embeddings [T, H] (the MTP assistant's token input)."""
