"""Which parts of the KV pool each sequence holds, in plain integers (no tensors; kv_cache.py owns the layout).

The pool has `num_blocks` full-attention blocks of `block_size` positions and `num_slots` sliding-layer
rings (one per running sequence). A sequence takes a ring slot when it is first given blocks and keeps
it until it is freed; its block table grows a block at a time as its tokens reach the next block.
Sequences are named by any hashable key (the engine uses `Sequence.seq_id`).

Sharing (the n choices of one request, OpenAI's `n`): every block has a reference count.
`fork(parent, child)` gives the child the parent's block table, every block shared read-only (its count
+1), and a ring slot of its own (the caller copies the parent's ring into it: a ring is rewritten in place
every step, so it cannot be shared). A shared block is never written: `reserve(seq, end, start)`, which
is asked before positions [start, end) are written, gives the sequence a fresh block in place of each
shared one among them and records the copy (copy-on-write). Only a sequence's last, partly filled block
can be shared and written (every earlier block is full, and positions are only appended), so a fork costs
at most one copied block per choice. `free` drops the sequence's references; a block whose count reaches
0 goes back to the free list. `take_copies()` hands the recorded copies, (source block, destination
block) pairs, to the scheduler, which passes them to the runner to perform before the step's forward.
"""
from __future__ import annotations

from collections.abc import Hashable


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
        self._refs = [0] * num_blocks                                 # block -> sequences whose table holds it
        self._tables: dict[Hashable, list[int]] = {}
        self._slots: dict[Hashable, int] = {}
        self._copies: list[tuple[int, int]] = []                      # copy-on-write, not yet taken

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def free_blocks(self) -> int:
        return len(self._free_blocks)

    @property
    def usage(self) -> float:
        """Fraction of the full-attention blocks in use (a shared block counts once)."""
        return 1.0 - len(self._free_blocks) / self.num_blocks

    def refs(self, block: int) -> int:
        """How many sequences hold `block`."""
        return self._refs[block]

    def _shared(self, seq_id: Hashable, start: int, end: int) -> int:
        """Shared blocks of the table among those holding positions [start, end): each needs a copy first."""
        table = self._tables.get(seq_id, ())
        return sum(1 for b in table[start // self.block_size:self.blocks_for(end)] if self._refs[b] > 1)

    def capacity(self, seq_id: Hashable, spare: int = 0, start: int = 0) -> int:
        """How many positions the sequence could hold if it took every free block but `spare`, writing from
        position `start` on (a shared block there takes a free block for its copy). 0 if it holds no slot
        and none is free."""
        if seq_id not in self._slots and not self._free_slots:
            return 0
        free = len(self._free_blocks) - spare - self._shared(seq_id, start, len(self._tables.get(seq_id, ())) *
                                                             self.block_size)
        return (len(self._tables.get(seq_id, ())) + max(0, free)) * self.block_size

    def can_reserve(self, seq_id: Hashable, num_tokens: int, start: int = 0) -> bool:
        """Whether `reserve(seq_id, num_tokens, start)` would succeed."""
        if seq_id not in self._slots and not self._free_slots:
            return False
        table = self._tables.get(seq_id, ())
        need = max(0, self.blocks_for(num_tokens) - len(table)) + self._shared(seq_id, start, num_tokens)
        return need <= len(self._free_blocks)

    def reserve(self, seq_id: Hashable, num_tokens: int, start: int = 0) -> None:
        """Make the sequence's block table cover positions [0, num_tokens) (and give it a slot), positions
        [start, num_tokens) in blocks it alone holds: a shared block there is replaced by a copy."""
        if not self.can_reserve(seq_id, num_tokens, start):
            raise RuntimeError(f"{seq_id}: the KV pool has no room for {num_tokens} tokens")
        if seq_id not in self._slots:
            self._slots[seq_id] = self._free_slots.pop()
            self._tables[seq_id] = []
        table = self._tables[seq_id]
        for i in range(start // self.block_size, min(len(table), self.blocks_for(num_tokens))):
            if self._refs[table[i]] > 1:                              # copy-on-write
                new = self._take_block()
                self._refs[table[i]] -= 1
                self._copies.append((table[i], new))
                table[i] = new
        while len(table) < self.blocks_for(num_tokens):
            table.append(self._take_block())

    def fork(self, parent: Hashable, child: Hashable) -> None:
        """The child shares every block of the parent's table (read-only) and takes a ring slot of its own."""
        if child in self._slots:
            raise RuntimeError(f"{child}: already holds KV")
        if parent not in self._slots:
            raise RuntimeError(f"{parent}: holds no KV to fork")
        if not self._free_slots:
            raise RuntimeError(f"{child}: no ring slot is free to fork {parent}")
        self._slots[child] = self._free_slots.pop()
        self._tables[child] = list(self._tables[parent])
        for b in self._tables[child]:
            self._refs[b] += 1

    def take_copies(self) -> list[tuple[int, int]]:
        """The (source, destination) block copies recorded since the last call, in order."""
        copies, self._copies = self._copies, []
        return copies

    def _take_block(self) -> int:
        block = self._free_blocks.pop()
        self._refs[block] = 1
        return block

    def free(self, seq_id: Hashable) -> None:
        """Drop everything the sequence holds (finished, aborted or preempted): its slot, and a reference
        to each of its blocks (freed when no other sequence holds it). No-op if it holds nothing."""
        if seq_id not in self._slots:
            return
        self._free_slots.append(self._slots.pop(seq_id))
        released = []
        for b in self._tables.pop(seq_id):
            self._refs[b] -= 1
            if self._refs[b] == 0:
                released.append(b)
        self._free_blocks.extend(reversed(released))
        if released and self._copies:                                 # a copy into a freed block is moot
            gone = set(released)
            self._copies = [(s, d) for s, d in self._copies if d not in gone]

    def table(self, seq_id: Hashable) -> list[int]:
        return self._tables[seq_id]

    def slot(self, seq_id: Hashable) -> int:
        return self._slots[seq_id]
