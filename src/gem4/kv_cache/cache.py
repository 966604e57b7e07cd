"""`KVCache`: one sequence in a pool of its own, grown on demand (`Model.extend`, `Model.logits`, tests,
benchmarks). Which blocks it holds is a `BlockManager`'s (prefix caching off), as for the engine's sequences:
the manager hands out its blocks, and takes back the sliding ones behind the window."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from gem4.config import ModelConfig
from gem4.kv_cache.blocks import BlockManager
from gem4.kv_cache.pool import BLOCK_SIZE, KVPool, SeqStep, StepLayout, sliding_blocks_per_seq

SEQ = 0                   # the name of the one sequence in the block manager


class KVCache:
    """One sequence with a pool of its own. `step(n)` lays out the next n tokens; the model commits them.
    The pool starts small and doubles each kind of block it runs out of (rows stay where they are): full
    blocks as the sequence grows, sliding blocks only for a step longer than any before, since the ones
    behind the window go back to the block manager and are reused."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str = "cpu"):
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self.length = 0                                   # tokens stored
        sliding = sliding_blocks_per_seq(config.sliding_window, BLOCK_SIZE)
        self.pool = KVPool(config, num_blocks=4, num_sliding_blocks=sliding, dtype=dtype, device=device)
        self.blocks = BlockManager(self.pool.num_blocks, BLOCK_SIZE, sliding, config.sliding_window, caching=False)

    @property
    def block_table(self) -> list[int]:
        """Full layers: the blocks of positions [0, length + the last step's tokens), in order."""
        return self.blocks.table(SEQ) if self.blocks.holds(SEQ) else []

    @property
    def sliding_table(self) -> list[int]:
        """Sliding layers: per block, its sliding block (-1 behind the window), as SeqStep takes it."""
        return self.blocks.sliding_table(SEQ) if self.blocks.holds(SEQ) else []

    def step(self, num_tokens: int, logits: int = 1, prefill: bool | None = None,
             bidirectional: Sequence[tuple[int, int]] = ()) -> StepLayout:
        """The layout of the next `num_tokens` tokens; `logits` of its last rows are wanted; `prefill` (StepLayout):
        by default, a step of more than one token; `bidirectional`: SeqStep's spans."""
        start, end = self.length, self.length + num_tokens
        if self.blocks.holds(SEQ):
            self.blocks.commit(SEQ, (), start)                        # gives back the blocks behind the window
        if not self.blocks.can_reserve(SEQ, end, start):
            self._grow(self.blocks.blocks_for(end) - len(self.block_table))
        self.blocks.reserve(SEQ, end, start)
        return self.pool.layout([SeqStep(start, num_tokens, self.block_table, self.sliding_table, logits=logits,
                                         bidirectional=tuple(bidirectional))],
                                num_tokens > 1 if prefill is None else prefill)

    def commit(self, num_tokens: int) -> None:
        self.length += num_tokens

    def _grow(self, blocks: int) -> None:
        """Room for `blocks` more blocks of each kind (doubling what runs short), rows kept."""
        old, bm = self.pool, self.blocks
        full, sliding = old.num_blocks, old.num_sliding_blocks
        while full - old.num_blocks + bm.free_blocks < blocks:
            full *= 2
        while sliding - old.num_sliding_blocks + bm.free_sliding_blocks < blocks:
            sliding *= 2
        bm.grow(full, sliding)
        self.pool = old.grown(full, sliding)
