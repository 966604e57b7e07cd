"""Which KV blocks each sequence holds, and the prefix cache, in plain integers (no tensors; pool.py owns the
layout). The one owner of that fact: the engine's scheduler asks it for every running sequence, and
`KVCache` (cache.py) for its one sequence, with prefix caching off.

Blocks. The pool has `num_blocks` full-attention blocks and `num_sliding_blocks` sliding-layer blocks, each
of `block_size` positions. A sequence's block table lists its full blocks, one per `block_size` positions
(block j holds positions [j * bs, (j + 1) * bs)); block j may also carry a sliding block for the same
positions (its "sliding part"). A sequence holds the sliding parts of its blocks from `window_start` on:
those some query may still see (a query at p sees p - window < i <= p), and gives the older ones back as it
goes (`commit`). Sequences are named by any hashable key (the engine uses `Sequence.seq_id`). A pool that
grows (`KVCache`'s) adds blocks of either kind with `grow`.

Sharing. Every block has a reference count (sequences whose table holds it) and so has its sliding part
(sequences holding it in their window). A block that is shared, or registered in the prefix cache, is
never written: `reserve(seq, end, start)`, asked before positions [start, end) are written, gives the
sequence a fresh block (and a fresh sliding part) in place of each such block among them and records the
copies (copy-on-write). Only a sequence's last, partly filled block can be in that case (positions are only
appended), so sharing costs at most one copied block per sequence. `take_copies()` hands the recorded
copies, (source, destination) pairs of full blocks and of sliding blocks, to the scheduler, which passes them
to the runner to perform before the step's forward.

The prefix cache (vLLM's automatic prefix caching, made exact for sliding layers). The K/V of position p
depends on the tokens [0, p] alone, so a block's content is named by its tokens and the content of the
block before it: a registered block has an entry (parent entry's id, its tokens) -> block, with a fresh
integer id, so a chain of entries names a whole prefix and dict lookups compare the tokens themselves (no
hash collision can hand a request another prompt's K/V). A "token" is any hashable compared by equality: the
engine names an image's soft-token positions by (the image's content hash, index), docs/multimodal.md §5.4.
- `commit` registers each block of a sequence once its `block_size` positions are computed (a block whose
  content is already registered stays the sequence's own and unregistered; the chain goes on through the
  existing entry). `free` registers whatever the sequence computed since its last `commit` (a request that
  ends in the step that completes its prompt, or in any later step, is freed before a commit could follow
  that step) and the computed part of its last, partly filled block too, so a finished turn of a
  conversation, or a one-token completion, is cached to its last computed token.
- A block whose last holder lets go stays cached (least recently used first out) until a block is needed
  and no free one is left; the same for sliding parts, on their own list. A full block that is evicted
  takes its sliding part with it; a sliding part can be evicted alone (its block stays cached).
- `match(seq, tokens)` gives a new sequence the longest cached prefix of its tokens that is exact on
  every layer: full layers need the blocks of positions [0, P), sliding layers the sliding parts of the
  blocks holding [P - window + 1, P) -- the window the first new query sees. The prefix runs through
  whole blocks, then into one more block as far as its tokens agree (a partly matching block: the
  sequence shares it and copies it before writing its own tokens there). If a sliding part inside the
  window was evicted, P is cut back to the last block boundary whose window is complete; the rest is
  computed again. At least one token is always left to compute (its logits choose the next token).
So a hit is bit-for-bit the K/V a cold run stored, on every layer type, and costs no recomputation.

Several choices of one request (OpenAI's `n`): `fork(parent, child)` gives the child the parent's table
and window, every block and sliding part shared (counts +1).

`window` is how far back a query at p reads sliding K/V: the model's sliding window, plus what a drafter
reads beyond it (the Gemma 4 assistant reads two positions more, engine/mtp.py).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field


@dataclass(eq=False)
class _Entry:
    """A registered block: its content is K/V of `tokens` following the prefix named by entry `parent`."""

    id: int
    parent: int                     # the previous block's entry id; -1 for a sequence's first block
    tokens: tuple[int, ...]         # block_size tokens, or fewer for a partly filled last block
    block: int


@dataclass
class _Seq:
    table: list[int] = field(default_factory=list)   # full blocks, in position order
    window_start: int = 0                            # it holds the sliding parts of table[window_start:]
    ids: list[int] = field(default_factory=list)     # entry ids of its first len(ids) blocks (full, computed)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, num_sliding_blocks: int, window: int, *,
                 caching: bool = True):
        if min(num_blocks, block_size, num_sliding_blocks, window) < 1:
            raise ValueError(f"num_blocks ({num_blocks}), block_size ({block_size}), num_sliding_blocks "
                             f"({num_sliding_blocks}) and window ({window}) must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_sliding_blocks = num_sliding_blocks
        self.window = window
        self.caching = caching
        self._free = list(range(num_blocks - 1, -1, -1))                # a stack: the lowest id is taken first
        self._free_sliding = list(range(num_sliding_blocks - 1, -1, -1))
        self._refs = [0] * num_blocks                                   # block -> sequences whose table holds it
        self._sliding = [-1] * num_blocks                               # block -> its sliding part, or -1
        self._srefs = [0] * num_blocks                                  # block -> holders of its sliding part
        self._lru: OrderedDict[int, None] = OrderedDict()               # cached blocks nobody holds, oldest first
        self._lru_sliding: OrderedDict[int, None] = OrderedDict()       # blocks whose cached sliding part nobody holds
        self._entry: list[_Entry | None] = [None] * num_blocks          # block -> its registration
        self._by_key: dict[tuple[int, tuple[int, ...]], _Entry] = {}
        self._children: dict[int, set[_Entry]] = {}                     # entry id -> entries that follow it
        self._next_id = 0
        self._seqs: dict[Hashable, _Seq] = {}
        self._copies: list[tuple[int, int]] = []                        # copy-on-write, not yet taken
        self._sliding_copies: list[tuple[int, int]] = []

    def grow(self, num_blocks: int, num_sliding_blocks: int) -> None:
        """The pool now has `num_blocks` full and `num_sliding_blocks` sliding blocks (no fewer than before;
        the ids held stay as they are): the new ids are free, taken after the ones free already."""
        if num_blocks < self.num_blocks or num_sliding_blocks < self.num_sliding_blocks:
            raise ValueError(f"a pool of {self.num_blocks} blocks and {self.num_sliding_blocks} sliding blocks "
                             f"cannot shrink to {num_blocks} and {num_sliding_blocks}")
        more = num_blocks - self.num_blocks
        self._free[:0] = range(num_blocks - 1, self.num_blocks - 1, -1)
        self._free_sliding[:0] = range(num_sliding_blocks - 1, self.num_sliding_blocks - 1, -1)
        self._refs += [0] * more
        self._sliding += [-1] * more
        self._srefs += [0] * more
        self._entry += [None] * more
        self.num_blocks, self.num_sliding_blocks = num_blocks, num_sliding_blocks

    # ---- views ----

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def free_blocks(self) -> int:
        """Full blocks that can be taken: free, or cached and held by no sequence."""
        return len(self._free) + len(self._lru)

    @property
    def free_sliding_blocks(self) -> int:
        return len(self._free_sliding) + len(self._lru_sliding)

    @property
    def usage(self) -> float:
        """Fraction of the full-attention blocks held by sequences (a shared block counts once; cached blocks
        nobody holds count as free, as vLLM counts them)."""
        return 1.0 - self.free_blocks / self.num_blocks

    @property
    def cached_blocks(self) -> int:
        """Blocks registered in the prefix cache (whole or a last, partly filled one; held or not)."""
        return len(self._by_key)

    def refs(self, block: int) -> int:
        """How many sequences hold `block`."""
        return self._refs[block]

    def holds(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    def table(self, seq_id: Hashable) -> list[int]:
        return self._seqs[seq_id].table

    def sliding_table(self, seq_id: Hashable) -> list[int]:
        """Per block of the sequence, its sliding block (-1 behind the window): pool.SeqStep's."""
        s = self._seqs[seq_id]
        return [-1] * s.window_start + [self._sliding[b] for b in s.table[s.window_start:]]

    def _window_start(self, computed: int) -> int:
        """The first block a query at position `computed` (or later) may see on sliding layers."""
        return max(0, computed - self.window + 1) // self.block_size

    # ---- room ----

    def _need(self, seq_id: Hashable, end: int, start: int) -> int:
        """Blocks of each kind `reserve(seq_id, end, start)` would take: new ones and copies (a new or copied
        block takes a full block and a sliding part)."""
        table = self._seqs[seq_id].table if seq_id in self._seqs else ()
        grow = max(0, self.blocks_for(end) - len(table))
        return grow + sum(1 for b in table[start // self.block_size:self.blocks_for(end)] if self._readonly(b))

    def _readonly(self, block: int) -> bool:
        return self._refs[block] > 1 or self._entry[block] is not None

    def can_reserve(self, seq_id: Hashable, num_tokens: int, start: int = 0) -> bool:
        """Whether `reserve(seq_id, num_tokens, start)` would succeed."""
        return self._need(seq_id, num_tokens, start) <= min(self.free_blocks, self.free_sliding_blocks)

    def capacity(self, seq_id: Hashable, spare: int = 0, start: int = 0) -> int:
        """How many positions the sequence could hold if it took every free block but `spare` (of each
        kind), writing from position `start` on (a read-only block there takes a free block for its copy)."""
        table = self._seqs[seq_id].table if seq_id in self._seqs else ()
        copies = self._need(seq_id, len(table) * self.block_size, start)
        free = min(self.free_blocks, self.free_sliding_blocks) - spare
        if copies > free:                                               # a block to write needs a copy first
            return min(start, len(table) * self.block_size)
        return (len(table) + max(0, free - copies)) * self.block_size

    def reserve(self, seq_id: Hashable, num_tokens: int, start: int = 0) -> None:
        """Make the sequence's table cover positions [0, num_tokens), with sliding parts from its window on,
        positions [start, num_tokens) in blocks it alone may write: a read-only block there is replaced by
        a copy."""
        if not self.can_reserve(seq_id, num_tokens, start):
            raise RuntimeError(f"{seq_id}: the KV pool has no room for {num_tokens} tokens")
        s = self._seqs.setdefault(seq_id, _Seq(window_start=self._window_start(start)))
        for j in range(start // self.block_size, min(len(s.table), self.blocks_for(num_tokens))):
            old = s.table[j]
            if self._readonly(old):                                     # copy-on-write
                new = self._take_block()
                self._copies.append((old, new))
                if j >= s.window_start:
                    self._take_sliding(new)
                    self._sliding_copies.append((self._sliding[old], self._sliding[new]))
                    self._release_sliding(old)
                self._release(old)
                s.table[j] = new
        while len(s.table) < self.blocks_for(num_tokens):
            block = self._take_block()
            self._take_sliding(block)
            s.table.append(block)

    def take_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The (source, destination) copies recorded since the last call, in order: full blocks, sliding blocks."""
        out = (self._copies, self._sliding_copies)
        self._copies, self._sliding_copies = [], []
        return out

    # ---- the prefix cache ----

    def match(self, seq_id: Hashable, tokens: Sequence[int]) -> int:
        """Give a sequence that holds nothing the longest exact cached prefix of `tokens` (the module
        docstring says which); returns its length P: positions [0, P) need no computing. 0 without caching."""
        if seq_id in self._seqs:
            raise RuntimeError(f"{seq_id}: already holds KV")
        limit = len(tokens) - 1                                          # one token is always computed
        if not self.caching or limit < 1:
            return 0
        bs = self.block_size
        entries: list[_Entry] = []                                       # whole blocks
        parent = -1
        while bs * (len(entries) + 1) <= limit:
            j = len(entries)
            e = self._by_key.get((parent, tuple(tokens[j * bs:(j + 1) * bs])))
            if e is None:
                break
            entries.append(e)
            parent = e.id
        partial, agree = None, 0                                         # then one block as far as it agrees
        rest = tokens[len(entries) * bs:min((len(entries) + 1) * bs, limit)]
        for e in self._children.get(parent, ()):
            n = _agree(e.tokens, rest)
            if n > agree:
                partial, agree = e, n
        blocks = [e.block for e in entries] + ([partial.block] if partial else [])
        hit = len(entries) * bs + agree
        while hit and not all(self._sliding[b] >= 0 for b in blocks[self._window_start(hit):self.blocks_for(hit)]):
            hit = (hit - 1) // bs * bs                                   # a window part was evicted: cut back
        if not hit:
            return 0
        s = self._seqs[seq_id] = _Seq(window_start=self._window_start(hit))
        s.table = blocks[:self.blocks_for(hit)]
        s.ids = [e.id for e in entries[:hit // bs]]
        for j, b in enumerate(s.table):
            if self._refs[b] == 0:
                del self._lru[b]
            self._refs[b] += 1
            if j >= s.window_start:
                if self._srefs[b] == 0:
                    del self._lru_sliding[b]
                self._srefs[b] += 1
        return hit

    def commit(self, seq_id: Hashable, tokens: Sequence[int], computed: int) -> None:
        """Positions [0, computed) of the sequence (whose tokens begin with `tokens`) are in the cache:
        register its whole blocks, give back the sliding parts behind its window."""
        s = self._seqs[seq_id]
        self._register_whole(s, tokens, computed)
        start = min(self._window_start(computed), len(s.table))
        for b in s.table[s.window_start:start]:
            self._release_sliding(b)
        s.window_start = max(s.window_start, start)

    def _register_whole(self, s: _Seq, tokens: Sequence[int], computed: int) -> None:
        """Register the sequence's whole blocks of positions [0, computed) not registered yet, in order."""
        bs = self.block_size
        while self.caching and len(s.ids) < min(computed // bs, len(s.table)):
            j = len(s.ids)
            s.ids.append(self._register(s.table[j], s.ids[-1] if s.ids else -1,
                                        tuple(tokens[j * bs:(j + 1) * bs])).id)

    def _register(self, block: int, parent: int, tokens: tuple[int, ...]) -> _Entry:
        """The entry of this content: the existing one, or `block` registered as it."""
        key = (parent, tokens)
        e = self._by_key.get(key)
        if e is None and self._entry[block] is None:
            e = self._by_key[key] = self._entry[block] = _Entry(self._next_id, parent, tokens, block)
            self._children.setdefault(parent, set()).add(e)
            self._next_id += 1
        return e if e is not None else self._entry[block]

    def _unregister(self, block: int) -> None:
        e = self._entry[block]
        if e is None:
            return
        self._entry[block] = None
        del self._by_key[(e.parent, e.tokens)]
        siblings = self._children[e.parent]
        siblings.discard(e)
        if not siblings:
            del self._children[e.parent]

    # ---- taking and giving back ----

    def _take_block(self) -> int:
        if self._free:
            block = self._free.pop()
        else:
            block, _ = self._lru.popitem(last=False)                    # evict the least recently used
            self._unregister(block)
            if self._sliding[block] >= 0:                               # its sliding part goes with it
                del self._lru_sliding[block]
                self._free_sliding.append(self._sliding[block])
                self._sliding[block] = -1
        self._refs[block] = 1
        return block

    def _take_sliding(self, block: int) -> None:
        """A sliding part for `block` (which has none)."""
        if self._free_sliding:
            part = self._free_sliding.pop()
        else:
            owner, _ = self._lru_sliding.popitem(last=False)            # evict the least recently used part
            part, self._sliding[owner] = self._sliding[owner], -1
        self._sliding[block] = part
        self._srefs[block] = 1

    def _release(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] == 0:
            if self._entry[block] is not None:
                self._lru[block] = None
            else:
                self._free.append(block)
                self._drop_copies_into(block)

    def _release_sliding(self, block: int) -> None:
        self._srefs[block] -= 1
        if self._srefs[block] == 0:
            if self._entry[block] is not None:
                self._lru_sliding[block] = None
            else:
                part, self._sliding[block] = self._sliding[block], -1
                self._free_sliding.append(part)
                self._sliding_copies = [(a, d) for a, d in self._sliding_copies if d != part]

    def _drop_copies_into(self, block: int) -> None:
        """A recorded copy into a block freed before it ran is moot."""
        self._copies = [(a, d) for a, d in self._copies if d != block]

    def fork(self, parent: Hashable, child: Hashable) -> None:
        """The child shares every block and sliding part the parent holds (read-only)."""
        if child in self._seqs:
            raise RuntimeError(f"{child}: already holds KV")
        if parent not in self._seqs:
            raise RuntimeError(f"{parent}: holds no KV to fork")
        p = self._seqs[parent]
        self._seqs[child] = _Seq(list(p.table), p.window_start, list(p.ids))
        for j, b in enumerate(p.table):
            self._refs[b] += 1
            if j >= p.window_start:
                self._srefs[b] += 1

    def free(self, seq_id: Hashable, tokens: Sequence[int] | None = None, computed: int = 0) -> None:
        """Drop everything the sequence holds (finished, aborted, preempted or failed). With `tokens` (whose
        first `computed` positions are in the cache) what it computed is registered first, as `commit` does,
        and its last, partly filled block too, so the cache keeps it to the last computed token (a sequence
        that finishes in the step that completes its prompt, or in any step, has not been committed since
        that step ran). No-op if it holds nothing."""
        s = self._seqs.pop(seq_id, None)
        if s is None:
            return
        if tokens is not None:
            self._register_whole(s, tokens, computed)
        bs = self.block_size
        j = computed // bs
        if (self.caching and tokens is not None and computed % bs and j < len(s.table) and len(s.ids) == j
                and self._refs[s.table[j]] == 1                         # a shared last block is still being written
                and all(d != s.table[j] for _, d in self._copies)):   # ... and so is one whose copy has not run
            self._register(s.table[j], s.ids[-1] if s.ids else -1, tuple(tokens[j * bs:computed]))
        for b in s.table[s.window_start:]:
            self._release_sliding(b)
        for b in s.table:
            self._release(b)


def _agree(a: Sequence, b: Sequence) -> int:
    """How many leading positions of a and b are equal. By equality alone: positions are token ids or, for media
    soft tokens, (content hash, index) keys (engine/sequence.py), which do not order against ids
    (os.path.commonprefix sorts)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
