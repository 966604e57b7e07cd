"""Speculative decoding, the pure parts: prompt-lookup drafts and the acceptance maths.

No tensors of the model, no cache, no engine state: plain token ids in, token ids out, so the scheduler
and runner can call these per sequence. The assistant (MTP) drafter is model/assistant.py.

Prompt lookup (`NgramDrafter`, vLLM's `ngram` method). For n from `prompt_lookup_max` down to
`prompt_lookup_min`: take the sequence's last n tokens and look for the EARLIEST earlier occurrence of
them (an occurrence that ends before the last token, so never the suffix itself); the first n that has one
wins and the drafts are up to `num_speculative_tokens` tokens that followed it (fewer when the sequence
ends sooner). No match, or fewer than prompt_lookup_min tokens: no drafts. vLLM's defaults: both bounds 5
when neither is given, one given sets the other; 1 <= min <= max.

Verification (`verify`): the target scored the K + 1 rows [last token, d_1 .. d_K] in one forward; row j
gives the distribution of the token after d_j (row 0: after the last token). Every row goes through
gem4.sampling's pipeline with the history it would have had in plain decoding (row j's penalties see
the generated tokens plus d_1 .. d_j), so p_j is exactly the distribution plain sampling would draw from:

- A deterministic drafter (prompt lookup; the assistant, which drafts greedily as transformers and
  llama.cpp do) is q = one-hot(d_j). Exact rejection sampling then accepts d_j with probability p_j(d_j)
  and on rejection draws from p_j without d_j, renormalised -- which is precisely "draw x ~ p_j with the
  plain sampler; accept while x == d_j; the first x != d_j is the output token". That is what runs: each
  row is sampled with `gem4.sampling.sample` and its one uniform, until the first mismatch or the bonus
  row K. Greedy rows (temperature < 1e-5) reduce to the longest prefix of drafts equal to the target's
  argmax, then the target's argmax.
- A sampling drafter gives its probabilities q_j (`draft_probs`, the distribution each d_j was drawn
  from, after the drafter's own transforms). Standard rejection sampling (Leviathan et al., Chen et al.):
  accept d_j when u * q_j(d_j) < p_j(d_j), i.e. with probability min(1, p/q); on the first rejection draw
  from normalise(max(0, p_j - q_j)); with all K accepted, draw the bonus token from p_K.
Either way the returned tokens are distributed exactly as plain sampling's (tests/test_speculative.py
checks it with a chi-square test against a deliberately bad drafter).

Seeds and draws. A request's generator (SeedStream / torch.Generator / None, as `Sampler.make_generator`)
is shared with plain decoding and consumed in order:
- deterministic drafter: one uniform per emitted token, in the same order as plain decoding, and the same
  inverse-CDF draw; a seeded request therefore gives the same text with and without speculation (up to
  float rounding: the verification forward and single-token decode steps may differ in the last bits,
  which moves a draw only when u falls within that rounding of a CDF boundary). Greedy rows draw nothing.
- sampling drafter: one uniform per checked draft plus one for the final token (residual or bonus):
  reproducible for a seed, the same distribution, not the same text as plain decoding.

Grammars (constrained decoding): the runner cuts a constrained sequence's drafts at the first one its
grammar rejects before the forward, and hands `verify` one bitmask per row, row j's being the grammar's
state after d_1 .. d_j; each row's sampling applies it as step 0, exactly as plain constrained decoding
would at that position, so the acceptance above stays exact and the emitted tokens (accepted drafts, which
the grammar allows, and a final token drawn from a masked row) always continue the grammar.

Logprobs are those plain sampling reports: the log-softmax of each emitted row's adjusted logits (bias
and penalties, before filters and temperature), with the row's own history.

What the caller does with the result: append `tokens` (the accepted drafts and one more), stop at the
first stop token or max_tokens inside them (drop the rest), keep the cache of the accepted rows only
(the target's K/V of positions past the last accepted draft are rolled back), and for the assistant take
the target's hidden state of row `num_accepted` (the row that predicted the final token).
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from gem4.sampling import (
    Generator, Sampler, SamplingParams, adjust_logits, draw_from, draw_uniform, filter_logits, gather_logprobs,
    greedy_within_grammar, probabilities, sample, top_list,
)

DEFAULT_PROMPT_LOOKUP = 5          # vLLM's prompt_lookup_min / max when neither is given
_ROW0 = torch.zeros(1, dtype=torch.long)   # a verification row is sampled alone: its grammar mask is row 0's


# ---- prompt lookup ----

@dataclass(frozen=True)
class NgramDrafter:
    """Prompt-lookup drafts (see the module docstring): vLLM's `ngram` method and its three fields."""

    num_speculative_tokens: int                 # K, the most drafts per step
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP

    def __post_init__(self) -> None:
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min={self.prompt_lookup_min} must be <= "
                             f"prompt_lookup_max={self.prompt_lookup_max}")

    @classmethod
    def from_config(cls, num_speculative_tokens: int, prompt_lookup_max: int | None = None,
                    prompt_lookup_min: int | None = None) -> "NgramDrafter":
        """vLLM's defaulting: neither bound -> both 5; one bound -> the other equals it."""
        if prompt_lookup_max is None and prompt_lookup_min is None:
            prompt_lookup_max = prompt_lookup_min = DEFAULT_PROMPT_LOOKUP
        elif prompt_lookup_min is None:
            prompt_lookup_min = prompt_lookup_max
        elif prompt_lookup_max is None:
            prompt_lookup_max = prompt_lookup_min
        return cls(num_speculative_tokens, prompt_lookup_max, prompt_lookup_min)

    def propose(self, tokens: Sequence[int], max_drafts: int | None = None) -> list[int]:
        """tokens: the sequence so far (prompt + generated). -> up to min(K, max_drafts) drafts ([] if none).
        `max_drafts`: the caller's own cap (tokens left before max_tokens or the context end)."""
        k = self.num_speculative_tokens if max_drafts is None else min(self.num_speculative_tokens, max_drafts)
        n_tokens = len(tokens)
        if k <= 0 or n_tokens < self.prompt_lookup_min + 1:
            return []
        arr = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.prompt_lookup_max, n_tokens - 1), self.prompt_lookup_min - 1, -1):
            suffix = arr[-n:]
            # windows starting at 0 .. n_tokens - n - 1: every n-gram that ends before the last token
            windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)           # [n_tokens - n, n]
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                start = int(hits[0]) + n                                              # earliest occurrence
                return arr[start:start + k].tolist()
        return []


