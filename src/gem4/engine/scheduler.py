"""Scheduling policy: which sequences run in the next step, how many of their tokens, and where their K/V
go. No tensors: the KV pool is accounted for in plain integers by a `BlockManager`.

One engine step = `schedule()` -> `ModelRunner.run(batch)` -> `postprocess(batch, samples)`
(nano-vllm's split), and a step runs every scheduled chunk in one forward pass. The policy is first come,
first served, continuous batching:

    1. every running sequence with one token to go (decoding) gets it;
    2. running sequences still prefilling get a chunk of their tokens, in arrival order;
    3. waiting sequences are admitted in arrival order while fewer than `max_num_seqs` run and the pool
       has room for their first chunk, each starting with that chunk;
all within a budget of `max_num_batched_tokens` tokens per step, no chunk longer than `max_chunk`, so a
long prompt is prefilled a chunk per step beside the running decodes and never stalls them.

When a decoding sequence needs a block and the pool has none, the newest running sequence is preempted
(vLLM's recompute policy): its blocks are freed and it goes back to the front of the queue with nothing
computed; readmitted, it prefills its prompt and the tokens it had generated, then goes on sampling with
the same generator, so its output is the one it would have had.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from gem4.engine.block_manager import BlockManager
from gem4.engine.sequence import Sequence, Status, TokenOutput


@dataclass(frozen=True)
class Chunk:
    """Run `seq.token_ids[start : start + num_tokens]` through the model (start = seq.num_computed)."""

    seq: Sequence
    start: int
    num_tokens: int

    @property
    def samples(self) -> bool:
        """The chunk reaches the end of the sequence, so its last logits choose the next token."""
        return self.start + self.num_tokens == self.seq.num_tokens


@dataclass(frozen=True)
class Batch:
    chunks: tuple[Chunk, ...]

    def __len__(self) -> int:
        return len(self.chunks)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    def __init__(self, blocks: BlockManager, max_chunk: int, max_num_seqs: int = 1,
                 max_num_batched_tokens: int | None = None):
        if max_chunk < 1 or max_num_seqs < 1:
            raise ValueError(f"max_chunk ({max_chunk}) and max_num_seqs ({max_num_seqs}) must be >= 1")
        self.blocks = blocks
        self.max_chunk = max_chunk
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens or max(max_chunk, max_num_seqs)
        if self.max_num_batched_tokens < max_num_seqs:
            raise ValueError("max_num_batched_tokens must leave one decode token per running sequence")
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, request_id: str) -> Sequence | None:
        """Take a request out of the queues and give back its KV (abort, failure); the caller finishes it."""
        for queue in (self.running, self.waiting):
            for seq in queue:
                if seq.request_id == request_id:
                    queue.remove(seq)
                    self.blocks.free(request_id)
                    return seq
        return None

    def schedule(self) -> Batch:
        budget = self.max_num_batched_tokens
        chunks: list[Chunk] = []
        decoding = [s for s in self.running if s.num_pending == 1 and s.num_computed >= s.num_prompt_tokens]
        for seq in decoding:                                                 # 1. decode steps
            if seq not in self.running:                                      # preempted for an older one
                continue
            while not self.blocks.can_reserve(seq.request_id, seq.num_tokens):
                self._preempt(self.running[-1])
                if seq not in self.running:
                    break
            else:
                self.blocks.reserve(seq.request_id, seq.num_tokens)
                chunks.append(Chunk(seq, seq.num_computed, 1))
                budget -= 1
        for seq in [s for s in self.running if s not in decoding]:            # 2. prompts in progress
            n = self._room(seq, budget)
            if n:
                chunks.append(Chunk(seq, seq.num_computed, n))
                budget -= n
        while self.waiting and len(self.running) < self.max_num_seqs:        # 3. admissions
            seq = self.waiting[0]
            n = self._room(seq, budget, spare=len(self.running))             # a block in hand for each decode
            if not n:
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            chunks.append(Chunk(seq, seq.num_computed, n))
            budget -= n
        return Batch(tuple(chunks))

    def _room(self, seq: Sequence, budget: int, spare: int = 0) -> int:
        """The longest next chunk of `seq` that the budget and the pool allow, leaving `spare` blocks free;
        its blocks are reserved. 0 if none fits."""
        n = min(seq.num_pending, self.max_chunk, budget,
                self.blocks.capacity(seq.request_id, spare) - seq.num_computed)
        if n > 0:
            self.blocks.reserve(seq.request_id, seq.num_computed + n)
        return max(n, 0)

    def _preempt(self, seq: Sequence) -> None:
        """Free a running sequence's KV and queue it first, to be recomputed from its first token."""
        self.running.remove(seq)
        self.blocks.free(seq.request_id)
        seq.num_computed = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def postprocess(self, batch: Batch, sampled: Seq[int | None], now: float) -> list[tuple[Sequence, TokenOutput]]:
        """Advance each chunk's sequence; sampled[i] is chunk i's next token (None if it did not sample).
        Returns (sequence, output) per sampled token; finished sequences leave the running list."""
        outputs = []
        for chunk, token in zip(batch.chunks, sampled, strict=True):
            seq = chunk.seq
            seq.num_computed = chunk.start + chunk.num_tokens
            if token is None:
                continue
            out = seq.append_token(token, now)
            if seq.is_finished:
                self.running.remove(seq)
                self.blocks.free(seq.request_id)
            outputs.append((seq, out))
        return outputs
