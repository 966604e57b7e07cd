"""engine/speculative.py: prompt-lookup drafts (vLLM's ngram semantics) and exact acceptance."""
from __future__ import annotations

import math

import pytest
import torch

from gem4.engine.speculative import NgramDrafter, verify
from gem4.sampling import Sampler, SamplingParams, SeedStream


# ---- prompt lookup ----

@pytest.mark.parametrize("tokens, lo, hi, k, want", [
    ([1, 2, 3, 4, 2, 3], 2, 3, 4, [4, 2, 3]),          # vLLM's example: [4,2,3] has no match, [2,3] does
    ([1, 2, 3, 4, 2, 3], 2, 3, 1, [4]),
    ([5, 1, 9, 7, 1, 8, 7, 1], 1, 2, 1, [8]),           # the longest n wins over an earlier 1-gram match
    ([5, 1, 9, 7, 1, 8, 7, 1], 1, 1, 1, [9]),           # 1-grams only: the earliest [1]
    ([1, 2, 7, 1, 2, 8, 1, 2], 2, 2, 2, [7, 1]),        # the earliest occurrence, not the latest
    ([3, 3, 3], 1, 1, 5, [3, 3]),                       # the continuation runs into the suffix, then ends
    ([1, 2, 3], 1, 3, 4, []),                           # the suffix itself is no match
    ([4, 4], 2, 2, 3, []),                              # shorter than min + 1: nothing to look up
    ([9], 1, 5, 3, []),
    ([], 1, 5, 3, []),
    ([1, 2, 1, 2, 1, 2], 3, 3, 8, [1, 2]),              # [2,1,2] first at 1; what follows runs to the end
    ([1, 2, 3, 9, 1, 2, 3], 4, 5, 3, []),               # only a 3-gram matches, below min
])
def test_ngram_lookup_table(tokens, lo, hi, k, want):
    assert NgramDrafter(k, prompt_lookup_max=hi, prompt_lookup_min=lo).propose(tokens) == want


def test_ngram_caller_cap_and_config():
    d = NgramDrafter.from_config(4)
    assert (d.prompt_lookup_min, d.prompt_lookup_max) == (5, 5)                  # vLLM's defaults
    assert NgramDrafter.from_config(4, prompt_lookup_max=3).prompt_lookup_min == 3
    assert NgramDrafter.from_config(4, prompt_lookup_min=2).prompt_lookup_max == 2
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]
    assert NgramDrafter(4, 2, 2).propose(tokens) == [3, 4, 5, 6]
    assert NgramDrafter(4, 2, 2).propose(tokens, max_drafts=2) == [3, 4]
    assert NgramDrafter(4, 2, 2).propose(tokens, max_drafts=0) == []
    with pytest.raises(ValueError, match="prompt_lookup_min=3 must be <= prompt_lookup_max=2"):
        NgramDrafter(4, prompt_lookup_max=2, prompt_lookup_min=3)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        NgramDrafter(0)


# ---- greedy acceptance ----

