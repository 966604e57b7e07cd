"""Which parts of the KV pool each sequence holds, in plain integers (no tensors; kv_cache.py owns the layout).

The pool has `num_blocks` full-attention blocks of `block_size` positions and `num_slots` sliding-layer
rings (one per running sequence). A sequence takes a ring slot when it is first given blocks and keeps
it until it is freed; its block table grows a block at a time as its tokens reach the next block.
"""
from __future__ import annotations


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, num_slots: int):
        if min(num_blocks, block_size, num_slots) < 1:
            raise ValueError(f"num_blocks ({num_blocks}), block_size ({block_size}) and num_slots ({num_slots}) "
                             "must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_slots = num_slots
        self._free_blocks = list(range(num_blocks - 1, -1, -1))       # a stack: the lowest id is taken first
        self._free_slots = list(range(num_slots - 1, -1, -1))
        self._tables: dict[str, list[int]] = {}
        self._slots: dict[str, int] = {}

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def free_blocks(self) -> int:
        return len(self._free_blocks)

    @property
    def usage(self) -> float:
        """Fraction of the full-attention blocks in use."""
        return 1.0 - len(self._free_blocks) / self.num_blocks

    def holds(self, seq_id: str) -> bool:
        return seq_id in self._slots

    def capacity(self, seq_id: str, spare: int = 0) -> int:
        """How many positions the sequence could hold if it took every free block but `spare` (0 if it
        holds no slot and none is free)."""
        if seq_id not in self._slots and not self._free_slots:
            return 0
        blocks = len(self._tables.get(seq_id, ())) + max(0, len(self._free_blocks) - spare)
        return blocks * self.block_size

    def can_reserve(self, seq_id: str, num_tokens: int) -> bool:
        """Whether `reserve(seq_id, num_tokens)` would succeed."""
        return num_tokens <= self.capacity(seq_id)

    def reserve(self, seq_id: str, num_tokens: int) -> None:
        """Make the sequence's block table cover positions [0, num_tokens) (and give it a slot)."""
        if not self.can_reserve(seq_id, num_tokens):
            raise RuntimeError(f"{seq_id}: the KV pool has no room for {num_tokens} tokens")
        if seq_id not in self._slots:
            self._slots[seq_id] = self._free_slots.pop()
            self._tables[seq_id] = []
        table = self._tables[seq_id]
        while len(table) < self.blocks_for(num_tokens):
            table.append(self._free_blocks.pop())

    def free(self, seq_id: str) -> None:
        """Give back everything the sequence holds (finished, aborted or preempted). No-op if it holds nothing."""
        if seq_id not in self._slots:
            return
        self._free_slots.append(self._slots.pop(seq_id))
        self._free_blocks.extend(reversed(self._tables.pop(seq_id)))

    def table(self, seq_id: str) -> list[int]:
        return self._tables[seq_id]

    def slot(self, seq_id: str) -> int:
        return self._slots[seq_id]