# ---- verification ----

@dataclass(frozen=True)
class Verdict:
    """The tokens a verification step emits: the accepted drafts, then one token from the target."""

    tokens: list[int]                               # num_accepted drafts + 1
    num_accepted: int
    logprobs: list[float] | None = None             # per emitted token, when the request asked for logprobs
    top_logprobs: list[list[tuple[int, float]]] | None = None
    grammar_seconds: float = 0.0                    # time the grammar masks took to apply (0 without one)


def verify(
    logits: torch.Tensor,
    drafts: Sequence[int],
    params: SamplingParams,
    generated: Sequence[int],
    prompt: Sequence[int] | None = None,
    generator: Generator = None,
    draft_probs: torch.Tensor | None = None,
    grammar: torch.Tensor | None = None,
) -> Verdict:
    """Exact acceptance for one sequence (module docstring).

    logits [K + 1, V] float32: the target's rows for [last token, d_1 .. d_K]; drafts: the K draft ids;
    params / generated / prompt / generator: as `Sampler.sample` takes them for this sequence (generated:
    its tokens before this step); draft_probs [K, V]: the distributions a sampling drafter drew d_j from,
    None for a deterministic drafter (prompt lookup, the greedy assistant); grammar [K + 1, W]: a constrained
    sequence's bitmask for each row (row j: the grammar's state after d_1 .. d_j), which is step 0 of row
    j's sampling exactly as in plain constrained decoding, so acceptance stays exact.
    """
    k = len(drafts)
    if logits.dim() != 2 or logits.shape[0] != k + 1:
        raise ValueError(f"verify: {k} drafts need {k + 1} logits rows, got shape {tuple(logits.shape)}")
    vocab = logits.shape[1]
    if any(not 0 <= d < vocab for d in drafts):
        raise ValueError(f"verify: draft ids must be in [0, {vocab})")
    if draft_probs is not None and tuple(draft_probs.shape) != (k, vocab):
        raise ValueError(f"verify: draft_probs must be [{k}, {vocab}], got {tuple(draft_probs.shape)}")
    drafts = list(drafts)
    reject_with_q = draft_probs is not None and not params.greedy
    tokens: list[int] = []
    adjusted_rows = []
    grammar_seconds = 0.0
    # Row by row, only as far as acceptance goes: each row costs what one plain sampling step costs (the
    # filters sort the whole vocabulary), and rows after the first rejection are never looked at.
    # a greedy row without logprobs checks its argmax against the grammar first, as Sampler.sample does
    check_first = grammar is not None and params.greedy and not params.logprobs
    for j in range(k + 1):
        t = Sampler.tensors([params], [list(generated) + drafts[:j]], None if prompt is None else [prompt], vocab,
                            logits.device,                          # row j's history: generated + d_1 .. d_j
                            None if grammar is None or check_first else (_ROW0, grammar[j:j + 1]))
        adjusted = adjust_logits(logits[j:j + 1], t)                 # [1, V] steps 0-3
        grammar_seconds += t.grammar_seconds
        filtered = filter_logits(adjusted, t)                        # [1, V] steps 4-6
        adjusted_rows.append(adjusted)
        if j == k or not reject_with_q:
            # the bonus row, or q one-hot: draw as plain decoding draws (one uniform, none when greedy)
            token = sample(filtered, t.temperature, [generator])
            if check_first:
                start = time.perf_counter()
                token = greedy_within_grammar(adjusted, token, _ROW0, grammar[j:j + 1])
                grammar_seconds += time.perf_counter() - start
            tokens.append(int(token[0]))
            if j == k or tokens[-1] != drafts[j]:
                break
            continue
        d, p, q = drafts[j], probabilities(filtered, t.temperature)[0], draft_probs[j].float()
        if draw_uniform(generator) * float(q[d]) < float(p[d]):     # accept with probability min(1, p/q)
            tokens.append(d)
            continue
        residual = (p - q).clamp(min=0)                              # [V]
        if float(residual.sum()) <= 0:                               # p == q up to rounding: p itself
            residual = p
        tokens.append(draw_from(residual, draw_uniform(generator)))
        break
    out = Verdict(tokens, len(tokens) - 1, grammar_seconds=grammar_seconds)
    if not params.logprobs:
        return out
    chosen, top_ids, top_values = gather_logprobs(torch.cat(adjusted_rows).log_softmax(dim=-1),
                                                  torch.tensor(tokens, device=logits.device), params.top_logprobs)
    top = [top_list(ids, values, params.top_logprobs) for ids, values in zip(top_ids.tolist(), top_values.tolist())]
    return Verdict(tokens, out.num_accepted, chosen.tolist(), top, grammar_seconds)