def rows(*argmaxes: int, vocab: int = 6) -> torch.Tensor:
    """Logits rows whose argmax is each given id (margin 3)."""
    out = torch.zeros(len(argmaxes), vocab)
    out[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 3.0
    return out


GREEDY = SamplingParams(temperature=0.0)


@pytest.mark.parametrize("argmaxes, drafts, tokens", [
    ((1, 2, 3, 4), [1, 2, 5], [1, 2, 3]),       # two accepted, the third replaced by the target's token
    ((1, 2, 3, 4), [1, 2, 3], [1, 2, 3, 4]),    # all accepted, plus the bonus token
    ((1, 2, 3, 4), [0, 2, 3], [1]),             # first rejected: the target's own token only
    ((1, 2, 3, 4), [1, 0, 3], [1, 2]),          # nothing after a rejection counts, even a match
    ((5,), [], [5]),                            # no drafts: plain decoding
])
def test_greedy_acceptance(argmaxes, drafts, tokens):
    v = verify(rows(*argmaxes), drafts, GREEDY, generated=[0])
    assert v.tokens == tokens and v.num_accepted == len(tokens) - 1


def test_rows_see_their_drafts_in_the_penalty_history():
    # row 1 follows d_1 = 2: with repetition_penalty 2 its logit 5 -> 2.5 loses to 4, as plain decoding would
    logits = torch.tensor([[0.0, 0.0, 9.0, 0.0], [0.0, 0.0, 5.0, 4.0], [1.0, 0.0, 0.0, 0.0]])
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    v = verify(logits, [2, 2], params, generated=[], prompt=[1])
    plain = Sampler().sample(logits[1:2], [params], [[2]], [[1]]).token_ids
    assert plain == [3] and v.tokens == [2, 3]
    # presence penalty on generated tokens only, and logit_bias, the same way
    params = SamplingParams(temperature=0.0, presence_penalty=2.0, logit_bias={0: 1.5}, logprobs=True, top_logprobs=2)
    v = verify(logits, [2, 2], params, generated=[])
    assert v.tokens == [2, 3]
    ref = Sampler().sample(logits[1:2], [params], [[2]])
    assert v.logprobs[1] == pytest.approx(ref.logprobs[0])
    assert [t for t, _ in v.top_logprobs[1]] == [t for t, _ in ref.top_logprobs[0]]     # (token, logprob) pairs
    assert [lp for _, lp in v.top_logprobs[1]] == pytest.approx([lp for _, lp in ref.top_logprobs[0]])


def test_deterministic_drafter_keeps_the_seeded_text():
    # one uniform per emitted token, drawn as plain decoding draws it: the same seed gives the same tokens
    torch.manual_seed(0)
    table = torch.randn(6, 6) * 2
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=1234)
    plain, g = [], SeedStream(1234)
    history = [0]
    for _ in range(12):
        plain.append(Sampler().sample(table[history[-1]][None], [params], [plain], generators=[g]).token_ids[0])
        history.append(plain[-1])
    spec, g = [], SeedStream(1234)
    drafter = NgramDrafter(3, 1, 1)
    while len(spec) < 12:
        seq = [0] + spec
        drafts = drafter.propose(seq) or [(seq[-1] + 1) % 6, 2]
        logits = table[torch.tensor([seq[-1]] + drafts)]
        spec += verify(logits, drafts, params, spec, generator=g).tokens
    assert spec[:12] == plain


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="2 drafts need 3 logits rows"):
        verify(rows(1, 2), [1, 2], GREEDY, [])
    with pytest.raises(ValueError, match=r"draft ids must be in \[0, 6\)"):
        verify(rows(1, 2), [6], GREEDY, [])
    with pytest.raises(ValueError, match="draft_probs must be"):
        verify(rows(1, 2), [1], SamplingParams(), [], draft_probs=torch.ones(2, 6))


# ---- distribution: speculative sampling draws what plain sampling draws ----

VOCAB = 5
TARGET = torch.tensor([[1.0, 0.2, -0.5, 0.8, 0.0],          # target logits after each token: a Markov toy model
                       [0.1, 1.2, 0.3, -1.0, 0.5],
                       [-0.3, 0.0, 1.5, 0.4, 0.9],
                       [0.7, -0.2, 0.1, 1.1, -0.4],
                       [0.0, 0.6, -0.8, 0.2, 1.3]])
BAD_Q = torch.softmax(-2.0 * TARGET, dim=-1)                 # a drafter that prefers what the target avoids
PARAMS = SamplingParams(temperature=0.8, top_k=4, repetition_penalty=1.3, presence_penalty=0.3)
PROMPT = [0]
N = 1500


def exact_pairs() -> torch.Tensor:
    """P(first two generated tokens) under plain sampling, [V, V], from the sampler's own per-step
    distributions (penalties see each history)."""
    from gem4.sampling import adjust_logits, filter_logits, probabilities

    def dist(generated):
        t = Sampler.tensors([PARAMS], [generated], [PROMPT], VOCAB)
        logits = TARGET[(PROMPT + generated)[-1]][None]
        return probabilities(filter_logits(adjust_logits(logits, t), t), t.temperature)[0]

    p1 = dist([])
    return torch.stack([p1[a] * dist([a]) for a in range(VOCAB)])


