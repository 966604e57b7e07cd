"""Batch -> tensors -> one forward -> sample. The only part of the engine that touches tensors.

The runner owns the KV pool's tensors (kv_cache.KVPool; where each sequence's K/V live is the block
manager's, read here) and, per running request, its sampling generator (one `SeedStream` per seeded
request, kept for the request's lifetime, preemptions included, so the same seed gives the same tokens
whatever else runs; see sampling.py) and its grammar matcher (constrained requests, below). It reads sequences and never changes them: the scheduler's
`postprocess` does that with the ids `run` returns.

A step runs the batch's chunks through the model with their tokens laid out one sequence after another:
each linear layer once over all rows of a forward pass, attention once per layer over all its sequences.
A chunk that reaches the end of its sequence (the last prompt chunk, a decode step) samples its next
token from its last row's logits; the other chunks only fill the cache. A fork (a zero-token chunk: a
further choice of a request, see scheduler.py) computes nothing and samples its first token from its source
chunk's logits row, with its own generator. All sampling rows go through the sampler together as one
[B, V] batch.

Speculation: a decode chunk with draft slots first gets the drafter's drafts (prompt lookup's, or the
assistant's for all such sequences in one batch: engine/mtp.py, which needs the target's final-normed
hidden state of each sampling row, so the forward then returns them too); its K+1 rows [last token, drafts]
run in the same pass as any decode chunk (K+1 <= 8 <= the model's decode_rows, the same kernels as plain decoding) with
logits for every row, and `speculative.verify` accepts drafts by exact rejection sampling with the
sequence's own generator: a `Sample` then carries the accepted drafts and one more token.

Constrained decoding (engine/grammar.py, docs/structured.md): a sequence whose params carry a grammar has one
llguidance matcher, the runner's like its generator. Its drafts are cut before the forward at the first token
the grammar rejects; after the forward, the bitmasks of every constrained row (one per sampled chunk, K + 1
per verified one) are filled in one batched call and go to the sampler as its step 0 (sampling.py), so a
request's tokens are always a prefix of a sentence of its grammar; then each matcher consumes the tokens its
sequence emitted. A grammar that fails (it does not compile, a parser limit, a row with no allowed token)
fails its chunk (`Failed`), like non-finite logits. A thought budget (`SamplingParams.thought_budget`) is applied
by the same masks, where it binds (engine/grammar.py).

Media (docs/multimodal.md §5.4): an image or audio clip of a sequence becomes soft tokens through the model's
towers once, when a prefill piece first computes one of its rows, and is kept (per sequence, like its generator)
until the sequence is released, so a preempted sequence recomputes its prompt with the same soft tokens. An item
whose rows all come from the prefix cache is never encoded (a second question about the same picture costs its
question only). The items a step needs go through the towers together: images and video frames of one patch grid
in one tower pass, audio clips of one length in one (`encode_all`). A forward pass carries the soft tokens of
its pieces' rows (`StepEmbeds`) and each sequence's bidirectional spans (`SeqStep.bidirectional`).

Copies the scheduler asks for (plain int pairs in the Batch) are done here, on the pool, before the
forward: the copy-on-write block copies (the copy must hold the shared rows before a sequence writes over
them). A copy that raises is no one request's fault: it fails the step.

Batch invariance and exact prefix-cache hits: the fast mode computes prompt tokens and generated tokens with
kernels of their own (StepLayout.prefill: a row-invariant bf16 GEMM and chunk attention for the first, the GEMV
and decode attention for the second), which round differently. So that a token's K/V and logits depend on
neither its batch mates nor how its prompt was chunked (a hit computes the rest of a prompt in other chunks than
a cold run), every position is computed by the kernels of its kind: a step's prompt rows go through one prefill
pass, its generated rows through decode passes of at most the model's `decode_rows` rows, after it. A chunk
that holds both (a preempted sequence computed again) is split at the prompt's end. A step with both kinds
costs one more pass over the weights.

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

import functools
from dataclasses import dataclass

import numpy as np
import torch

from gem4.engine.grammar import Matchers
from gem4.engine.mtp import MtpDrafter
from gem4.engine.scheduler import Batch, Chunk
from gem4.engine.speculative import verify
from gem4.kv_cache import BlockManager, KVPool, SeqStep
from gem4.model.audio import audio_input
from gem4.model.gemma4 import MediaItem, StepEmbeds
from gem4.sampling import Sampler, SeedStream
from gem4.structured import GrammarStats, GrammarVocab


# The most rows of one batched tower pass (a larger item goes alone). On the CPU backend more rows do not make a pass
# cheaper per row past ~1-2K: an E2B-sized vision tower (4 layers, Q8_0, 2 cores) took 8 frames of 594 patches in
# 3.34 s one by one, 3.29 s two at a time, 3.54 s four, 4.27 s eight. So a vision pass holds at most a 140-token
# image's patches, an audio pass 6000 log-mel frames (1500 conformer rows: two 30 s clips).
MAX_TOWER_PATCHES = 1260
MAX_TOWER_FRAMES = 6000


class NonFiniteLogits(RuntimeError):
    """The model produced NaN or infinite logits for a request; it ends with an error."""


@dataclass(frozen=True)
class Sample:
    """The tokens a chunk emits: one, or with speculation the accepted drafts and one more (`drafts`: how
    many drafts were checked). logprobs / top_logprobs: one entry per token, when the request asks."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None = None
    top_logprobs: tuple[list[tuple[int, float]], ...] | None = None
    drafts: int = 0
    grammar_seconds: float = 0.0            # its share of the step's grammar-mask apply (metrics)


