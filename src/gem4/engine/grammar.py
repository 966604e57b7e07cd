"""Constrained decoding in the engine: one llguidance matcher per sequence and the step's grammar bitmasks.

The runner (runner.py) owns a `Matchers` and calls it at three points of a step:

1. `cut` (before the forward, speculation only): a constrained sequence's drafts are cut at the first one
   its grammar rejects (`LLMatcher.validate_tokens`), and before an end-of-generation draft (the row after
   an end would allow nothing), so rejected drafts never cost forward rows.
2. `masks` (after the forward, the cores are free): the bitmasks of every masked sampling row, one per
   plain row and K + 1 per verified row (the grammar's state after d_1 .. d_j, llguidance advancing through
   the drafts and rolling back), filled by ONE batched llguidance call per kind (`LLExecutor`, the engine's
   thread count; llguidance's draft call takes only non-empty draft lists, hence two calls when a step holds
   both kinds) into a buffer [rows, ceil(V / 32)] int32 kept across steps. The runner hands the sampler the
   constrained rows' masks only; the mask is step 0 of the sampler (sampling.py).
3. `consume` (after sampling): each matcher is fed the tokens its sequence emitted (the accepted drafts and
   the final token): never a rejected draft, so no rollback is ever needed.

A sequence's matcher is made on first use: a copy of its grammar's compile (structured/vocab.py keeps one per
grammar), or for a fork (a further choice of `n`, forked at its parent's first sample) a `deep_copy` of its
parent's before either has consumed a token, so every choice starts from the same state and goes its own way.
A preempted sequence keeps its matcher: its generated tokens survive the recomputation, and so does the state
they led to. `release` drops it (finish, abort, failure).

A thought budget (`SamplingParams.thought_budget`, structured/spec.py) is applied by the same masks, with or
without a grammar: a row where the budget forces the thought to close allows only its closing token, a row
after the budget is spent allows anything but the opening token, each ANDed with the grammar's row if there is
one. Where that would leave nothing (a grammar in the middle of the thought's name, `thought`, cannot close it
yet), the grammar's row stands and the budget binds again on the next row: the output is always a sentence of
the grammar. The budget's state after a sequence's generated ids is kept per sequence and advanced by the new
ids each step, and row j of a verified entry steps it through d_1 .. d_j, so speculative decoding stays exact
as with a grammar; `cut` cuts drafts the budget rejects too. A step whose budgeted rows are all free masks
nothing for them: a budget costs a mask only where it binds.

Errors stay with their request (`MatcherError`, which the runner returns as that chunk's `Failed`): a grammar
that does not compile, a matcher in an error state (llguidance's parser limits, vocab.py: a grammar whose
step exceeds them fails instead of stalling the engine thread), a row whose grammar allows no token at all,
a token the grammar rejects.
"""
from __future__ import annotations

import time
from collections.abc import Sequence as Seq

import numpy as np
import torch

from gem4.engine.sequence import Sequence
from gem4.structured import Budget, GrammarStats, GrammarVocab, MatcherError, ThoughtBudget


