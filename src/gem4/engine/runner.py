"""Batch -> tensors -> forward -> sample. The only part of the engine that touches tensors.

The runner owns, per running sequence, its KV cache (`model.new_cache(max_chunk)`) and its sampling
generator (one `torch.Generator` per seeded request, kept for the request's lifetime so the same
seed gives the same tokens whatever else runs; see sampling.py). It reads sequences and never
changes them: the scheduler's `postprocess` does that with the ids `run` returns.

Per chunk (the model runs one sequence at a time, so a batch is a loop over its chunks):
    a prompt chunk that does not reach the end of the sequence only fills the cache: hidden states
        with `last_only=True` (KV-shared layers skip the rows nobody reads), no LM head;
    a chunk that reaches the end (the last prompt chunk, or a decode step) needs the next token:
        logits of its last row only, [1, V].
All rows that sample in one step go through the sampler together as one [B, V] batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from gem4.engine.scheduler import Batch
from gem4.kv_cache import KVCache
from gem4.sampling import Sampler


@dataclass(frozen=True)
class Sample:
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


class ModelRunner:
    def __init__(self, model, max_chunk: int):
        self.model = model
        self.max_chunk = max_chunk
        self.device = model.device
        self.sampler = Sampler()
        self._caches: dict[str, KVCache] = {}
        self._generators: dict[str, torch.Generator | None] = {}

    @torch.inference_mode()
    def run(self, batch: Batch) -> list[Sample | None]:
        """One forward step over the batch's chunks -> per chunk its sampled token (None: cache only)."""
        rows, logits = [], []                                   # chunk index, [1, V] per sampling chunk
        for i, chunk in enumerate(batch.chunks):
            seq = chunk.seq
            cache = self._cache(seq.request_id)
            if cache.length != chunk.start:
                raise RuntimeError(f"{seq.request_id}: chunk starts at {chunk.start}, cache holds {cache.length}")
            ids = torch.tensor(seq.token_ids[chunk.start:chunk.start + chunk.num_tokens],
                               dtype=torch.long, device=self.device)          # [T]
            if chunk.samples:
                logits.append(self.model.forward(ids, cache, last_only=True))  # [1, V]
                rows.append(i)
            else:
                self.model.hidden_states(ids, cache, last_only=True)       # fills the cache only
        out: list[Sample | None] = [None] * len(batch.chunks)
        if not rows:
            return out
        seqs = [batch.chunks[i].seq for i in rows]
        result = self.sampler.sample(
            torch.cat(logits),                                               # [B, V]
            [s.params for s in seqs],
            [s.output_ids for s in seqs],
            [s.prompt_ids for s in seqs],
            [self._generator(s.request_id, s.params) for s in seqs],
        )
        for b, i in enumerate(rows):
            out[i] = Sample(
                result.token_ids[b],
                None if result.logprobs is None else result.logprobs[b],
                None if result.top_logprobs is None else result.top_logprobs[b],
            )
        return out

    def release(self, request_id: str) -> None:
        """Free a finished or aborted sequence's cache and generator."""
        self._caches.pop(request_id, None)
        self._generators.pop(request_id, None)

    def _cache(self, request_id: str) -> KVCache:
        cache = self._caches.get(request_id)
        if cache is None:
            cache = self._caches[request_id] = self.model.new_cache(self.max_chunk)
        return cache

    def _generator(self, request_id: str, params) -> torch.Generator | None:
        if request_id not in self._generators:
            self._generators[request_id] = Sampler.make_generator(params)
        return self._generators[request_id]

    @property
    def num_live(self) -> int:
        return len(self._caches)
