"""How big the engine's KV pool is: its policy, not the cache's layout (kv_cache/ holds that). Full blocks
from a byte budget or from the context and the memory available (/proc/meminfo), sliding blocks from the
window, the longest step and, with prefix caching, room for finished windows."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from gem4.config import FULL, SLIDING, ModelConfig
from gem4.kv_cache import BLOCK_SIZE, kv_bytes_per_token, sliding_blocks_per_seq
from gem4.procfs import proc_bytes


@dataclass(frozen=True)
class PoolSize:
    num_blocks: int           # full-attention blocks
    block_bytes: int          # one full-attention block, every owning layer, K and V
    num_sliding_blocks: int
    sliding_block_bytes: int  # one sliding block, every owning sliding layer, K and V
    num_seqs: int             # sequences running at once (each holds up to `sliding_blocks_per_seq`)
    block_size: int = BLOCK_SIZE

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.block_bytes + self.num_sliding_blocks * self.sliding_block_bytes

    @property
    def tokens(self) -> int:
        """Full-attention positions the pool holds, all sequences together."""
        return self.num_blocks * self.block_size


def available_memory() -> int | None:
    """MemAvailable from /proc/meminfo in bytes (None where there is none)."""
    return proc_bytes("/proc/meminfo", "MemAvailable")


# Sliding blocks per running sequence beyond its own window, kept for the prefix cache: room for each
# sequence's last window after it finishes (a conversation's next turn starts there) and for the window
# before a shared prefix's end (a system prompt), while the running ones move on.
SLIDING_CACHE_FACTOR = 2


def kv_pool_size(config: ModelConfig, dtype: torch.dtype, *, max_chunk: int, num_seqs: int, max_model_len: int,
                 budget: int | None = None, prefix_caching: bool = False, block_size: int = BLOCK_SIZE,
                 window_slack: int = 0) -> PoolSize:
    """How many blocks a KV pool gets. Sliding blocks: `num_seqs` windows (`sliding_blocks_per_seq` each, of
    the window and `window_slack` positions more that a drafter reads), times SLIDING_CACHE_FACTOR with prefix
    caching. Full blocks: what `budget` bytes leave, or by default room
    for `num_seqs` sequences of `max_model_len`, capped at half the available memory. Either way at least one
    sequence of max_model_len fits (a budget too small for that is refused)."""
    per_token = kv_bytes_per_token(config, dtype)
    block_bytes = per_token[FULL] * block_size
    sliding_block_bytes = per_token[SLIDING] * block_size
    sliding = num_seqs * sliding_blocks_per_seq(config.sliding_window + window_slack, max_chunk, block_size)
    sliding *= SLIDING_CACHE_FACTOR if prefix_caching else 1
    sliding_bytes = sliding * sliding_block_bytes
    one_seq = -(-max_model_len // block_size)
    if budget is None:
        blocks = one_seq * num_seqs
        free = available_memory()
        if free is not None and block_bytes:
            blocks = min(blocks, (free // 2 - sliding_bytes) // block_bytes)
        blocks = max(blocks, one_seq)
    else:
        blocks = (budget - sliding_bytes) // block_bytes if block_bytes else one_seq
        if blocks < one_seq:
            need = sliding_bytes + one_seq * block_bytes
            raise ValueError(f"a KV cache of {budget / 2**30:.3f} GiB cannot hold one sequence of max_model_len "
                             f"{max_model_len} beside the sliding-window blocks of {num_seqs} sequences: that "
                             f"needs {need / 2**30:.3f} GiB")
    return PoolSize(int(blocks), block_bytes, sliding, sliding_block_bytes, num_seqs, block_size)