class Matchers:
    """Per-sequence matchers (seq_id -> LLMatcher) and the grammar bitmask buffer of a ModelRunner."""

    def __init__(self, vocab: GrammarVocab | None, stats: GrammarStats, vocab_size: int, threads: int):
        self.vocab = vocab
        self.stats = stats
        self.words = (vocab_size + 31) // 32        # int32 words per bitmask row
        self.threads = threads
        self._matchers: dict[int, object] = {}
        self._thoughts: dict[int, tuple[int, tuple[bool, int]]] = {}   # seq_id -> (ids seen, budget state)
        self._buffer = torch.empty(0, self.words, dtype=torch.int32)
        self._executor = None

    def __len__(self) -> int:
        """Sequences holding a matcher or a thought budget's state."""
        return len(self._matchers.keys() | self._thoughts.keys())

    def get(self, seq: Sequence, source: Sequence | None = None):
        """The sequence's matcher (None: it is not constrained), made on first use; a fork's (`source`: the
        sequence it was forked off) copies its source's. Raises MatcherError."""
        spec = seq.params.structured
        if spec is None:
            return None
        matcher = self._matchers.get(seq.seq_id)
        if matcher is None:
            if self.vocab is None:
                raise MatcherError("this engine has no grammar vocabulary (Engine(structured=False) or no tokenizer)")
            matcher = self.get(source).deep_copy() if source is not None else self.vocab.matcher(spec, self.stats.compile)
            self._matchers[seq.seq_id] = matcher
        return matcher

    def release(self, seq_id: int) -> None:
        self._matchers.pop(seq_id, None)
        self._thoughts.pop(seq_id, None)

    def cut(self, seq: Sequence, drafts: list[int]) -> list[int]:
        """The drafts up to the first one the sequence's grammar or thought budget rejects, and before any
        end-of-generation id. Raises MatcherError."""
        if not drafts:
            return drafts
        budget = seq.params.thought_budget
        if budget is not None:
            rules = self._budget_rules(seq, drafts)
            drafts = drafts[:next((j for j, (rule, d) in enumerate(zip(rules, drafts)) if not _allows(
                rule, budget, d)), len(drafts))]
        matcher = self.get(seq)
        if matcher is None or not drafts:
            return drafts
        n = matcher.validate_tokens(drafts)
        ends = [j for j, d in enumerate(drafts[:n]) if d in self.vocab.eos_ids]
        return drafts[:ends[0] if ends else n]

    def _budget_rules(self, seq: Sequence, drafts: list[int]) -> list[Budget]:
        """The thought budget's rule for each of the sequence's 1 + len(drafts) rows (row j: after d_1 .. d_j)."""
        budget = seq.params.thought_budget
        seen, state = self._thoughts.get(seq.seq_id, (0, budget.start()))
        if seen < len(seq.output_ids):              # the ids generated since the last step (all, after a fork)
            state = budget.advance(state, seq.output_ids[seen:])
            self._thoughts[seq.seq_id] = (len(seq.output_ids), state)
        rules = [budget.rule(state)]
        for d in drafts:
            state = budget.advance(state, (d,))
            rules.append(budget.rule(state))
        return rules

    def masks(self, rows: Seq[tuple[Sequence, Sequence | None, list[int]]]
              ) -> tuple[torch.Tensor | None, list[MatcherError | None], list[bool]]:
        """Bitmasks for a step's sampling rows: per entry (sequence, the sequence it forks off or None, its
        drafts), 1 + len(drafts) rows, in order. -> ([rows, W] int32, all -1 in an unmasked entry's rows; None
        when no entry is masked), per entry the MatcherError that fails it (or None), per entry whether its rows
        are masked (a grammar; a thought budget where it binds). The tensor is a view of the kept buffer: valid
        until the next call."""
        errors: list[MatcherError | None] = [None] * len(rows)
        plain, drafted, spans = [], [], []               # (matcher, row[, drafts]); (entry, first row, n rows)
        bound: list[tuple[int, Budget, ThoughtBudget]] = []   # (row, rule, budget): the rows a budget binds
        total = 0
        for e, (seq, source, drafts) in enumerate(rows):
            try:
                matcher = self.get(seq, source)
            except MatcherError as err:
                errors[e] = err
                matcher = None
            budget = seq.params.thought_budget if errors[e] is None else None
            binds = [] if budget is None else [(total + j, rule, budget) for j, rule in
                                               enumerate(self._budget_rules(seq, drafts)) if rule != Budget.FREE]
            if matcher is not None:
                (drafted.append((matcher, total, drafts)) if drafts else plain.append((matcher, total)))
            if matcher is not None or binds:
                spans.append((e, total, 1 + len(drafts)))
                bound += binds
            total += 1 + len(drafts)
        masked = [False] * len(rows)
        for e, _, _ in spans:
            masked[e] = True
        if not spans:
            return None, errors, masked
        if self._buffer.shape[0] < total:
            self._buffer = torch.empty(total, self.words, dtype=torch.int32)
        buffer = self._buffer[:total]
        buffer.fill_(-1)
        if plain or drafted:
            if self._executor is None:
                import llguidance

                self._executor = llguidance.LLExecutor(self.threads)
            start = time.perf_counter()
            pointer, row_bytes = buffer.data_ptr(), 4 * self.words
            if plain:
                self._executor.unsafe_compute_mask_ptr(plain, pointer, row_bytes, total)
            if drafted:
                self._executor.unsafe_compute_mask_ptr_with_draft_token(drafted, pointer, row_bytes, total)
            self.stats.mask.observe(time.perf_counter() - start)
        # numpy: torch's reduction over [8, 8192] ints hands work to its threads, ~10x the cost here
        words = buffer.numpy()
        for row, rule, budget in bound:
            if rule == Budget.CLOSE:                      # only <channel|> ...
                w, bit = _bit(budget.close_id)
                if words[row, w] & bit:                   # ... where the grammar allows it (else the grammar's row)
                    words[row] = 0
                    words[row, w] = bit
            else:                                         # anything but <|channel> (unless the grammar wants it)
                w, bit = _bit(budget.open_id)
                if (words[row, w] & ~bit) or words[row, :w].any() or words[row, w + 1:].any():
                    words[row, w] &= ~bit
        allows = words.any(axis=1).tolist()               # a row with no allowed token cannot be sampled
        for e, first, n in spans:
            seq = rows[e][0]
            matcher = self._matchers.get(seq.seq_id)
            if matcher is None:                           # a budget alone: its rows always allow a token
                continue
            if matcher.is_error():
                errors[e] = MatcherError(f"the grammar failed after {len(seq.output_ids)} generated tokens: "
                                         f"{matcher.get_error()}")
            elif not all(allows[first:first + n]):
                errors[e] = MatcherError(f"the grammar allows no token after {len(seq.output_ids)} generated "
                                         f"tokens (none of the model's vocabulary can continue it)")
        return buffer, errors, masked

    def consume(self, seqs: Seq[Sequence], tokens: Seq[Seq[int]]) -> list[MatcherError | None]:
        """Feed each constrained sequence the tokens it emitted this step; -> per sequence the MatcherError of a
        token its grammar rejected, or None. One call per sequence in this thread: a consume is ~1 us of work,
        and llguidance's parallel `consume_token_par` costs more than that in hand-offs to its threads."""
        errors: list[MatcherError | None] = [None] * len(seqs)
        for b, (seq, emitted) in enumerate(zip(seqs, tokens)):
            matcher = self._matchers.get(seq.seq_id) if seq.params.structured is not None else None
            # one token: consume_token (llguidance 1.9.1's consume_tokens refuses a lone end id on a matcher
            # whose grammar is complete, which consume_token takes)
            ok = matcher is None or (matcher.consume_token(emitted[0]) if len(emitted) == 1
                                     else matcher.consume_tokens(list(emitted)))
            if not ok:
                errors[b] = MatcherError(f"the grammar rejected a token of {list(emitted)} after "
                                         f"{len(seq.output_ids)} generated tokens: {matcher.get_error()}")
        return errors


def _bit(token_id: int) -> tuple[int, np.int32]:
    """(word, bit) of a token in a bitmask row: bit t % 32 of int32 word t // 32."""
    return token_id // 32, np.array(1 << (token_id % 32), dtype=np.uint32).view(np.int32)


def _allows(rule: Budget, budget: ThoughtBudget, token_id: int) -> bool:
    """Whether a thought budget's `rule` allows `token_id`."""
    if rule == Budget.CLOSE:
        return token_id == budget.close_id
    return rule == Budget.FREE or token_id != budget.open_id
