"""Scheduling policy: which sequences run in the next step, and how many of their tokens. No tensors.

One engine step = `schedule()` -> `ModelRunner.run(batch)` -> `postprocess(batch, samples)`
(nano-vllm's split). The policy is first come, first served:

    1. every running sequence that is decoding gets its 1 token;
    2. running sequences still prefilling get a chunk of their prompt, in arrival order;
    3. waiting sequences are admitted in arrival order while fewer than `max_num_seqs` run,
       each starting with a prompt chunk;
all within a budget of `max_num_batched_tokens` tokens per step, no chunk longer than `max_chunk`.

With the defaults (`max_num_seqs=1`) requests are served strictly one after the other: a request
is prefilled in chunks of up to `max_chunk` tokens and then decoded to its end before the next is
admitted. Continuous batching is the same `Batch` with more chunks in it: the runner executes
whatever chunks it is given, so a batching policy replaces this class without touching the runner.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass

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
    def __init__(self, max_chunk: int, max_num_seqs: int = 1, max_num_batched_tokens: int | None = None):
        if max_chunk < 1 or max_num_seqs < 1:
            raise ValueError(f"max_chunk ({max_chunk}) and max_num_seqs ({max_num_seqs}) must be >= 1")
        self.max_chunk = max_chunk
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens or max(max_chunk, max_num_seqs)
        if self.max_num_batched_tokens < max_num_seqs:
            raise ValueError("max_num_batched_tokens must leave one decode token per running sequence")
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, request_id: str) -> Sequence | None:
        """Take a request out of the queues (abort); the caller finishes it."""
        for seq in self.running:
            if seq.request_id == request_id:
                self.running.remove(seq)
                return seq
        for seq in self.waiting:
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                return seq
        return None

    def schedule(self) -> Batch:
        budget = self.max_num_batched_tokens
        chunks: list[Chunk] = []
        decoding = [s for s in self.running if s.num_computed >= s.num_prompt_tokens]
        prefilling = [s for s in self.running if s.num_computed < s.num_prompt_tokens]
        for seq in decoding:                                   # 1. decode steps
            chunks.append(Chunk(seq, seq.num_computed, seq.num_pending))
            budget -= seq.num_pending
        for seq in prefilling:                                 # 2. prompts in progress
            if budget <= 0:
                break
            n = min(seq.num_pending, self.max_chunk, budget)
            chunks.append(Chunk(seq, seq.num_computed, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:   # 3. admissions
            seq = self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            n = min(seq.num_pending, self.max_chunk, budget)
            chunks.append(Chunk(seq, seq.num_computed, n))
            budget -= n
        return Batch(tuple(chunks))

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
            outputs.append((seq, out))
        return outputs
