"""gem4: a Gemma 4 inference engine on PyTorch.

Public API (names other work builds on):
    gem4.load(path, dtype="float32"|"bfloat16", device="cpu") -> Model
    gem4.Tokenizer
    gem4.Engine(model, tokenizer=None, ...), gem4.SamplingParams
"""
from __future__ import annotations

__version__ = "0.1.0"

_LAZY = {
    "load": ("gem4.weights.loader", "load"),
    "Model": ("gem4.model.gemma4", "Model"),
    "Tokenizer": ("gem4.tokenizer", "Tokenizer"),
    "Engine": ("gem4.engine", "Engine"),
    "SamplingParams": ("gem4.sampling", "SamplingParams"),
}


def __getattr__(name: str):
    # Lazy so that `import gem4` for text work does not import torch.
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'gem4' has no attribute {name!r}")


__all__ = list(_LAZY)