def chi_square(counts: torch.Tensor, expected_p: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic over the cells of nonzero probability; a draw in a cell of probability 0 is inf."""
    counts, expected_p = counts.flatten().double(), expected_p.flatten().double()
    live = expected_p > 0
    if counts[~live].sum() > 0:
        return math.inf, int(live.sum()) - 1
    exp = expected_p[live] * counts.sum()
    return float(((counts[live] - exp) ** 2 / exp).sum()), int(live.sum()) - 1


def critical(df: int, z: float = 3.09) -> float:
    """Chi-square quantile at 1 - 0.001 (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def run(step, n: int = N, seed: int = 7) -> torch.Tensor:
    """Counts of the first two generated tokens over n runs of `step(generated, generator) -> new tokens`."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(VOCAB, VOCAB)
    for _ in range(n):
        generated: list[int] = []
        while len(generated) < 2:
            generated += step(generated, g)
        counts[generated[0], generated[1]] += 1
    return counts


def plain_step(generated, g):
    logits = TARGET[(PROMPT + generated)[-1]][None]
    return Sampler().sample(logits, [PARAMS], [generated], [PROMPT], generators=[g]).token_ids


def fixed_drafter_step(generated, g):                    # deterministic and bad: always proposes (last + 1, last + 1)
    last = (PROMPT + generated)[-1]
    drafts = [(last + 1) % VOCAB, (last + 1) % VOCAB]
    logits = TARGET[torch.tensor([last] + drafts)]
    return verify(logits, drafts, PARAMS, generated, PROMPT, g).tokens


def sampling_drafter_step(generated, g):                 # samples K = 2 drafts from BAD_Q, autoregressively
    last = (PROMPT + generated)[-1]
    q1 = BAD_Q[last]
    d1 = int(torch.multinomial(q1, 1, generator=g))
    q2 = BAD_Q[d1]
    d2 = int(torch.multinomial(q2, 1, generator=g))
    logits = TARGET[torch.tensor([last, d1, d2])]
    return verify(logits, [d1, d2], PARAMS, generated, PROMPT, g, draft_probs=torch.stack([q1, q2])).tokens


def misreported_q_step(generated, g):                   # draws from BAD_Q but claims uniform q: no longer exact
    last = (PROMPT + generated)[-1]
    d1 = int(torch.multinomial(BAD_Q[last], 1, generator=g))
    d2 = int(torch.multinomial(BAD_Q[d1], 1, generator=g))
    logits = TARGET[torch.tensor([last, d1, d2])]
    return verify(logits, [d1, d2], PARAMS, generated, PROMPT, g, draft_probs=torch.full((2, VOCAB), 1 / VOCAB)).tokens


def accept_all_step(generated, g):                       # the broken alternative: trust the drafter
    last = (PROMPT + generated)[-1]
    d1 = int(torch.multinomial(BAD_Q[last], 1, generator=g))
    return [d1, int(torch.multinomial(BAD_Q[d1], 1, generator=g))]


def test_speculative_sampling_has_plain_sampling_distribution():
    expected = exact_pairs()
    assert float(expected.sum()) == pytest.approx(1.0)
    results = {}
    for name, step in (("plain", plain_step), ("fixed drafter", fixed_drafter_step),
                       ("sampling drafter", sampling_drafter_step), ("misreported q", misreported_q_step),
                       ("accept all", accept_all_step)):
        stat, df = chi_square(run(step), expected)
        results[name] = (stat, df)
        print(f"{name}: chi2 = {stat:.1f}, df = {df}, critical (p = 0.001) = {critical(df):.1f}")
    for name in ("plain", "fixed drafter", "sampling drafter"):
        stat, df = results[name]
        assert stat < critical(df), name
    # the test has the power to see a wrong distribution: trusting the drafter, or verifying with the wrong q
    for name in ("misreported q", "accept all"):
        stat, df = results[name]
        assert stat > 2 * critical(df), name


def test_greedy_rows_ignore_draft_probs():
    # a greedy request with a sampling drafter: the longest argmax match, no uniform drawn
    g = SeedStream(5)
    q = torch.full((2, 6), 1 / 6)
    v = verify(rows(1, 2, 3), [1, 4], GREEDY, [], generator=g, draft_probs=q)
    assert v.tokens == [1, 2] and g.get_state() == 0

