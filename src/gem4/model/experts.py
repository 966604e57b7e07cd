"""26B-A4B's routed experts behind one interface, the expert store: which slot of `Experts`' weights (gemma4.py)
holds expert e, and when.

`Experts` holds gate_up_proj and down_proj as a slab of slots (the backend's layout: packed rows in the CPU
backend, dense [rows, k] in the weight dtype otherwise) and asks its store which slot holds expert e. The
layer's forward hands the store the sorted list of experts a step uses; `tiles(used)` yields them in groups
that are all in slots before any of them is computed; `prefetch(idx)` (the router's choice) may start loading
them early; `streamed` says whether slots are filled on demand (then the decode step runs the Python layer).

- `Resident`: slot = expert, one group (every expert bound at load).
- `SlotCache` (weights/expert_stream.py): N slots per layer filled from disk on demand, LFU.
"""
from __future__ import annotations

from typing import Iterator

import torch


class Resident:
    """Every expert in its own slot (slot = expert id): the plain path."""

    streamed = False

    def prefetch(self, idx: torch.Tensor) -> None:
        pass

    def tiles(self, used: list[int]) -> Iterator[list[int]]:
        yield used

    def slot(self, e: int) -> int:
        return e
