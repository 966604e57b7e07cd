"""Batch -> tensors -> one forward -> sample. The only part of the engine that touches tensors.

The runner owns the KV pool's tensors (kv_cache.KVPool; where each sequence's K/V live is the block
manager's, read here) and, per running request, its sampling generator (one `SeedStream` per seeded
request, kept for the request's lifetime, preemptions included, so the same seed gives the same tokens
whatever else runs; see sampling.py). It reads sequences and never changes them: the scheduler's
`postprocess` does that with the ids `run` returns.

A step runs the batch's chunks through the model with their tokens laid out one sequence after another:
each linear layer once over all rows of a forward pass, attention once per layer over all its sequences.
A chunk that reaches the end of its sequence (the last prompt chunk, a decode step) samples its next
token from its last row's logits; the other chunks only fill the cache. A fork (a zero-token chunk: a
further choice of a request, see scheduler.py) computes nothing and samples its first token from its source
chunk's logits row, with its own generator. All sampling rows go through the sampler together as one
[B, V] batch.

Copies the scheduler asks for (plain int pairs in the Batch) are done here, on the pool, before the
forward: the copy-on-write block copies (the copy must hold the shared rows before a sequence writes over
them). A copy that raises is no one request's fault: it fails the step.

Batch invariance: in the fast mode a linear layer takes up to DECODE_ROWS rows through the GEMV kernels
and more through bf16 GEMM tiles, which round differently. So that a request's tokens never depend on its
batch mates, a chunk's rows take the path its own size picks: chunks of at most DECODE_ROWS tokens
(decode steps, short prompts) go through forward passes of at most DECODE_ROWS rows together, longer
chunks through one pass of their own kind. A step with both costs one more pass over the weights.

Failures stay with the request they concern: `run` returns, per chunk, a `Sample`, None (cache only) or a
`Failed` holding the exception, and never raises for one request's fault:
    - a fork shares its source chunk's outcome: the same logits, or the same `Failed`;
    - a forward pass that raises is run again chunk by chunk, each alone (the rows it wrote are written
      again with the same values), so only the chunks that fail alone fail and the others get the
      logits they get alone;
    - logits that are not all finite (NaN/inf: a broken checkpoint, an overflow) fail their row with
      `NonFiniteLogits` before the sampler sees them, so no request is ever given a token drawn from them;
    - a batched sampler call that raises is replayed row by row, each seeded row from the SeedStream state
      it had before the batch, so only the rows that raise alone fail and the seeded others get exactly the
      tokens they get alone (unseeded rows draw afresh from torch's global generator).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from gem4.engine.block_manager import BlockManager
from gem4.engine.scheduler import Batch, Chunk
from gem4.kv_cache import KVPool, SeqStep
from gem4.model.layers import DECODE_ROWS
from gem4.sampling import Sampler, SeedStream


class NonFiniteLogits(RuntimeError):
    """The model produced NaN or infinite logits for a request; it ends with an error."""


@dataclass(frozen=True)
class Sample:
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


@dataclass(frozen=True)
class Failed:
    """This chunk's request failed in this step; `error` says why. Its cache is no longer usable."""

    error: BaseException