@dataclass(frozen=True)
class _Rows:
    """A chunk, or a piece of one, as a forward pass sees it: its token ids from position `start`, and for a
    decode step with drafts (speculation), the drafts after its last token -- every row then needs logits, to
    verify them. `last`: the piece holds the chunk's last rows (the others need no logits)."""

    chunk: Chunk
    start: int
    ids: list[int]
    drafts: list[int]
    last: bool = True

    @property
    def prefill(self) -> bool:
        """Prompt tokens (a piece never holds both kinds: `_pieces`)."""
        return self.start < self.chunk.seq.num_prompt_tokens

    @property
    def num_logits(self) -> int:
        if not self.last:
            return 0
        return len(self.ids) if self.drafts else int(self.chunk.samples)


@dataclass(frozen=True)
class Failed:
    """This chunk's request failed in this step; `error` says why. Its cache is no longer usable."""

    error: BaseException


class ModelRunner:
    def __init__(self, model, pool: KVPool, blocks: BlockManager, drafter=None, grammar_vocab: GrammarVocab | None = None,
                 grammar_stats: GrammarStats | None = None):
        self.model = model
        self.pool = pool
        self.blocks = blocks                     # read only: the scheduler decides, the runner lays out
        self.drafter = drafter                   # proposes drafts for chunks with draft slots: prompt lookup
        self.mtp = isinstance(drafter, MtpDrafter)   # (speculative.NgramDrafter) or the assistant (mtp.py)
        self.device = model.device
        self.sampler = Sampler()
        self._generators: dict[int, SeedStream | None] = {}   # seq_id ->
        self._media: dict[int, dict[int, MediaItem]] = {}       # seq_id -> {item index: its soft tokens}, once encoded
        self.grammar_stats = grammar_stats if grammar_stats is not None else GrammarStats()
        self.matchers = Matchers(grammar_vocab, self.grammar_stats, model.config.vocab_size, torch.get_num_threads())

    @torch.inference_mode()
    def run(self, batch: Batch) -> list[Sample | Failed | None]:
        """One forward step over the batch's chunks -> per chunk its sampled token (None: cache only)
        or `Failed` (see the module docstring)."""
        chunks = batch.chunks
        self.pool.copy_blocks(batch.block_copies)
        self.pool.copy_sliding_blocks(batch.sliding_copies)
        proposed = self._drafts([c for c in chunks if c.draft_slots])     # id(chunk) -> drafts, or Failed
        for c in chunks:                # constrained: cut at the first draft the grammar (or thought budget) rejects
            if c.seq.params.masked and isinstance(proposed.get(id(c)), list):
                try:
                    proposed[id(c)] = self.matchers.cut(c.seq, proposed[id(c)])
                except Exception as e:                          # noqa: BLE001 - this request's failure only
                    proposed[id(c)] = Failed(e)
        computed = [i for i, c in enumerate(chunks) if c.num_tokens and not isinstance(proposed.get(id(c)), Failed)]
        work = tuple(_Rows(c, c.start, c.seq.token_ids[c.start:c.start + c.num_tokens] + proposed.get(id(c), []),
                           proposed.get(id(c), [])) for c in (chunks[i] for i in computed))
        try:
            done = self._forward(work)
        except Exception as e:                                  # noqa: BLE001 - find the chunks at fault
            done = [Failed(e)] if len(work) == 1 else [self._forward_alone(w) for w in work]
        drafts = {i: w.drafts for i, w in zip(computed, work) if w.drafts}
        rows: list = [None] * len(chunks)                       # logits, or Failed
        hidden: list = [None] * len(chunks)                     # the assistant's input states (mtp only)
        for i, row in zip(computed, done):
            rows[i], hidden[i] = row if isinstance(row, tuple) else (row, None)
        for i, c in enumerate(chunks):
            if c.source is not None:                            # a fork: its parent's logits
                rows[i], hidden[i] = rows[c.source], hidden[c.source]
            elif isinstance(proposed.get(id(c)), Failed):       # its drafting failed: it did not run
                rows[i] = proposed[id(c)]
        out: list[Sample | Failed | None] = [None] * len(chunks)
        chosen = []                                             # chunks that choose tokens: sampled or verified
        for i, (chunk, row) in enumerate(zip(chunks, rows)):
            if row is None or isinstance(row, Failed):
                out[i] = row
            elif not _finite(row):
                position = chunk.start + chunk.num_tokens - 1           # a fork: its source's last row
                out[i] = Failed(NonFiniteLogits(
                    f"the model produced non-finite logits (NaN or inf) at position {position}, "
                    f"choosing completion token {len(chunk.seq.output_ids) + 1}"))
            else:
                chosen.append(i)
        masks = self._masks(chunks, chosen, drafts, out)        # grammar bitmask rows per chunk (None: none)
        chosen = [i for i in chosen if out[i] is None]
        sampling = [i for i in chosen if i not in drafts]
        if sampling:
            constrained = [b for b, i in enumerate(sampling) if i in masks]          # rows with a grammar
            grammar = None if not constrained else \
                (torch.tensor(constrained, dtype=torch.long), torch.cat([masks[sampling[b]] for b in constrained]))
            for i, sample in zip(sampling, self._sample([chunks[i].seq for i in sampling],
                                                        torch.cat([rows[i] for i in sampling]), grammar)):
                out[i] = sample
        for i in chosen:
            if i in drafts:                                     # speculation: verify this sequence's drafts
                out[i] = self._verify(chunks[i].seq, rows[i], drafts[i], masks.get(i))
        self._consume(chunks, [i for i in chosen if i in masks], out)
        if self.mtp:                                            # the state each sequence drafts from next
            for chunk, sample, h in zip(chunks, out, hidden):
                if isinstance(sample, Sample) and h is not None:
                    self.drafter.remember(chunk.seq.seq_id, h[len(sample.token_ids) - 1])
        return out

    def _masks(self, chunks, chosen: list[int], drafts: dict[int, list[int]], out: list) -> dict[int, torch.Tensor]:
        """The bitmasks of the masked chunks among `chosen` (chunk index -> [1 + drafts, W]: a grammar's, a thought
        budget's where it binds), all in one batched fill (grammar.py); a chunk whose grammar fails gets its
        `Failed` in `out`."""
        constrained = [i for i in chosen if chunks[i].seq.params.masked]
        if not constrained:
            return {}
        entries = [(chunks[i].seq, None if chunks[i].source is None else chunks[chunks[i].source].seq,
                    drafts.get(i, [])) for i in constrained]
        try:
            buffer, errors, masked = self.matchers.masks(entries)
        except Exception as e:                                  # noqa: BLE001 - llguidance refused the whole call:
            buffer, errors, masked = None, [e] * len(entries), [False] * len(entries)   # those chunks fail
        masks, first = {}, 0
        for i, (_, _, d), error, has_mask in zip(constrained, entries, errors, masked):
            if error is not None:
                out[i] = Failed(error)
            elif has_mask:
                masks[i] = buffer[first:first + 1 + len(d)]
            first += 1 + len(d)
        return masks

    def _consume(self, chunks, constrained: list[int], out: list) -> None:
        """Feed each constrained chunk's matcher the tokens it emitted; a token its grammar rejects fails it."""
        done = [i for i in constrained if isinstance(out[i], Sample)]
        errors = self.matchers.consume([chunks[i].seq for i in done], [out[i].token_ids for i in done])
        for i, error in zip(done, errors):
            if error is not None:
                out[i] = Failed(error)
        if done:
            self.grammar_stats.apply.observe(sum(o.grammar_seconds for o in out if isinstance(o, Sample)))

    def _drafts(self, chunks: list[Chunk]) -> dict[int, list[int] | Failed]:
        """id(chunk) -> the drafter's drafts for each chunk with draft slots (as many as it proposes, up to
        the slots: prompt lookup may find none, and the step is then a plain decode step). The assistant
        drafts for every sequence in one batch; if that raises, each sequence drafts alone, and one whose
        drafting fails alone fails (`Failed`), as a forward would."""
        if not chunks:
            return {}
        if not self.mtp:
            return {id(c): self.drafter.propose(c.seq.token_ids, c.draft_slots) for c in chunks}
        try:
            return dict(zip(map(id, chunks), self.drafter.draft(chunks)))
        except Exception:                                       # noqa: BLE001 - find the sequences at fault
            pass
        out: dict[int, list[int] | Failed] = {}
        for c in chunks:
            try:
                out[id(c)] = self.drafter.draft([c])[0]
            except Exception as e:                              # noqa: BLE001 - this request's failure only
                out[id(c)] = Failed(e)
        return out

    def _forward(self, work: tuple[_Rows, ...]) -> list:
        """The chunks through the model (in passes by kind, see the module docstring) -> per chunk the logits of
        its `num_logits` last rows [n, V] (with the assistant: (logits, final-normed hidden states [n, H])), or
        None."""
        self._encode_media([w for w in work if w.prefill])
        pieces = [(i, p) for i, w in enumerate(work) for p in _pieces(w, self.model.decode_rows)]
        out: list = [None] * len(work)
        for group in _passes([(i, p.prefill, len(p.ids)) for i, p in pieces], self.model.decode_rows):
            for j, result in zip(group, self._forward_pass([pieces[j][1] for j in group])):
                if pieces[j][1].last:
                    out[pieces[j][0]] = result
        return out

    def _forward_pass(self, work: list[_Rows]) -> list:
        """One forward pass over the pieces (all of one kind) -> per piece what `_forward` returns for its chunk."""
        steps, ids, soft = [], [], []
        for w in work:
            seq = w.chunk.seq
            steps.append(SeqStep(w.start, len(w.ids), self.blocks.table(seq.seq_id),
                                 self.blocks.sliding_table(seq.seq_id), logits=w.num_logits, bidirectional=seq.spans))
            if seq.media and w.prefill:
                soft.append(StepEmbeds.of(list(self._media.get(seq.seq_id, {}).values()), w.start, len(w.ids),
                                          row=len(ids)))
            ids += w.ids
        ids_t, sizes = torch.tensor(ids, dtype=torch.long, device=self.device), [w.num_logits for w in work]
        layout = self.pool.layout(steps, prefill=work[0].prefill)
        media = StepEmbeds.join(soft)
        extra = {} if media is None else {"media": media}       # a model without towers needs not take it
        if self.mtp:
            logits, h = self.model.forward(ids_t, layout, self.pool, hidden=True, **extra)   # [M, V], [M, H]
            parts = zip(logits.split(sizes), h.split(sizes))
        else:
            parts = self.model.forward(ids_t, layout, self.pool, **extra).split(sizes)      # [M, V]
        return [part if w.num_logits else None for w, part in zip(work, parts)]

    def _encode_media(self, work) -> None:
        """The soft tokens of every media item the prefill pieces `work` compute a row of and that is not encoded
        yet, all through the towers together (`encode_all`: the images and frames of one patch grid in one tower
        pass, whichever request they belong to), kept until their sequence is released."""
        todo = {}                                       # (seq_id, item index) -> (seq, item)
        for w in work:
            seq, end = w.chunk.seq, w.start + len(w.ids)
            done = self._media.get(seq.seq_id, {})
            for i, m in enumerate(seq.media):
                if i not in done and m.start < end and w.start < m.end:
                    todo[seq.seq_id, i] = (seq, m)
        if not todo:
            return
        for ((seq_id, i), (_, m)), soft in zip(todo.items(), encode_all(self.model, [m for _, m in todo.values()])):
            self._media.setdefault(seq_id, {})[i] = MediaItem(m.start, soft, m.bidirectional)

    def _forward_alone(self, work: _Rows):
        try:
            return self._forward((work,))[0]
        except Exception as e:                                  # noqa: BLE001 - this request's failure only
            return Failed(e)

    def _verify(self, seq, logits: torch.Tensor, drafts: list[int], grammar: torch.Tensor | None) -> Sample | Failed:
        """The accepted drafts and one more token, by exact rejection sampling (speculative.verify) with the
        sequence's own generator; `grammar`: a constrained sequence's K + 1 bitmask rows."""
        try:
            v = verify(logits, drafts, seq.params, seq.output_ids, seq.prompt_ids,
                       self._generator(seq.seq_id, seq.params), grammar=grammar)
        except Exception as e:                                  # noqa: BLE001 - this request's failure only
            return Failed(e)
        return Sample(tuple(v.tokens), None if v.logprobs is None else tuple(v.logprobs),
                      None if v.top_logprobs is None else tuple(v.top_logprobs), drafts=len(drafts),
                      grammar_seconds=v.grammar_seconds)

    def _sample(self, seqs, logits: torch.Tensor, grammar=None) -> list[Sample | Failed]:
        """All sampling rows together; if that raises, each row alone from the generator state it had.
        grammar: (constrained rows [R], their bitmasks [R, W]), None when no row is constrained."""
        generators = [self._generator(s.seq_id, s.params) for s in seqs]
        states = [None if g is None else g.get_state() for g in generators]
        try:
            return self._sample_rows(seqs, logits, generators, grammar)
        except Exception:                                       # noqa: BLE001 - find the rows at fault
            pass
        out: list[Sample | Failed] = []
        for b, (seq, g, state) in enumerate(zip(seqs, generators, states)):
            if g is not None:
                g.set_state(state)
            try:
                out += self._sample_rows([seq], logits[b:b + 1], [g], _row_grammar(grammar, b))
            except Exception as e:                              # noqa: BLE001 - this request's failure only
                out.append(Failed(e))
        return out

    def _sample_rows(self, seqs, logits: torch.Tensor, generators, grammar) -> list[Sample]:
        result = self.sampler.sample(
            logits,                                                          # [B, V]
            [s.params for s in seqs],
            [s.output_ids for s in seqs],
            [s.prompt_ids for s in seqs],
            generators,
            grammar,                                                         # ([R], [R, W]) or None
        )
        share = result.grammar_seconds / len(seqs)                          # the apply's time, per row
        return [Sample((result.token_ids[b],),
                       None if result.logprobs is None else (result.logprobs[b],),
                       None if result.top_logprobs is None else (result.top_logprobs[b],),
                       grammar_seconds=share)
                for b in range(len(seqs))]

    def release(self, seq_id: int) -> None:
        """Forget a finished or aborted sequence's generator, grammar matcher and drafting state (its KV is
        the block manager's to free)."""
        self._generators.pop(seq_id, None)
        self._media.pop(seq_id, None)
        self.matchers.release(seq_id)
        if self.mtp:
            self.drafter.forget(seq_id)

    def _generator(self, seq_id: int, params) -> SeedStream | None:
        if seq_id not in self._generators:
            self._generators[seq_id] = Sampler.make_generator(params)
        return self._generators[seq_id]