# ---- configuration ----

METHODS = ("ngram", "mtp")
MAX_SPECULATIVE_TOKENS = 7      # K + 1 verification rows fit one pass of the GEMV kernel over W (8 rows)


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `--speculative-config` (a JSON object, or a dict in Python): `method` "ngram" (prompt lookup,
    `prompt_lookup_max` / `prompt_lookup_min`) or "mtp" (the Gemma 4 assistant at `model`), and
    `num_speculative_tokens` K, at most MAX_SPECULATIVE_TOKENS: a verification step runs K + 1 rows of a
    sequence through the same decode kernels as a plain step, so its tokens are those of plain decoding."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    model: str | None = None

    @classmethod
    def parse(cls, value) -> "SpeculativeConfig":
        """A SpeculativeConfig, a dict or a JSON object string -> a checked SpeculativeConfig (ValueError
        naming the field otherwise)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            import json

            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative config: not JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative config: expected a JSON object, got {type(value).__name__}")
        unknown = sorted(set(value) - {f for f in cls.__dataclass_fields__})
        if unknown:
            raise ValueError(f"speculative config: unknown field(s) {', '.join(unknown)} "
                             f"(known: {', '.join(cls.__dataclass_fields__)})")
        method = value.get("method")
        if method not in METHODS:
            raise ValueError(f"speculative config: method must be one of {', '.join(METHODS)}, got {method!r}")
        k = value.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative config: num_speculative_tokens must be an integer in "
                             f"[1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        if method == "mtp" and not isinstance(value.get("model"), str):
            raise ValueError("speculative config: method 'mtp' needs 'model', the assistant checkpoint's path")
        if method == "ngram" and value.get("model") is not None:
            raise ValueError("speculative config: method 'ngram' takes no 'model'")
        config = cls(**value)
        if method == "ngram":
            try:
                config.ngram()                    # checks the lookup bounds
            except ValueError as e:
                raise ValueError(f"speculative config: {e}") from None
        return config

    def ngram(self) -> NgramDrafter:
        return NgramDrafter.from_config(self.num_speculative_tokens, self.prompt_lookup_max, self.prompt_lookup_min)
