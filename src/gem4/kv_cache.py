"""KV cache for one sequence: a global append store per full layer, a ring per sliding layer.

The only module that knows the cache layout. Per forward step the model calls:

    step = cache.begin(n_tokens)        # positions of the new tokens, one attention mask per layer type
    K, V = cache.write(i, k, v)         # layer i owns KV: store this chunk, get every key/value it may attend to
    K, V = cache.read(src)              # layer i is KV-shared: the K/V its donor `src` wrote in this same step
    cache.commit(step)                  # the tokens are now part of the sequence

A kernel that writes and reads the cache itself (fast-mode decode) asks `cache.slot(i)` instead.

Layout (docs/gemma4.md §2.5-§2.6):
- full layers: rows [0, length) in position order, grown by doubling.
- sliding layers: a ring of `window + max_chunk` rows; position p lives in row p % ring. A query at p may
  attend to key position j iff j <= p and p - j < window. The ring is large enough that writing a chunk of
  up to `max_chunk` tokens never overwrites a row that a query of the same chunk still needs.
- KV-shared layers own no rows; they read their donor's rows (the donor runs first in the same step).
K/V rows are stored as [rows, n_kv_heads, head_dim].
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from gem4.config import FULL, SLIDING, ModelConfig


@dataclass
class Step:
    positions: torch.Tensor               # [T] absolute positions of the new tokens
    masks: dict[str, torch.Tensor]        # layer type -> [T, S] bool, True = may attend


class KVCache:
    def __init__(self, config: ModelConfig, max_chunk: int, dtype: torch.dtype, device: torch.device | str = "cpu"):
        if max_chunk < 1:
            raise ValueError(f"max_chunk must be >= 1, got {max_chunk}")
        self.config = config
        self.max_chunk = max_chunk
        self.window = config.sliding_window
        self.ring = config.sliding_window + max_chunk
        self.dtype = dtype
        self.device = torch.device(device)
        self.length = 0                                  # tokens committed
        self._k: dict[int, torch.Tensor] = {}            # layer -> [rows, nkv, d]
        self._v: dict[int, torch.Tensor] = {}
        # position held by each ring row (-1 = empty); shared by all sliding layers, which write the same positions
        self._ring_pos = torch.full((self.ring,), -1, dtype=torch.long, device=self.device)
        self._pending: torch.Tensor | None = None        # positions of the step in flight
        for spec in config.layers:
            if spec.owns_kv:
                rows = self.ring if spec.is_sliding else max(64, max_chunk)
                shape = (rows, spec.n_kv_heads, spec.head_dim)
                self._k[spec.index] = torch.zeros(shape, dtype=dtype, device=self.device)
                self._v[spec.index] = torch.zeros(shape, dtype=dtype, device=self.device)

    def begin(self, n_tokens: int) -> Step:
        if not 1 <= n_tokens <= self.max_chunk:
            raise ValueError(f"a step holds 1..{self.max_chunk} tokens (the cache's max_chunk), got {n_tokens}")
        start = self.length
        positions = torch.arange(start, start + n_tokens, device=self.device)
        self._pending = positions
        q = positions[:, None]                                               # [T, 1]
        masks = {}
        # full: every committed position plus the causal part of this chunk
        keys = torch.arange(start + n_tokens, device=self.device)[None, :]  # [1, S]
        masks[FULL] = keys <= q
        # sliding: ring rows as they will be after this chunk is written
        ring_pos = self._ring_pos[: self._ring_rows()].clone()
        ring_pos[positions % self.ring] = positions
        masks[SLIDING] = (ring_pos[None, :] >= 0) & (ring_pos[None, :] <= q) & (q - ring_pos[None, :] < self.window)
        return Step(positions=positions, masks=masks)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v: [T, nkv, d] of the step in flight -> (K, V) [S, nkv, d] this layer attends to (cache dtype)."""
        k_store, v_store, rows, span = self.slot(layer)
        if rows is None:
            raise RuntimeError(f"layer {layer} is KV-shared: it reads its donor's K/V and writes none")
        k_store[rows] = k.to(self.dtype)
        v_store[rows] = v.to(self.dtype)
        return k_store[:span], v_store[:span]

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The K/V that `layer` (a KV owner) holds after this step's write."""
        k_store, v_store, _, span = self.slot(layer)
        return k_store[:span], v_store[:span]

    def slot(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
        """(K store, V store, rows, span) of `layer` for the step in flight: the whole [R, nkv, d] tensors of
        its KV source, the rows [T] this step's k/v go to (None for a KV-shared layer, whose donor writes
        them), and the span: attention sees rows [0, span). For a kernel that writes and reads the cache itself."""
        positions = self._pending
        if positions is None:
            raise RuntimeError("KVCache used outside begin()/commit()")
        spec = self.config.layers[layer]
        src = spec.kv_source
        if spec.is_sliding:
            span = self._ring_rows()
            rows = positions % self.ring if spec.owns_kv else None
        else:
            span = self._end()
            if span > self._k[src].shape[0]:
                self._grow(src, span)
            rows = torch.arange(span - positions.numel(), span, device=self.device) if spec.owns_kv else None
        return self._k[src], self._v[src], rows, span

    def _end(self) -> int:
        """Tokens in the sequence through the step in flight."""
        return self.length + (0 if self._pending is None else self._pending.numel())

    def _ring_rows(self) -> int:
        """Ring rows holding keys through the step in flight: position p lives in row p % ring, so until
        the ring wraps only rows [0, end) do, and attention stops there."""
        return min(self.ring, self._end())

    def commit(self, step: Step) -> None:
        positions = step.positions
        self._ring_pos[positions % self.ring] = positions
        self.length = int(positions[-1]) + 1
        self._pending = None

    def _grow(self, layer: int, needed: int) -> None:
        rows = self._k[layer].shape[0]
        while rows < needed:
            rows *= 2
        for store in (self._k, self._v):
            old = store[layer]
            new = torch.zeros((rows, *old.shape[1:]), dtype=old.dtype, device=old.device)
            new[: old.shape[0]] = old
            store[layer] = new


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> dict[str, int]:
    """Cache bytes one token adds, per layer type, counting only layers that own KV (K and V both stored).

    Sliding layers stop growing after `window + max_chunk` tokens (the ring).
    """
    size = torch.empty((), dtype=dtype).element_size()
    out = {SLIDING: 0, FULL: 0}
    for spec in config.layers:
        if spec.owns_kv:
            out[spec.layer_type] += 2 * spec.n_kv_heads * spec.head_dim * size
    return out
