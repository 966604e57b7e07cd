"""Sampling: logits -> token ids, with one documented order of operations.

Order (one pass per decode step over float32 logits ``[B, V]``; every row carries its own
parameters, so one batch may mix greedy, seeded, filtered and constrained requests):

    0. grammar mask         t the request's grammar (or thought budget) does not allow next: logit = -inf
    1. logit_bias           logit[t] += bias[t]                                   (OpenAI)
    2. repetition_penalty   seen t: logit/p if logit > 0 else logit*p             (HF, llama.cpp)
    3. presence/frequency   logit[t] -= presence*[count_t > 0] + frequency*count_t (OpenAI)
       -- logprobs are taken here: log_softmax of the adjusted logits --
    4. top_k                keep the k largest (0 or -1 = off, k > V keeps all)
    5. top_p                keep the smallest prefix whose probability reaches p
    6. min_p                keep t with prob_t >= min_p * max prob
    7. temperature          logits / T, then draw; T < 1e-5 takes the argmax instead

The grammar mask comes first (vLLM applies its grammar bitmask before its sampler too): no bias or
penalty can revive a token the grammar forbids, and the logprobs describe the constrained distribution
(masked tokens have logprob -inf and never appear in a top_logprobs list). Steps 1-3 are elementwise and
keep -inf at -inf, so the code applies the mask after them, where the +-LOGIT_LIMIT clamp cannot turn a
masked -inf into a finite -1e30; the result is the one "mask first" defines. A greedy row that reports no
logprobs checks its argmax against the grammar first and is masked only when the grammar refuses it
(`greedy_within_grammar`, llama.cpp's order): the same token, without the mask's pass over the row when the
model already follows the grammar. The masks are the engine's (engine/runner.py: one llguidance bitmask per
constrained row, bit t % 32 of int32 word t // 32: set = allowed); unconstrained rows cost nothing.

Bias comes first among the rest so that the penalties see the biased logit (vLLM v1 does the same); the
filters 4-6 each renormalise what the previous one kept, and all of them run at T = 1, so
the temperature changes how the survivors are weighted, never which tokens survive
(docs/architecture.md §5.2; gpt-fast and llama.cpp's default chain put temperature earlier).

Which history each penalty sees:
    repetition_penalty  prompt + generated tokens (vLLM, llama.cpp's last-n window, HF);
                        a token counts once however often it was seen.
    presence/frequency  generated tokens only, as OpenAI defines them.

Logprobs: the chosen token's logprob and the top-N list come from the log-softmax of the
logits after step 3 (grammar mask, bias and penalties) and before truncation and temperature, so they
describe the distribution the request's penalties define and do not depend on its
top_k/top_p/min_p/temperature (vLLM's default instead reports the raw model logprobs).

Ties: greedy argmax, top_k and top_p break ties towards the lowest token id (stable sort),
and so does the order of the top_logprobs list.

Drawing: one uniform number per stochastic row from that row's generator (``None`` means
torch's global generator), then inverse-CDF on the row's probabilities. The only Python loop
is over the B rows to draw from their own generators, since torch has no batched op over a
list of generators; nothing loops over the vocabulary. Greedy rows draw nothing. The engine
holds one generator per sequence (``Sampler.make_generator``) for the request's lifetime, so
the same seed gives the same tokens across runs and processes whatever else is in the batch.

Seeds: any 64-bit integer, signed or unsigned ([-2^63, 2^64 - 1]). A seeded request draws from
a `SeedStream`, not from a seeded ``torch.Generator``: torch's CPU generator (mt19937) keeps only
the low 32 bits of its seed, so seeds 1 and 2^32 + 1 would give the same text. A SeedStream's
n-th number is SHA-256(key || n) cut to 53 bits, with key = SHA-256 of the seed's 9-byte
two's-complement form, so distinct seeds give distinct streams (short of a SHA-256 collision)
and the stream does not depend on torch's or Python's generators. A ``torch.Generator`` is
still accepted wherever a generator is (tests pass their own).

Greedy: temperatures below 1e-5 count as 0 (vLLM's _SAMPLING_EPS): dividing logits by a
smaller temperature overflows float32 to inf and the softmax to NaN.

Finite by construction: for valid parameters and finite model logits every number this module
returns is finite (a top_logprobs list leaves out the tokens a grammar masks rather than list them
at -inf). The adjusted logits (steps 1-3) are clamped to +-1e30 (``LOGIT_LIMIT``),
so an extreme but valid penalty (repetition_penalty 1e-300 divides a positive logit by what
float32 rounds to 0) saturates instead of producing inf and then NaN in the log-softmax; a
logprob can still be very negative (the server writes anything below -9999 as -9999, as vLLM
does). Non-finite model logits are the engine's to refuse (runner.py), not the sampler's.

Parameter bounds (checked once, when a SamplingParams is built; `InvalidParameter` names the
field): temperature finite >= 0; top_k -1..2^31-1 (the engine also refuses top_k > its vocabulary);
top_p in (0, 1]; min_p in [0, 1]; repetition_penalty finite > 0; presence/frequency penalties
in [-2, 2] (OpenAI's documented range, vLLM's check); logit_bias at most 300 entries of token id
-> bias in [-100, 100] (OpenAI documents the value range; its reference gives no count limit, so
300 is our cap on the per-request work); at most 64 stop strings of at most 256 characters
(gem4/stops.py says why) and 256 stop_token_ids; seed in [-2^63, 2^64 - 1].
"""
from __future__ import annotations

