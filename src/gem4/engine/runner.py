"""Batch -> tensors -> forward -> sample. The only part of the engine that touches tensors.

The runner owns, per running sequence, its KV cache (`model.new_cache(max_chunk)`) and its sampling
generator (one `SeedStream` per seeded request, kept for the request's lifetime so the same
seed gives the same tokens whatever else runs; see sampling.py). It reads sequences and never
changes them: the scheduler's `postprocess` does that with the ids `run` returns.

Per chunk (the model runs one sequence at a time, so a batch is a loop over its chunks):
    a prompt chunk that does not reach the end of the sequence only fills the cache: hidden states
        with `last_only=True` (KV-shared layers skip the rows nobody reads), no LM head;
    a chunk that reaches the end (the last prompt chunk, or a decode step) needs the next token:
        logits of its last row only, [1, V].
All rows that sample in one step go through the sampler together as one [B, V] batch.

Failures stay with the request they concern: `run` returns, per chunk, a `Sample`, None (cache only) or a
`Failed` holding the exception, and never raises for one request's fault:
    - a forward pass that raises fails its own chunk only (each sequence has its own forward and cache);
    - logits that are not all finite (NaN/inf: a broken checkpoint, an overflow) fail their row with
      `NonFiniteLogits` before the sampler sees them, so no request is ever given a token drawn from them;
    - a batched sampler call that raises is replayed row by row, each seeded row from the SeedStream state
      it had before the batch, so only the rows that raise alone fail and the seeded others get exactly the
      tokens they get alone (unseeded rows draw afresh from torch's global generator).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from gem4.engine.scheduler import Batch
from gem4.kv_cache import KVCache
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
    def __init__(self, model, max_chunk: int):
        self.model = model
        self.max_chunk = max_chunk
        self.device = model.device
        self.sampler = Sampler()
        self._caches: dict[str, KVCache] = {}
        self._generators: dict[str, SeedStream | None] = {}

    @torch.inference_mode()
    def run(self, batch: Batch) -> list[Sample | Failed | None]:
        """One forward step over the batch's chunks -> per chunk its sampled token (None: cache only)
        or `Failed` (see the module docstring)."""
        out: list[Sample | Failed | None] = [None] * len(batch.chunks)
        rows, logits = [], []                                   # chunk index, [1, V] per sampling chunk
        for i, chunk in enumerate(batch.chunks):
            try:
                row = self._forward(chunk)
            except Exception as e:                              # noqa: BLE001 - this request's failure only
                out[i] = Failed(e)
                continue
            if row is not None:
                logits.append(row)
                rows.append(i)
        if rows:
            for i, sample in zip(rows, self._sample([batch.chunks[i].seq for i in rows], torch.cat(logits))):
                out[i] = sample
        return out

    def _forward(self, chunk) -> torch.Tensor | None:
        """The chunk through the model: its last row's logits [1, V] if it samples, else None."""
        seq = chunk.seq
        cache = self._cache(seq.request_id)
        if cache.length != chunk.start:
            raise RuntimeError(f"{seq.request_id}: chunk starts at {chunk.start}, cache holds {cache.length}")
        ids = torch.tensor(seq.token_ids[chunk.start:chunk.start + chunk.num_tokens],
                           dtype=torch.long, device=self.device)              # [T]
        if not chunk.samples:
            self.model.hidden_states(ids, cache, last_only=True)           # fills the cache only
            return None
        logits = self.model.forward(ids, cache, last_only=True)            # [1, V]
        if not bool(torch.isfinite(logits).all()):
            position = chunk.start + chunk.num_tokens - 1
            raise NonFiniteLogits(f"the model produced non-finite logits (NaN or inf) at position {position}, "
                                  f"choosing completion token {len(seq.output_ids) + 1}")
        return logits

    def _sample(self, seqs, logits: torch.Tensor) -> list[Sample | Failed]:
        """All sampling rows together; if that raises, each row alone from the generator state it had."""
        generators = [self._generator(s.request_id, s.params) for s in seqs]
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

    def release(self, request_id: str) -> None:
        """Free a finished or aborted sequence's cache and generator."""
        self._caches.pop(request_id, None)
        self._generators.pop(request_id, None)

    def _cache(self, request_id: str) -> KVCache:
        cache = self._caches.get(request_id)
        if cache is None:
            cache = self._caches[request_id] = self.model.new_cache(self.max_chunk)
        return cache

    def _generator(self, request_id: str, params) -> SeedStream | None:
        if request_id not in self._generators:
            self._generators[request_id] = Sampler.make_generator(params)
        return self._generators[request_id]

    @property
    def num_live(self) -> int:
        return len(self._caches)