def encode_all(model, items) -> list[torch.Tensor]:
    """MediaInputs (engine/sequence.py) -> their soft tokens [num_tokens, H] through the model's tower for each kind.

    Images and video frames (a frame is an image to the tower) on one patch grid go through the vision tower
    together, in passes of at most MAX_TOWER_PATCHES patches (an image larger than that alone); audio clips whose
    inputs have one shape (log-mel frames: clips of one length, to 10 ms) through the audio tower together, in
    passes of at most MAX_TOWER_FRAMES frames. Each item gets the same floats as alone (VisionModel.encode,
    AudioModel), and a video's frames or several requests' pictures of one size cost one pass."""
    out: list[torch.Tensor | None] = [None] * len(items)
    groups: dict[tuple, list[int]] = {}              # (tower, the shape its input has) -> items
    inputs: dict[int, np.ndarray] = {}               # audio: what the tower reads of each clip
    for i, item in enumerate(items):
        if item.kind in ("image", "video"):
            p = item.data
            groups.setdefault(("vision", p.grid, p.positions.tobytes()), []).append(i)
        elif item.kind == "audio":
            inputs[i] = audio_input(model.audio, item.data)
            groups.setdefault(("audio", inputs[i].shape), []).append(i)
        else:
            raise ValueError(f"no tower for media of kind {item.kind!r}")
    for key, members in groups.items():
        if key[0] == "vision":
            first = items[members[0]].data
            tower = functools.partial(model.vision.encode, positions=first.positions, grid=first.grid)
            rows, limit, data = first.patches.shape[0], MAX_TOWER_PATCHES, lambda i: items[i].data.patches
        else:
            tower, rows, limit, data = model.audio, key[1][0], MAX_TOWER_FRAMES, inputs.__getitem__
        per_pass = max(1, limit // rows)
        for at in range(0, len(members), per_pass):
            part = members[at:at + per_pass]
            for i, soft in zip(part, tower(torch.from_numpy(np.stack([data(i) for i in part])))):   # [B, n, ...]
                out[i] = soft
    for item, soft in zip(items, out):
        if soft.shape[0] != item.num_tokens:
            raise RuntimeError(f"the {item.kind} at position {item.start} gave {soft.shape[0]} soft tokens, its "
                               f"prompt has {item.num_tokens} placeholders")
    return out


def _row_grammar(grammar, b: int):
    """Row b's part of a batch's (rows, bitmasks), as a batch of its own (None: row b is not constrained)."""
    if grammar is None:
        return None
    hits = (grammar[0] == b).nonzero().flatten().tolist()
    return (torch.zeros(1, dtype=torch.long), grammar[1][hits[0]:hits[0] + 1]) if hits else None


def _finite(logits: torch.Tensor) -> bool:
    """Every value of logits [n, V] finite: their sum is (NaN and inf carry into it), or, only when it is not, every
    value one by one (finite logits overflow a float32 sum only beyond ~1e33 each). The sum is ~15x faster."""
    return bool(torch.isfinite(logits.sum())) or bool(torch.isfinite(logits).all())


def _pieces(work: _Rows, decode_rows: int) -> list[_Rows]:
    """A chunk's rows by kind: its prompt tokens, then its generated ones in pieces of at most decode_rows rows
    (a decode step is one piece; a preempted sequence computed again may hold many generated tokens)."""
    prompt_end = work.chunk.seq.num_prompt_tokens
    end = work.start + len(work.ids)
    if end <= prompt_end or work.start >= prompt_end and len(work.ids) <= decode_rows:
        return [work]
    cuts = [work.start] + ([prompt_end] if work.start < prompt_end else []) \
        + list(range(max(work.start, prompt_end) + decode_rows, end, decode_rows)) + [end]
    return [_Rows(work.chunk, a, work.ids[a - work.start:b - work.start], work.drafts if b == end else [], b == end)
            for a, b in zip(cuts, cuts[1:])]


def _passes(pieces: list[tuple[int, bool, int]], decode_rows: int) -> list[list[int]]:
    """Pieces (chunk index, prefill, rows) grouped into forward passes, in the order they run: every prefill
    piece in one pass, then the decode pieces packed into passes of at most decode_rows rows, each after the
    pass of its chunk's previous piece."""
    prefill = [j for j, (_, is_prefill, _) in enumerate(pieces) if is_prefill]
    passes: list[list[int]] = [prefill] if prefill else []
    rows: list[int] = [0] * len(passes)                     # decode rows of each pass (the prefill pass: none)
    after: dict[int, int] = {pieces[j][0]: 0 for j in prefill}   # chunk -> the pass its next piece must follow
    for j, (chunk, is_prefill, n) in enumerate(pieces):
        if is_prefill:
            continue
        first = after.get(chunk, -1) + 1
        k = next((k for k in range(first, len(passes)) if not (prefill and k == 0) and rows[k] + n <= decode_rows),
                 None)
        if k is None:
            passes.append([])
            rows.append(0)
            k = len(passes) - 1
        passes[k].append(j)
        rows[k] += n
        after[chunk] = k
    return passes
