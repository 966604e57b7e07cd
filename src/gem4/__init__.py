"""gem4: a Gemma 4 inference engine on PyTorch.

Public API (names other work builds on):
    gem4.load(path, dtype="float32"|"bfloat16", device="cpu") -> Model
    gem4.Tokenizer
    gem4.Engine(model, tokenizer=None, ...), gem4.SamplingParams
"""
from __future__ import annotations

import os
import sys

# OpenMP worker threads sleep after GOMP_SPINCOUNT idle spins; on small VMs waking them costs
# milliseconds, which made each decode matmul 20x slower than spinning a little longer (measured:
# Q8_0 GEMV 1.3 -> 40 GB/s on 2 threads). Read when torch loads libgomp, so it must be set before
# `import torch`; an explicit value in the environment wins.
if "GOMP_SPINCOUNT" not in os.environ:
    if "torch" in sys.modules:
        import warnings

        warnings.warn("gem4 was imported after torch: set GOMP_SPINCOUNT=100000 in the environment (or import "
                      "gem4 first) for full decode speed", RuntimeWarning, stacklevel=2)
    os.environ["GOMP_SPINCOUNT"] = "100000"

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