import hashlib
import itertools
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from gem4.numbers import is_finite_number
from gem4.stops import check_stops
from gem4.structured.spec import GrammarSpec, ThoughtBudget

MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 300                 # entries per request
MAX_STOP_TOKEN_IDS = 256             # entries per request
LOGIT_BIAS_RANGE = 100.0             # |bias| <= 100 (OpenAI)
PENALTY_RANGE = 2.0                  # |presence|, |frequency| <= 2 (OpenAI, vLLM)
MAX_TOKEN_ID = 2**31 - 1             # no vocabulary is larger; the engine checks its own size
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
GREEDY_BELOW = 1e-5                  # temperatures below this are greedy (vLLM's _SAMPLING_EPS)
LOGIT_LIMIT = 1e30                   # adjusted logits are clamped to +-LOGIT_LIMIT
_NEG_INF = float("-inf")


class InvalidParameter(ValueError):
    """A sampling parameter is out of range or of the wrong type. ``param`` names it (the
    SamplingParams field, which is also the OpenAI request field); ``reason`` says why."""

    def __init__(self, param: str, reason: str):
        super().__init__(f"SamplingParams.{param}: {reason}")
        self.param = param
        self.reason = reason


def _show(value) -> str:
    """A short repr for error messages (a 5000-digit int must not become a 5000-digit message:
    Python refuses to even format ints over 4300 digits)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# ---------------------------------------------------------------------------------------------
# Request parameters
# ---------------------------------------------------------------------------------------------


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)




class SeedStream:
    """The uniform numbers of one seeded request: u_n = SHA-256(key || n)[:8] >> 11, / 2^53, with
    key = SHA-256(b"gem4-seed" || the seed as 9 little-endian two's-complement bytes).

    Every 64-bit seed, signed or unsigned, has its own stream (see the module docstring). The
    state is the draw counter; ``get_state`` / ``set_state`` mirror ``torch.Generator`` so the
    engine can replay a step.
    """

    def __init__(self, seed: int):
        if not _is_int(seed) or not SEED_MIN <= seed <= SEED_MAX:
            raise InvalidParameter("seed", f"must be an int in [-2^63, 2^64 - 1] (got {_show(seed)})")
        self.seed = seed
        self._key = hashlib.sha256(b"gem4-seed" + seed.to_bytes(9, "little", signed=True)).digest()
        self._n = 0

    def uniform(self) -> float:
        """The next number in [0, 1), 53 random bits."""
        digest = hashlib.sha256(self._key + self._n.to_bytes(8, "little")).digest()
        self._n += 1
        return (int.from_bytes(digest[:8], "little") >> 11) * 2.0**-53

    def get_state(self) -> int:
        return self._n

    def set_state(self, state: int) -> None:
        self._n = state


@dataclass(frozen=True)
class SamplingParams:
    """What one request asks of the sampler and of the engine's stop logic.

    List-like fields are stored as tuples and ``logit_bias`` as a tuple of ``(token_id, bias)``
    pairs sorted by id, so the object stays frozen and hashable; a dict is accepted.
    ``stop`` accepts a single string.
    """

    temperature: float = 1.0  # 0 = greedy argmax
    top_k: int = 0  # 0 or -1 = off
    top_p: float = 1.0  # 1.0 = off
    min_p: float = 0.0  # 0.0 = off
    repetition_penalty: float = 1.0  # 1.0 = off; prompt + generated
    presence_penalty: float = 0.0  # generated only
    frequency_penalty: float = 0.0  # generated only
    logit_bias: Mapping[int, float] | tuple[tuple[int, float], ...] = ()
    seed: int | None = None
    max_tokens: int | None = None
    stop: str | Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0  # 0..20, needs logprobs=True
    structured: GrammarSpec | None = None  # constrained decoding: the grammar the output must match
    thought_budget: ThoughtBudget | None = None  # at most so many tokens of thought (masks, like the grammar's)

    def __post_init__(self) -> None:
        def fail(name: str, why: str, value=None) -> None:
            shown = _show(getattr(self, name) if value is None else value)
            raise InvalidParameter(name, f"{why} (got {shown})")

        if not is_finite_number(self.temperature) or self.temperature < 0:
            fail("temperature", "must be a finite number >= 0 (0 = greedy)")
        if not _is_int(self.top_k) or not -1 <= self.top_k <= MAX_TOKEN_ID:
            fail("top_k", f"must be an int in [-1, {MAX_TOKEN_ID}] (0 or -1 = off)")
        if not is_finite_number(self.top_p) or not 0 < self.top_p <= 1:
            fail("top_p", "must be in (0, 1] (1 = off)")
        if not is_finite_number(self.min_p) or not 0 <= self.min_p <= 1:
            fail("min_p", "must be in [0, 1] (0 = off)")
        if not is_finite_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            fail("repetition_penalty", "must be a finite number > 0 (1 = off)")
        for name in ("presence_penalty", "frequency_penalty"):
            if not is_finite_number(getattr(self, name)) or not -PENALTY_RANGE <= getattr(self, name) <= PENALTY_RANGE:
                fail(name, f"must be a number in [-{PENALTY_RANGE:g}, {PENALTY_RANGE:g}] (0 = off)")
        if self.seed is not None and (not _is_int(self.seed) or not SEED_MIN <= self.seed <= SEED_MAX):
            fail("seed", "must be None or an int in [-2^63, 2^64 - 1] (a signed or unsigned 64-bit integer)")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            fail("max_tokens", "must be an int >= 1 or None")
        if not isinstance(self.ignore_eos, bool):
            fail("ignore_eos", "must be a bool")
        if not isinstance(self.logprobs, bool):
            fail("logprobs", "must be a bool")
        if not _is_int(self.top_logprobs) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            fail("top_logprobs", f"must be an int in [0, {MAX_TOP_LOGPROBS}]")
        if self.top_logprobs > 0 and not self.logprobs:
            fail("top_logprobs", "needs logprobs=True")
        if self.structured is not None and not isinstance(self.structured, GrammarSpec):
            fail("structured", "must be a gem4.structured.GrammarSpec or None")
        if self.thought_budget is not None and not isinstance(self.thought_budget, ThoughtBudget):
            fail("thought_budget", "must be a gem4.structured.spec.ThoughtBudget or None")

        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        try:
            stop = tuple(stop)
        except TypeError:
            fail("stop", "must be a string or a sequence of strings")
        if not all(isinstance(s, str) and s for s in stop):
            fail("stop", "every stop string must be a non-empty str")
        try:
            check_stops(stop)
        except ValueError as e:
            raise InvalidParameter("stop", str(e)) from None
        object.__setattr__(self, "stop", stop)

        try:
            stop_ids = tuple(self.stop_token_ids)
        except TypeError:
            fail("stop_token_ids", "must be a sequence of ints")
        if len(stop_ids) > MAX_STOP_TOKEN_IDS:
            fail("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} entries", f"{len(stop_ids)} entries")
        bad = next((t for t in stop_ids if not (_is_int(t) and 0 <= t <= MAX_TOKEN_ID)), None)
        if bad is not None:
            fail("stop_token_ids", f"token ids must be ints in [0, {MAX_TOKEN_ID}]", bad)
        object.__setattr__(self, "stop_token_ids", stop_ids)

        bias = self.logit_bias.items() if isinstance(self.logit_bias, Mapping) else self.logit_bias
        try:
            pairs = tuple((t, b) for t, b in bias)
        except (TypeError, ValueError):
            fail("logit_bias", "must map token id -> bias")
        if len(pairs) > MAX_LOGIT_BIAS:
            fail("logit_bias", f"at most {MAX_LOGIT_BIAS} entries", f"{len(pairs)} entries")
        bad = next((t for t, _ in pairs if not (_is_int(t) and 0 <= t <= MAX_TOKEN_ID)), None)
        if bad is not None:
            fail("logit_bias", f"token ids must be ints in [0, {MAX_TOKEN_ID}]", bad)
        bad = next((b for _, b in pairs if not (is_finite_number(b) and -LOGIT_BIAS_RANGE <= b <= LOGIT_BIAS_RANGE)), None)
        if bad is not None:
            fail("logit_bias", f"biases must be numbers in [-{LOGIT_BIAS_RANGE:g}, {LOGIT_BIAS_RANGE:g}]", bad)
        if len({t for t, _ in pairs}) != len(pairs):
            fail("logit_bias", "token ids must be unique")
        object.__setattr__(self, "logit_bias", tuple(sorted((t, float(b)) for t, b in pairs)))

    @property
    def greedy(self) -> bool:
        """Temperatures below 1e-5 take the argmax (see the module docstring)."""
        return self.temperature < GREEDY_BELOW

    @property
    def masked(self) -> bool:
        """Whether the engine computes bitmasks for this request (a grammar, a thought budget)."""
        return self.structured is not None or self.thought_budget is not None

    @property
    def goes_past_end(self) -> bool:
        """Whether generation goes on past the model's end-of-generation ids: `ignore_eos`, except under a
        grammar, which allows an end id only where the output is complete (ignore_eos cannot make it go on
        past the grammar's end). The engine stops by it, and the server's output parser reads by it."""
        return self.ignore_eos and self.structured is None


@dataclass(frozen=True)
class SampleOutput:
    """One step's result for a batch. ``logprobs`` / ``top_logprobs`` are None unless some row
    asked for them; then every row gets its chosen logprob and its own top-N list (empty for
    rows with top_logprobs=0)."""

    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    grammar_seconds: float = 0.0  # time the grammar masks took to apply (0 without one)


# ---------------------------------------------------------------------------------------------
# Pure batched functions. logits: [B, V] float32; per-row parameters: [B] tensors.
# Each returns a new tensor; "off" values leave a row unchanged.
# ---------------------------------------------------------------------------------------------


def token_counts(ids: Sequence[Sequence[int]], vocab_size: int, device=None) -> torch.Tensor:
    """counts[b, t] = how often token t occurs in ids[b]; [B, V] float32."""
    counts = torch.zeros(len(ids), vocab_size, dtype=torch.float32, device=device)
    lengths = torch.tensor([len(row) for row in ids], dtype=torch.long)
    if int(lengths.sum()) == 0:
        return counts
    flat = torch.tensor(list(itertools.chain.from_iterable(ids)), dtype=torch.long)
    if int(flat.min()) < 0 or int(flat.max()) >= vocab_size:
        raise ValueError(f"token history holds ids outside [0, {vocab_size})")
    rows = torch.repeat_interleave(torch.arange(len(ids)), lengths)  # [N]
    ones = torch.ones(flat.numel(), dtype=torch.float32, device=device)
    return counts.index_put_((rows.to(device), flat.to(device)), ones, accumulate=True)


def apply_logit_bias(
    logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor, bias: torch.Tensor
) -> torch.Tensor:
    """logits[rows[i], token_ids[i]] += bias[i]; the bias is sparse, [N] each."""
    return logits.index_put((rows, token_ids), bias, accumulate=True)


def apply_repetition_penalty(
    logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor
) -> torch.Tensor:
    """Seen tokens: positive logits divided by the penalty, negative ones multiplied.
    seen: [B, V] bool; penalty: [B] (1 = off)."""
    p = penalty[:, None]  # [B, 1]
    penalised = torch.where(logits > 0, logits / p, logits * p)
    return torch.where(seen, penalised, logits)


def apply_presence_frequency_penalty(
    logits: torch.Tensor, counts: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor
) -> torch.Tensor:
    """logit -= presence * [count > 0] + frequency * count.
    counts: [B, V]; presence, frequency: [B] (0 = off)."""
    return logits - presence[:, None] * (counts > 0) - frequency[:, None] * counts


def apply_penalties(
    logits: torch.Tensor,
    seen: torch.Tensor | None,
    counts: torch.Tensor | None,
    repetition: torch.Tensor | None,
    presence: torch.Tensor | None,
    frequency: torch.Tensor | None,
) -> torch.Tensor:
    """Repetition penalty (over ``seen``: prompt + generated), then presence/frequency
    (over ``counts``: generated). A None pair skips that penalty for the whole batch."""
    if seen is not None and repetition is not None:
        logits = apply_repetition_penalty(logits, seen, repetition)
    if counts is not None and presence is not None and frequency is not None:
        logits = apply_presence_frequency_penalty(logits, counts, presence, frequency)
    return logits


# llguidance's bitmask: token t is bit t % 32 of int32 word t // 32, which (little-endian) is bit t % 8 of
# byte t // 8. _GRAMMAR_LUT[byte] is what the 8 tokens of that byte add to their logits: 0 where the bit is
# set (allowed), -inf where it is clear. One table lookup per byte and one add per logit: on 2 cores this
# costs ~0.2 ms per row of 262,144 logits, where unpacking the bits (numpy, or shifts in torch) costs 0.3-0.7 ms.
_GRAMMAR_LUT = torch.tensor([[0.0 if byte >> bit & 1 else _NEG_INF for bit in range(8)] for byte in range(256)])


def apply_grammar_mask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """In place: logits[rows[i], t] = -inf where bit t of bitmask[i] is clear (row rows[i]'s grammar does not
    allow t). logits: [B, V] float32; rows: [R] int64, the constrained rows (the others are not touched, and
    cost nothing); bitmask: [R, W] int32 with 32 * W >= V (llguidance's layout, above). Returns logits."""
    batch, vocab = logits.shape
    if bitmask.dim() != 2 or rows.shape != (bitmask.shape[0],) or 32 * bitmask.shape[1] < vocab:
        raise ValueError(f"grammar bitmask {tuple(bitmask.shape)} for rows {tuple(rows.shape)} does not cover "
                         f"logits {tuple(logits.shape)}")
    if rows.numel() == 0:
        return logits
    lut = _GRAMMAR_LUT.to(logits.device)
    as_bytes = bitmask.contiguous().view(torch.uint8).reshape(-1).int()  # [R * 4W]
    add = lut.index_select(0, as_bytes).view(rows.numel(), -1)[:, :vocab]  # [R, V] 0 or -inf
    if rows.numel() == batch and bool((rows == torch.arange(batch, device=rows.device)).all()):
        return logits.add_(add)
    return logits.index_add_(0, rows.to(logits.device), add)


_SHIFTS = torch.arange(32, dtype=torch.int32)
SPARSE_WORDS = 1 / 16    # a refused row whose mask has at most this share of nonzero words: argmax over its ids


def greedy_within_grammar(adjusted: torch.Tensor, token_ids: torch.Tensor, rows: torch.Tensor,
                          bitmask: torch.Tensor) -> torch.Tensor:
    """The greedy choice of constrained rows whose mask was not applied (llama.cpp's check-then-mask): a row whose
    argmax `token_ids[r]` its grammar allows keeps it -- it is the lowest-id maximum of all tokens, so of the
    allowed ones too. A refused row takes the argmax over its allowed ids: gathered from its few nonzero mask
    words when the grammar allows few tokens (a structural position: a name, a key, a bracket), so the row is
    never rewritten; otherwise the row is masked (in `adjusted`) and its argmax taken again. Exact for greedy
    rows (the filters 4-6 keep the top token) that report no logprobs. adjusted: [B, V] steps 1-3; token_ids:
    [B]; rows [R] and bitmask [R, W] as `apply_grammar_mask`. Returns the token ids [B]."""
    chosen = token_ids[rows]  # [R]
    word = bitmask.gather(1, (chosen // 32)[:, None]).squeeze(1)  # [R] int32
    refused = ((word >> (chosen % 32).int()) & 1) == 0  # [R]
    if not bool(refused.any()):
        return token_ids
    token_ids = token_ids.clone()
    bad, words = rows[refused], bitmask[refused]  # [R'], [R', W]
    vocab = adjusted.shape[1]
    nonzero = words != 0  # [R', W]
    sparse = nonzero.sum(1) <= SPARSE_WORDS * words.shape[1]  # [R']
    if bool(sparse.any()):
        r, w = nonzero[sparse].nonzero(as_tuple=True)  # [M] the nonzero words
        m, j = ((words[sparse][r, w].unsqueeze(1) >> _SHIFTS.to(words.device)) & 1).nonzero(as_tuple=True)
        row, ids = r[m], w[m] * 32 + j  # allowed (row, id), ids ascending within a row
        inside = ids < vocab
        row, ids = row[inside], ids[inside]
        target = bad[sparse]  # [S] the rows of `adjusted`
        values = adjusted[target[row], ids]  # [A]
        best = torch.full((len(target),), _NEG_INF, device=values.device).scatter_reduce(0, row, values, "amax")
        first = torch.full((len(target),), vocab, device=ids.device).scatter_reduce(
            0, row, torch.where(values == best[row], ids, vocab), "amin")  # the lowest id with the best value
        token_ids[target] = first
    if not bool(sparse.all()):
        dense = bad[~sparse]
        apply_grammar_mask(adjusted, dense, words[~sparse])
        token_ids[dense] = greedy(adjusted[dense])
    return token_ids


def _scatter_sorted(mask_sorted: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    # mask_sorted[b, r] belongs to token order[b, r]; returns the mask in vocabulary order.
    return torch.empty_like(mask_sorted).scatter_(-1, order, mask_sorted)


def apply_top_k(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Keep exactly the k largest logits per row (ties to the lowest id); k: [B] int,
    k <= 0 = off, k >= V keeps everything."""
    vocab = logits.shape[-1]
    k = torch.where(k <= 0, vocab, k).clamp(max=vocab)  # [B]
    order = logits.argsort(dim=-1, descending=True, stable=True)  # [B, V]
    ranks = torch.arange(vocab, device=logits.device)  # [V]
    drop = _scatter_sorted(ranks[None, :] >= k[:, None], order)  # [B, V]
    return logits.masked_fill(drop, _NEG_INF)


def apply_top_p(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Nucleus: keep the smallest prefix of tokens (by descending probability, ties to the
    lowest id) whose total probability reaches p; the top token is always kept. p: [B], 1 = off.
    A token is dropped when the probability mass ranked strictly before it is already >= p."""
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)  # [B, V]
    probs = sorted_logits.softmax(dim=-1)  # [B, V]
    mass_before = probs.cumsum(dim=-1) - probs  # [B, V]
    drop_sorted = (mass_before >= p[:, None]) & (p < 1)[:, None]
    drop_sorted[:, 0] = False
    return logits.masked_fill(_scatter_sorted(drop_sorted, order), _NEG_INF)


def apply_min_p(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Keep tokens whose probability is at least p times the top token's; p: [B], 0 = off.
    In log space: prob_t >= p * prob_max  <=>  logit_t >= max_logit + log(p)."""
    threshold = logits.amax(dim=-1, keepdim=True) + torch.log(p)[:, None]  # [B, 1]
    return logits.masked_fill(logits < threshold, _NEG_INF)


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """logits / T per row; rows with T == 0 (greedy) are left as they are."""
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))  # [B]
    return logits / t[:, None]


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """Argmax per row, ties to the lowest id (torch.argmax returns the first maximum). [B]."""
    return logits.argmax(dim=-1)


Generator = SeedStream | torch.Generator | None  # one per row; None = torch's global generator


def _draw_uniforms(rows: Sequence[int], generators: Sequence[Generator], batch: int) -> torch.Tensor:
    """One U[0, 1) float64 per listed row from that row's generator, [B] (0 elsewhere).
    Loops over rows: torch has no batched draw over a list of generators."""
    u = torch.zeros(batch, dtype=torch.float64)
    shared = [b for b in rows if generators[b] is None]
    if shared:
        u[shared] = torch.rand(len(shared), dtype=torch.float64)  # torch's global generator
    for b in rows:
        g = generators[b]
        if isinstance(g, SeedStream):
            u[b] = g.uniform()
        elif g is not None:
            u[b] = torch.rand((), dtype=torch.float64, generator=g)
    return u


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Token b is t where cdf[t-1] <= u*total < cdf[t]; zero-probability tokens never win.
    probs: [B, V]; u: [B] float64 in [0, 1)."""
    cdf = probs.double().cumsum(dim=-1)  # [B, V]
    target = u[:, None] * cdf[:, -1:]  # [B, 1]
    ids = torch.searchsorted(cdf, target, right=True).squeeze(-1)  # [B]
    # guard the u*total == total rounding case: never step past the last token with mass
    vocab_ids = torch.arange(probs.shape[-1], device=probs.device)
    last = torch.where(probs > 0, vocab_ids, 0).amax(dim=-1)  # [B]
    return torch.minimum(ids, last)


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    generators: Sequence[Generator] | None = None,
) -> torch.Tensor:
    """Draw one token per row from softmax(logits / T); rows with T < 1e-5 take the argmax and
    draw nothing. generators: a SeedStream, a CPU torch.Generator or None (torch's global
    generator) per row. Returns [B] int64."""
    batch = logits.shape[0]
    ids = greedy(logits)  # [B]
    stochastic = temperature >= GREEDY_BELOW  # [B]
    rows = [b for b, s in enumerate(stochastic.tolist()) if s]
    if not rows:
        return ids
    generators = generators if generators is not None else [None] * batch
    if len(generators) != batch:
        raise ValueError(f"sample: {len(generators)} generators for {batch} rows")
    t = torch.where(stochastic, temperature, torch.ones_like(temperature))  # greedy rows: any T
    probs = apply_temperature(logits, t).softmax(dim=-1)  # [B, V]
    u = _draw_uniforms(rows, generators, batch).to(logits.device)
    drawn = _inverse_cdf(probs, u)  # [B]
    return torch.where(stochastic, drawn, ids)


def probabilities(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """The distribution `sample` draws each row of (filtered) logits from: softmax(logits / T), one-hot at the
    argmax for greedy rows (T < 1e-5). [B, V] float32. Speculative verification (engine/speculative.py)
    compares the drafter's probabilities with these."""
    greedy_rows = temperature < GREEDY_BELOW  # [B]
    t = torch.where(greedy_rows, torch.ones_like(temperature), temperature)
    probs = apply_temperature(logits, t).softmax(dim=-1)  # [B, V]
    one_hot = torch.nn.functional.one_hot(greedy(logits), logits.shape[-1]).to(probs.dtype)
    return torch.where(greedy_rows[:, None], one_hot, probs)


def draw_uniform(generator: Generator) -> float:
    """One U[0, 1) number from a row's generator, as `sample` draws it (SeedStream, torch.Generator or None)."""
    return float(_draw_uniforms([0], [generator], 1)[0])


def draw_from(probs: torch.Tensor, u: float) -> int:
    """The token inverse-CDF sampling picks from probs [V] (need not sum to 1) for the uniform u, as `sample`."""
    return int(_inverse_cdf(probs[None], torch.tensor([u], dtype=torch.float64, device=probs.device))[0])


def gather_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, n: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logprobs: [B, V] log-softmax; token_ids: [B]. Returns the chosen logprobs [B] and the top
    n (ids [B, n], logprobs [B, n]) in descending order, ties to the lowest id."""
    chosen = logprobs.gather(-1, token_ids[:, None]).squeeze(-1)  # [B]
    if n == 0:
        return chosen, token_ids.new_empty(len(token_ids), 0), logprobs[:, :0]
    top_values, top_ids = logprobs.sort(dim=-1, descending=True, stable=True)  # [B, V]
    return chosen, top_ids[:, :n], top_values[:, :n]


def top_list(ids: Sequence[int], values: Sequence[float], n: int) -> list[tuple[int, float]]:
    """A row's top-n (id, logprob) pairs from `gather_logprobs`' sorted lists, without the tokens a grammar
    masked (logprob -inf): a constrained row may allow fewer than n tokens."""
    return [(i, v) for i, v in zip(ids[:n], values[:n]) if v != _NEG_INF]


# ---------------------------------------------------------------------------------------------
# The whole pipeline over a batch of tensors
# ---------------------------------------------------------------------------------------------


@dataclass
class SamplingTensors:
    """A batch's parameters as tensors. A stage whose tensor is None is off for every row."""

    temperature: torch.Tensor  # [B] float32
    top_k: torch.Tensor | None = None  # [B] int64
    top_p: torch.Tensor | None = None  # [B] float32
    min_p: torch.Tensor | None = None  # [B] float32
    repetition: torch.Tensor | None = None  # [B] float32
    seen: torch.Tensor | None = None  # [B, V] bool, prompt + generated
    presence: torch.Tensor | None = None  # [B] float32
    frequency: torch.Tensor | None = None  # [B] float32
    counts: torch.Tensor | None = None  # [B, V] float32, generated
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # rows, ids, values [N]
    grammar: tuple[torch.Tensor, torch.Tensor] | None = None  # constrained rows [R], their bitmasks [R, W] int32
    grammar_seconds: float = 0.0  # time spent applying `grammar` (adjust_logits adds to it; for metrics)


def adjust_logits(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Steps 0-3: the grammar mask, logit_bias, repetition penalty, presence/frequency, with the clamp to
    +-LOGIT_LIMIT (finite logits stay finite whatever the penalties; masked ones stay -inf). The mask is
    applied last: steps 1-3 are elementwise and keep -inf at -inf, so that equals masking first (module
    docstring). [B, V] -> [B, V]."""
    logits = logits.float()
    if t.bias is not None:
        logits = apply_logit_bias(logits, *t.bias)
    logits = apply_penalties(logits, t.seen, t.counts, t.repetition, t.presence, t.frequency)
    logits = logits.clamp(-LOGIT_LIMIT, LOGIT_LIMIT)
    if t.grammar is not None:
        start = time.perf_counter()
        apply_grammar_mask(logits, *t.grammar)
        t.grammar_seconds += time.perf_counter() - start
    return logits


def filter_logits(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Steps 4-6: top-k, top-p, min-p; dropped tokens become -inf. [B, V] -> [B, V]."""
    if t.top_k is not None:
        logits = apply_top_k(logits, t.top_k)
    if t.top_p is not None:
        logits = apply_top_p(logits, t.top_p)
    if t.min_p is not None:
        logits = apply_min_p(logits, t.min_p)
    return logits


# ---------------------------------------------------------------------------------------------
# Convenience: SamplingParams + histories -> tensors -> SampleOutput
# ---------------------------------------------------------------------------------------------


class Sampler:
    """Builds the batch tensors from each row's SamplingParams and token histories and runs
    the pipeline. Stateless: the caller (the engine) owns one generator per sequence."""

    @staticmethod
    def make_generator(params: SamplingParams) -> SeedStream | None:
        """A fresh SeedStream for a seeded request (None: use torch's global generator).
        Keep it for the request's lifetime and pass it back on every step."""
        if params.seed is None:
            return None
        return SeedStream(params.seed)

    @staticmethod
    def tensors(
        params: Sequence[SamplingParams],
        generated: Sequence[Sequence[int]],
        prompts: Sequence[Sequence[int]] | None,
        vocab_size: int,
        device=None,
        grammar: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> SamplingTensors:
        """The batch's parameters as tensors; `grammar`: the constrained rows [R] and their grammar bitmasks
        [R, W] (None: no row is constrained)."""

        def column(values, dtype=torch.float32) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)  # [B]

        t = SamplingTensors(temperature=column([p.temperature for p in params]), grammar=grammar)
        if any(p.top_k > 0 for p in params):
            t.top_k = column([min(p.top_k, vocab_size) for p in params], torch.long)  # k >= V: all
        if any(p.top_p < 1 for p in params):
            t.top_p = column([p.top_p for p in params])
        if any(p.min_p > 0 for p in params):
            t.min_p = column([p.min_p for p in params])
        if any(p.repetition_penalty != 1 for p in params):
            prompts = prompts if prompts is not None else [()] * len(params)
            history = [list(p) + list(g) for p, g in zip(prompts, generated)]
            # a penalty that float32 rounds to 0 (1e-300) becomes the smallest normal float32
            t.repetition = column([p.repetition_penalty for p in params]).clamp(min=torch.finfo(torch.float32).tiny)
            t.seen = token_counts(history, vocab_size, device) > 0
        if any(p.presence_penalty != 0 or p.frequency_penalty != 0 for p in params):
            t.presence = column([p.presence_penalty for p in params])
            t.frequency = column([p.frequency_penalty for p in params])
            t.counts = token_counts(generated, vocab_size, device)
        pairs = [(b, tok, bias) for b, p in enumerate(params) for tok, bias in p.logit_bias]
        if pairs:
            rows, ids, values = zip(*pairs)
            if max(ids) >= vocab_size:
                raise InvalidParameter(
                    "logit_bias", f"token id {max(ids)} >= the vocabulary size {vocab_size}"
                )
            t.bias = (column(rows, torch.long), column(ids, torch.long), column(values))
        return t

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generated: Sequence[Sequence[int]],
        prompts: Sequence[Sequence[int]] | None = None,
        generators: Sequence[Generator] | None = None,
        grammar: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> SampleOutput:
        """logits: [B, V] for the next token of each row; generated / prompts: each row's token
        ids so far. generators: the engine's per-sequence generators; None builds fresh ones
        from the seeds, which only suits a single step. grammar: (rows [R] int64, bitmasks [R, W] int32):
        the constrained rows and their grammars' masks (step 0), None when no row is constrained; every
        mask must allow at least one token (the engine checks)."""
        batch, vocab = logits.shape
        for name, rows in (("params", params), ("generated", generated), ("prompts", prompts),
                           ("generators", generators)):
            if rows is not None and len(rows) != batch:
                raise ValueError(f"Sampler.sample: {len(rows)} {name} for {batch} logits rows")
        if generators is None:
            generators = [self.make_generator(p) for p in params]

        # greedy rows that report no logprobs check their argmax against the grammar instead of masking first
        deferred = None
        if grammar is not None:
            lazy = torch.tensor([params[r].greedy and not params[r].logprobs for r in grammar[0].tolist()])
            if bool(lazy.any()):
                deferred, grammar = (grammar[0][lazy], grammar[1][lazy]), (grammar[0][~lazy], grammar[1][~lazy])
        t = self.tensors(params, generated, prompts, vocab, logits.device, grammar)
        adjusted = adjust_logits(logits, t)  # [B, V]
        token_ids = sample(filter_logits(adjusted, t), t.temperature, generators)  # [B]
        if deferred is not None:
            start = time.perf_counter()
            token_ids = greedy_within_grammar(adjusted, token_ids, *deferred)
            t.grammar_seconds += time.perf_counter() - start

        if not any(p.logprobs for p in params):
            return SampleOutput(token_ids.tolist(), grammar_seconds=t.grammar_seconds)
        n = max(p.top_logprobs for p in params)
        chosen, top_ids, top_values = gather_logprobs(adjusted.log_softmax(dim=-1), token_ids, n)
        top = [top_list(ids, values, p.top_logprobs) for p, ids, values in zip(params, top_ids.tolist(),
                                                                            top_values.tolist())]
        return SampleOutput(token_ids.tolist(), chosen.tolist(), top, t.grammar_seconds)
