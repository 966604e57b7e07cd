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

Prefix cache: a sequence admitted while holding nothing first takes the longest exact cached prefix of its
tokens (`BlockManager.match`; kv_cache/blocks.py says what is cached and when a hit is exact) and starts
computing after it. After each step the computed blocks are registered (`BlockManager.commit`), so later
requests can hit the prefix of a running one; a finished, aborted or preempted sequence leaves its blocks
in the cache, to its last computed token (one that finishes in a step, even the step that completes its
prompt, has that step's blocks registered as it is freed). `prefix_queries` / `prefix_hits` count prompt tokens looked up and found (vLLM's
prefix_cache_queries / prefix_cache_hits), once per request, at its first admission.

When a decoding sequence needs a block and the pool has none, the newest running sequence is preempted
(vLLM's recompute policy): its blocks are given back (cached, if the cache is on) and it goes back to the
front of the queue with nothing computed; readmitted, it takes what is still cached of its tokens, computes
the rest (its prompt and the tokens it had generated), then goes on sampling with the same generator, so
its output is the one it would have had.

Several choices of one prompt (OpenAI's `n`): only choice 0, the parent, is queued and prefilled; it is
admitted when its whole group fits (every choice within `max_num_seqs`, counted from admission). At the
step whose chunk completes its prompt (the chunk that samples), the scheduler forks the other choices off
it: each shares the parent's blocks (`BlockManager.fork`) and gets a zero-token `Chunk`
whose `source` is the parent's chunk, so the runner samples its first token from the same logits row with
the choice's own generator. From the next step on the choices are independent sequences decoding in the
same batches; a shared block is copied before one of them writes into it (`Batch.block_copies` and
`sliding_copies`, done before the forward). A preempted choice is recomputed alone, like any sequence. So
the prompt is computed once, whatever n.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from gem4.engine.sequence import Sequence, Status, TokenOutput
from gem4.kv_cache import BlockManager


@dataclass(frozen=True)
class Chunk:
    """Run `seq.token_ids[start : start + num_tokens]` through the model (start = seq.num_computed).

    A fork (num_tokens 0, `source` set) computes nothing: its sequence samples its first token from the
    logits of chunk `source` of the same batch (its parent's last prompt chunk).

    Speculation: a decode step may carry up to `draft_slots` drafts after its token (the runner's drafter
    proposes them; the positions are reserved here), verified in the same forward."""

    seq: Sequence
    start: int
    num_tokens: int
    source: int | None = None
    draft_slots: int = 0

    @property
    def samples(self) -> bool:
        """The chunk reaches the end of the sequence, so its last logits choose the next token."""
        return self.start + self.num_tokens == self.seq.num_tokens


@dataclass(frozen=True)
class Batch:
    """One step. The runner copies `block_copies` and `sliding_copies` (full and sliding blocks, source ->
    destination: copy-on-write) before the forward."""

    chunks: tuple[Chunk, ...]
    block_copies: tuple[tuple[int, int], ...] = ()
    sliding_copies: tuple[tuple[int, int], ...] = ()

    def __len__(self) -> int:
        return len(self.chunks)

    @property
    def num_tokens(self) -> int:
        """Tokens the step may run: the chunks' tokens and their draft slots."""
        return sum(c.num_tokens + c.draft_slots for c in self.chunks)


class Scheduler:
    def __init__(self, blocks: BlockManager, max_chunk: int, max_num_seqs: int = 1,
                 max_num_batched_tokens: int | None = None, num_speculative_tokens: int = 0):
        if max_chunk < 1 or max_num_seqs < 1:
            raise ValueError(f"max_chunk ({max_chunk}) and max_num_seqs ({max_num_seqs}) must be >= 1")
        self.blocks = blocks
        self.max_chunk = max_chunk
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens or max(max_chunk, max_num_seqs)
        if self.max_num_batched_tokens < max_num_seqs:
            raise ValueError("max_num_batched_tokens must leave one decode token per running sequence")
        self.num_speculative_tokens = num_speculative_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.prefix_queries = 0                 # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0                    # ... and found there

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, request_id: str, failed: bool = False, index: int | None = None) -> list[Sequence]:
        """Take every choice of a request (or only choice `index`) out of the queues and give back their KV
        (abort, failure: a failed request's last block is not cached); the caller finishes them. Choices not
        yet forked come with their parent; one of them alone is dropped from its parent's list, and a parent
        with choices still to fork stays (their prompt is its). [] if none is queued."""
        out = []
        for queue in (self.running, self.waiting):
            for seq in [s for s in queue if s.request_id == request_id]:
                if index is not None and seq.index != index:
                    out += [c for c in seq.forks if c.index == index]
                    seq.forks = [c for c in seq.forks if c.index != index]
                    continue
                if index is not None and seq.forks:
                    continue
                queue.remove(seq)
                self._free(seq, cache=not failed)
                out += [seq, *seq.forks]
                seq.forks = []
        return sorted(out, key=lambda s: s.index)

    def _occupied(self) -> int:
        """Running sequences, counting the choices still to be forked off them."""
        return len(self.running) + sum(len(s.forks) for s in self.running)

    def schedule(self) -> Batch:
        budget = self.max_num_batched_tokens
        chunks: list[Chunk] = []
        decoding = [s for s in self.running if s.num_pending == 1 and s.num_computed >= s.num_prompt_tokens]
        spare = budget - len(decoding)                                       # tokens beyond one per decode
        for seq in decoding:                                                 # 1. decode steps
            if seq not in self.running:                                      # preempted for an older one
                continue
            # drafts: as many as speculation asks, the sequence's own limit allows, the budget leaves and the
            # request can still emit after this step's token (its max_tokens counts the context's end too);
            # fewer after a round that accepted none, none while its drafts keep missing (Sequence.record_drafts)
            slots = max(0, min(self.num_speculative_tokens, seq.draft_limit or self.num_speculative_tokens, spare,
                               seq.max_tokens - len(seq.output_ids) - 1))
            if slots and seq.draft_pause:
                seq.draft_pause -= 1
                slots = 0
            while seq in self.running and not self.blocks.can_reserve(seq.seq_id, seq.num_tokens + slots,
                                                                      seq.num_computed):
                if slots:
                    slots = 0                                                # no room for drafts: a plain step
                else:
                    self._preempt(self.running[-1])
            if seq not in self.running:
                continue
            self.blocks.reserve(seq.seq_id, seq.num_tokens + slots, seq.num_computed)
            chunks.append(Chunk(seq, seq.num_computed, 1, draft_slots=slots))
            budget -= 1 + slots
            spare -= slots
        forks: list[Sequence] = []
        for seq in [s for s in self.running if s not in decoding]:            # 2. prompts in progress
            n = self._room(seq, budget)
            if n:
                chunks.append(Chunk(seq, seq.num_computed, n))
                budget -= n
                forks.append(seq)
        while self.waiting and self._occupied() + 1 + len(self.waiting[0].forks) <= self.max_num_seqs:
            seq = self.waiting[0]                                            # 3. admissions
            self._match(seq)
            # a block in hand for each decode, and for each choice of this request
            n = self._room(seq, budget, spare=self._occupied() + len(seq.forks))
            if not n:
                self.blocks.free(seq.seq_id)                                 # the prefix it took waits with it
                seq.num_computed = 0
                break
            if seq.num_cached_tokens is None:                                # its first admission
                seq.num_cached_tokens = seq.num_computed
                if self.blocks.caching:
                    self.prefix_queries += seq.num_prompt_tokens
                    self.prefix_hits += seq.num_computed
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            chunks.append(Chunk(seq, seq.num_computed, n))
            budget -= n
            forks.append(seq)
        for seq in forks:                                                    # 4. choices forked off
            i = next(i for i, c in enumerate(chunks) if c.seq is seq)
            if not (seq.forks and chunks[i].samples):
                continue
            for child in seq.forks:
                self.blocks.fork(seq.seq_id, child.seq_id)
                child.status = Status.RUNNING
                child.scheduled_time = seq.scheduled_time
                child.num_cached_tokens = seq.num_cached_tokens                # the request's prompt, shared
                self.running.append(child)
                chunks.append(Chunk(child, seq.num_tokens, 0, source=i))
            seq.forks = []
        block_copies, sliding_copies = self.blocks.take_copies()
        return Batch(tuple(chunks), tuple(block_copies), tuple(sliding_copies))

    def _match(self, seq: Sequence) -> None:
        """A sequence about to be admitted (holding no KV) takes the cached prefix of its tokens."""
        seq.num_computed = self.blocks.match(seq.seq_id, seq.cache_keys)

    def _room(self, seq: Sequence, budget: int, spare: int = 0) -> int:
        """The longest next chunk of `seq` that the budget and the pool allow, leaving `spare` blocks free;
        its blocks are reserved. 0 if none fits.

        A bidirectional media span (an image on 26B/31B: docs/multimodal.md §5.3) is never split: a chunk that
        would end inside one ends before it, and one that starts at (or, after a prefix hit, inside) it takes
        it whole -- past the step's token budget if need be, never past max_chunk (Engine.submit refuses a
        longer span)."""
        start = seq.num_computed
        limit = min(seq.num_pending, self.max_chunk, self.blocks.capacity(seq.seq_id, spare, start) - start)
        n = min(limit, budget)
        for a, b in seq.spans:
            if a < start + n < b:
                n = a - start if a > start else (b - start if b - start <= limit else 0)
        if n > 0:
            self.blocks.reserve(seq.seq_id, seq.num_computed + n, seq.num_computed)
        return max(n, 0)

    def _preempt(self, seq: Sequence) -> None:
        """Free a running sequence's KV and queue it first, to be recomputed from its first token."""
        self.running.remove(seq)
        self._free(seq)
        seq.num_computed = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def postprocess(self, batch: Batch, sampled: Seq[Seq[int] | None], now: float) -> list[tuple[Sequence, TokenOutput]]:
        """Advance each chunk's sequence; sampled[i] is chunk i's new tokens (None if it did not sample): one,
        or with speculation its accepted drafts and one more -- the drafts' K/V, computed in the step, stay,
        those of rejected drafts are written over by later steps. A request that ends inside them keeps the
        tokens up to its end. Returns (sequence, output) per appended token; finished sequences leave the
        running list."""
        outputs = []
        for chunk, tokens in zip(batch.chunks, sampled, strict=True):
            seq = chunk.seq
            accepted = len(tokens) - 1 if tokens else 0                      # drafts verified
            seq.num_computed = chunk.start + chunk.num_tokens + accepted
            for token in tokens or ():
                outputs.append((seq, seq.append_token(token, now)))
                if seq.is_finished:
                    break
            if tokens:                                                       # the last token is never computed
                seq.num_computed = min(seq.num_computed, seq.num_tokens - 1)
            if seq.is_finished:
                self.running.remove(seq)
                self._free(seq)
            else:
                self.blocks.commit(seq.seq_id, seq.cache_keys, seq.num_computed)
        return outputs

    def _free(self, seq: Sequence, cache: bool = True) -> None:
        """Give back a sequence's KV; with `cache`, what it computed stays in the prefix cache to its last
        computed token."""
        self.blocks.free(seq.seq_id, seq.cache_keys if cache else None, seq.num_computed)
