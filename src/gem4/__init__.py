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
# - GOMP_SPINCOUNT: an idle OpenMP worker spins this many times (~20 ns each here) before it sleeps;
#   libgomp's default is 300000 (~5 ms). 1000 (~20-40 us) bridges the gaps between one decode step's
#   matmuls, so the workers are awake when the next one starts, yet gives a shared core back at once:
#   a worker spinning for milliseconds burns the time slice of the thread it waits for. E2B Q4_0
#   decode loop on 2 cores (benchmarks/RESULTS.md §4): free cores 12.4 tok/s (100000: 14.1, 0:
#   11.5); beside one busy process 7.3 (100000: 1.6, 0: 7.6). The demo model's 64-token request
#   beside a busy process took 9 s with 100000 and 0.2 s without spinning.
# - OMP_WAIT_POLICY=ACTIVE: with GOMP_SPINCOUNT given, its only effect in libgomp is on the spin count used
#   while the process holds more OpenMP threads than there are cores: 1000 (the count above) instead of
#   100, i.e. no spinning at all. A model loaded on one thread and run on another (the engine's loop, the
#   server) is that case: the loading thread keeps its idle team, so a 2-core process holds 4 OpenMP
#   threads, and every parallel region of a decode step put the worker to sleep and woke it again. E2B
#   Q4_0 decode on 2 cores, forward on the engine's thread: 57-71 -> 45-53 ms a token (3 rounds, each
#   interleaved); on the loading thread 50-64 -> 45-57 ms.
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