class ModelRunner:
    def __init__(self, model, pool: KVPool, blocks: BlockManager):
        self.model = model
        self.pool = pool
        self.blocks = blocks                     # read only: the scheduler decides, the runner lays out
        self.device = model.device
        self.sampler = Sampler()
        self._generators: dict[int, SeedStream | None] = {}   # seq_id ->

    @torch.inference_mode()
    def run(self, batch: Batch) -> list[Sample | Failed | None]:
        """One forward step over the batch's chunks -> per chunk its sampled token (None: cache only)
        or `Failed` (see the module docstring)."""
        chunks = batch.chunks
        self.pool.copy_blocks(batch.block_copies)
        self.pool.copy_sliding_blocks(batch.sliding_copies)
        computed = [i for i, c in enumerate(chunks) if c.num_tokens]
        work = tuple(chunks[i] for i in computed)
        try:
            done = self._forward(work)
        except Exception as e:                                  # noqa: BLE001 - find the chunks at fault
            done = [Failed(e)] if len(work) == 1 else [self._forward_alone(c) for c in work]
        rows: list = [None] * len(chunks)
        for i, row in zip(computed, done):
            rows[i] = row
        for i, c in enumerate(chunks):
            if c.source is not None:                            # a fork: its parent's logits
                rows[i] = rows[c.source]
        out: list[Sample | Failed | None] = [None] * len(chunks)
        sampling, logits = [], []                               # chunk index, [1, V] per sampling chunk
        for i, (chunk, row) in enumerate(zip(chunks, rows)):
            if row is None or isinstance(row, Failed):
                out[i] = row
            elif not bool(torch.isfinite(row).all()):
                position = chunk.start + chunk.num_tokens - 1           # a fork: its source's last row
                out[i] = Failed(NonFiniteLogits(
                    f"the model produced non-finite logits (NaN or inf) at position {position}, "
                    f"choosing completion token {len(chunk.seq.output_ids) + 1}"))
            else:
                sampling.append(i)
                logits.append(row)
        if sampling:
            for i, sample in zip(sampling, self._sample([chunks[i].seq for i in sampling], torch.cat(logits))):
                out[i] = sample
        return out

    def _forward(self, chunks: tuple[Chunk, ...]) -> list[torch.Tensor | None]:
        """The chunks through the model (in passes by chunk size, see the module docstring) -> per chunk its
        last row's logits [1, V] if it samples, else None."""
        out: dict[int, torch.Tensor | None] = {}
        for group in _passes(chunks):
            out.update(zip(group, self._forward_pass([chunks[i] for i in group])))
        return [out[i] for i in range(len(chunks))]

    def _forward_pass(self, chunks: list[Chunk]) -> list[torch.Tensor | None]:
        """One forward pass over the chunks -> per chunk its last row's logits [1, V] if it samples, else None."""
        steps, ids = [], []
        for c in chunks:
            seq_id = c.seq.seq_id
            steps.append(SeqStep(c.start, c.num_tokens, self.blocks.table(seq_id), self.blocks.sliding_table(seq_id),
                                 logits=int(c.samples)))
            ids += c.seq.token_ids[c.start:c.start + c.num_tokens]
        logits = self.model.forward(torch.tensor(ids, dtype=torch.long, device=self.device),
                                    self.pool.layout(steps), self.pool)             # [M, V]
        rows = iter(logits.split(1))
        return [next(rows) if c.samples else None for c in chunks]

    def _forward_alone(self, chunk: Chunk) -> torch.Tensor | Failed | None:
        try:
            return self._forward((chunk,))[0]
        except Exception as e:                                  # noqa: BLE001 - this request's failure only
            return Failed(e)

    def _sample(self, seqs, logits: torch.Tensor) -> list[Sample | Failed]:
        """All sampling rows together; if that raises, each row alone from the generator state it had."""
        generators = [self._generator(s.seq_id, s.params) for s in seqs]
        states = [None if g is None else g.get_state() for g in generators]
        try:
            return self._sample_rows(seqs, logits, generators)
        except Exception:                                       # noqa: BLE001 - find the rows at fault
            pass
        out: list[Sample | Failed] = []
        for b, (seq, g, state) in enumerate(zip(seqs, generators, states)):
            if g is not None:
                g.set_state(state)
            try:
                out += self._sample_rows([seq], logits[b:b + 1], [g])
            except Exception as e:                              # noqa: BLE001 - this request's failure only
                out.append(Failed(e))
        return out

    def _sample_rows(self, seqs, logits: torch.Tensor, generators) -> list[Sample]:
        result = self.sampler.sample(
            logits,                                                          # [B, V]
            [s.params for s in seqs],
            [s.output_ids for s in seqs],
            [s.prompt_ids for s in seqs],
            generators,
        )
        return [Sample(result.token_ids[b],
                       None if result.logprobs is None else result.logprobs[b],
                       None if result.top_logprobs is None else result.top_logprobs[b])
                for b in range(len(seqs))]

    def release(self, seq_id: int) -> None:
        """Forget a finished or aborted sequence's generator (its KV is the block manager's to free)."""
        self._generators.pop(seq_id, None)

    def _generator(self, seq_id: int, params) -> SeedStream | None:
        if seq_id not in self._generators:
            self._generators[seq_id] = Sampler.make_generator(params)
        return self._generators[seq_id]


def _passes(chunks) -> list[list[int]]:
    """Chunk indices grouped into forward passes: chunks of up to DECODE_ROWS tokens packed into passes of
    at most DECODE_ROWS rows, longer chunks in one pass of their own."""
    small, large = [], []
    for i, c in enumerate(chunks):
        if c.num_tokens > DECODE_ROWS:
            large.append(i)
        elif small and sum(chunks[j].num_tokens for j in small[-1]) + c.num_tokens <= DECODE_ROWS:
            small[-1].append(i)
        else:
            small.append([i])
    return small + ([large] if large else [])
