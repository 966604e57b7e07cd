"""gem4: a Gemma 4 inference engine on PyTorch.

Public API (names other work builds on):
    gem4.load(path, dtype="float32"|"bfloat16", device="cpu") -> Model
    gem4.load_assistant(path, target=model) -> Assistant (the MTP drafter, model/assistant.py)
    gem4.Tokenizer
    gem4.Engine(model, tokenizer=None, ...), gem4.SamplingParams
"""
from __future__ import annotations

import os
import sys

# Runtime settings read when torch loads (so set before `import torch`; an explicit value in the
# environment wins):
# - GOMP_SPINCOUNT=1000: an idle OpenMP worker spins ~20-40 us before it sleeps (libgomp's default: ~5 ms),
#   long enough to bridge the gaps between one decode step's matmuls, short enough to give a shared core
#   back at once (benchmarks/RESULTS.md §4).
# - OMP_WAIT_POLICY=ACTIVE: keeps that spin while the process holds more OpenMP threads than cores (a model
#   loaded on one thread and run on the engine's), where libgomp would sleep and wake its workers at every
#   parallel region (benchmarks/RESULTS.md §B, the update of 2026-12-02 night).
# (The packed weights ask for transparent huge pages themselves, in kernels/ggml_gemv.cpp; torch's
# THP_MEM_ALLOC_ENABLE, which does it for every large tensor, made prefill's temporaries fault slowly.)
_ENV_DEFAULTS = {"GOMP_SPINCOUNT": "1000", "OMP_WAIT_POLICY": "ACTIVE"}
if any(key not in os.environ for key in _ENV_DEFAULTS) and "torch" in sys.modules:
    import warnings

    warnings.warn("gem4 was imported after torch: set " + " ".join(f"{k}={v}" for k, v in _ENV_DEFAULTS.items())
                  + " in the environment (or import gem4 first) for full speed", RuntimeWarning, stacklevel=2)
for _key, _value in _ENV_DEFAULTS.items():
    os.environ.setdefault(_key, _value)

__version__ = "0.1.0"

_LAZY = {
    "load": ("gem4.weights.loader", "load"),
    "load_assistant": ("gem4.weights.assistant", "load_assistant"),
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
