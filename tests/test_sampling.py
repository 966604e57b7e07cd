"""Sampler tests: tables of hand-checkable numbers for each filter and penalty, the documented
order of operations, seeded reproducibility (in process and across processes) and a chi-square
check that sampling follows softmax(logits / T)."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gem4.sampling import (
    MAX_LOGIT_BIAS,
    MAX_STOP_TOKEN_IDS,
    InvalidParameter,
    Sampler,
    SeedStream,
    SampleOutput,
    SamplingParams,
    adjust_logits,
    apply_logit_bias,
    apply_min_p,
    apply_presence_frequency_penalty,
    apply_repetition_penalty,
    apply_temperature,
    apply_top_k,
    apply_top_p,
    filter_logits,
    sample,
    token_counts,
)
from gem4.stops import MAX_STOP_CHARS, MAX_STOP_STRINGS

INF = float("inf")
SRC = Path(__file__).resolve().parents[1] / "src"


def row(*values: float) -> torch.Tensor:
    return torch.tensor([values], dtype=torch.float32)  # [1, V]


def log_probs_row(*probs: float) -> torch.Tensor:
    return torch.log(torch.tensor([probs], dtype=torch.float32))  # [1, V]


def kept(logits: torch.Tensor) -> set[int]:
    # logits: [1, V]
    return set(torch.nonzero(torch.isfinite(logits[0])).flatten().tolist())


def one(value, dtype=torch.float32) -> torch.Tensor:
    return torch.tensor([value], dtype=dtype)  # [1]


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def draws(logits: torch.Tensor, params: SamplingParams, n: int = 200) -> set[int]:
    """Tokens drawn over n seeded single steps of the full Sampler on one logits row."""
    sampler = Sampler()
    batch = logits.expand(n, -1).contiguous()  # [n, V]
    gens = [seeded(s) for s in range(n)]
    out = sampler.sample(batch, [params] * n, [[] for _ in range(n)], generators=gens)
    return set(out.token_ids)


# ---------------------------------------------------------------------------------------------
# Filters
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "logits, k, expected",
    [
        ([1, 4, 2, 3], 1, {1}),
        ([1, 4, 2, 3], 2, {1, 3}),
        ([1, 4, 2, 3], 3, {1, 2, 3}),
        ([1, 4, 2, 3], 0, {0, 1, 2, 3}),  # off
        ([1, 4, 2, 3], -1, {0, 1, 2, 3}),  # off
        ([1, 4, 2, 3], 10, {0, 1, 2, 3}),  # k > V keeps all
        ([2, 2, 1, 2], 2, {0, 1}),  # exactly k, ties to the lowest ids
    ],
)
def test_top_k(logits, k, expected):
    out = apply_top_k(row(*logits), one(k, torch.long))
    assert kept(out) == expected
    assert torch.equal(out[0, sorted(expected)], row(*logits)[0, sorted(expected)])


@pytest.mark.parametrize(
    "logits, p, expected",
    [
        # equal logits: probs 0.25 each; a token goes when the mass before it is >= p
        ([0, 0, 0, 0], 0.5, {0, 1}),
        ([0, 0, 0, 0], 0.51, {0, 1, 2}),
        ([0, 0, 0, 0], 0.25, {0}),
        ([0, 0, 0, 0], 1.0, {0, 1, 2, 3}),  # off
        # logits [1, 2, 3, 4]: probs 0.032, 0.087, 0.237, 0.644
        ([1, 2, 3, 4], 0.6, {3}),
        ([1, 2, 3, 4], 0.7, {2, 3}),
        ([1, 2, 3, 4], 0.9, {1, 2, 3}),
        ([1, 2, 3, 4], 0.99, {0, 1, 2, 3}),
        ([1, 2, 3, 4], 1e-6, {3}),  # always keeps the top token
    ],
)
def test_top_p(logits, p, expected):
    assert kept(apply_top_p(row(*logits), one(p))) == expected


def test_top_p_keeps_one_token_when_every_prob_is_below_p():
    logits = torch.zeros(1, 100)  # each prob 0.01
    assert kept(apply_top_p(logits, one(0.001))) == {0}


@pytest.mark.parametrize(
    "probs, p, expected",
    [
        ((0.5, 0.3, 0.15, 0.05), 0.5, {0, 1}),  # threshold 0.25
        ((0.5, 0.3, 0.15, 0.05), 0.2, {0, 1, 2}),  # threshold 0.10
        ((0.5, 0.3, 0.15, 0.05), 0.05, {0, 1, 2, 3}),  # threshold 0.025
        ((0.5, 0.3, 0.15, 0.05), 0.0, {0, 1, 2, 3}),  # off
        ((0.5, 0.3, 0.15, 0.05), 1.0, {0}),
        # relative to the top prob (0.2), not absolute: threshold 0.6 * 0.2 = 0.12
        ((0.2, 0.2, 0.2, 0.2, 0.1, 0.1), 0.6, {0, 1, 2, 3}),
    ],
)
def test_min_p(probs, p, expected):
    assert kept(apply_min_p(log_probs_row(*probs), one(p))) == expected


def test_temperature_half_squares_the_probabilities():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    scaled = apply_temperature(torch.log(probs)[None], one(0.5)).softmax(-1)[0]
    expected = probs**2 / (probs**2).sum()
    torch.testing.assert_close(scaled, expected)
    # T = 0 rows are left for the argmax, unscaled
    assert torch.equal(apply_temperature(row(1, 2), one(0.0)), row(1, 2))


# ---------------------------------------------------------------------------------------------
# Penalties and bias (exact resulting logits)
# ---------------------------------------------------------------------------------------------


def test_repetition_penalty_divides_positive_and_multiplies_negative():
    logits = row(2, -2, 2, -2, 0)
    seen = torch.tensor([[True, True, False, False, True]])
    out = apply_repetition_penalty(logits, seen, one(2.0))
    assert out.tolist() == [[1.0, -4.0, 2.0, -2.0, 0.0]]


def test_presence_and_frequency_penalty():
    logits = row(1, 1, 1, 1)
    counts = row(0, 1, 3, 0)
    out = apply_presence_frequency_penalty(logits, counts, one(0.5), one(0.25))
    # 1 - 0.5*[c>0] - 0.25*c
    assert out.tolist() == [[1.0, 0.25, -0.25, 1.0]]


def test_logit_bias_is_sparse_and_per_row():
    logits = torch.zeros(2, 3)
    rows, ids = torch.tensor([0, 1, 1]), torch.tensor([2, 0, 2])
    out = apply_logit_bias(logits, rows, ids, torch.tensor([5.0, -1.0, 0.5]))
    assert out.tolist() == [[0.0, 0.0, 5.0], [-1.0, 0.0, 0.5]]
    assert logits.abs().sum() == 0  # pure


def test_token_counts():
    counts = token_counts([[1, 1, 3], [], [0]], 4)
    assert counts.tolist() == [[0, 2, 0, 1], [0, 0, 0, 0], [1, 0, 0, 0]]
    with pytest.raises(ValueError, match="outside"):
        token_counts([[4]], 4)


def test_repetition_penalty_sees_prompt_and_generated_once_each():
    params = [SamplingParams(repetition_penalty=2.0)]
    t = Sampler.tensors(params, generated=[[1, 1]], prompts=[[0]], vocab_size=4)
    assert adjust_logits(row(2, 2, 2, -2), t).tolist() == [[1.0, 1.0, 2.0, -2.0]]


def test_presence_frequency_see_generated_tokens_only():
    params = [SamplingParams(presence_penalty=1.0, frequency_penalty=0.5)]
    t = Sampler.tensors(params, generated=[[1, 1, 2]], prompts=[[0, 0]], vocab_size=4)
    # token 0 is only in the prompt: untouched; 1: -1 - 2*0.5; 2: -1 - 0.5
    assert adjust_logits(torch.zeros(1, 4), t).tolist() == [[0.0, -2.0, -1.5, 0.0]]


def test_logit_bias_through_params():
    params = [SamplingParams(logit_bias={2: 3.0, 0: -1.5}), SamplingParams()]
    t = Sampler.tensors(params, generated=[[], []], prompts=None, vocab_size=3)
    assert adjust_logits(torch.zeros(2, 3), t).tolist() == [[-1.5, 0.0, 3.0], [0.0, 0.0, 0.0]]
    # a large bias decides a greedy step
    out = Sampler().sample(row(5, 1, 1), [SamplingParams(temperature=0, logit_bias={2: 10})], [[]])
    assert out.token_ids == [2]


# ---------------------------------------------------------------------------------------------
# Order of operations: each case gives a different answer under the neighbouring order
# ---------------------------------------------------------------------------------------------


def test_order_bias_before_repetition_penalty():
    # bias then penalty: (2 + 2) / 2 = 2; penalty then bias would give 2 / 2 + 2 = 3
    p = SamplingParams(temperature=0, logit_bias={0: 2.0}, repetition_penalty=2.0, logprobs=True)
    t = Sampler.tensors([p], generated=[[0]], prompts=None, vocab_size=2)
    assert adjust_logits(row(2, 2.5), t).tolist() == [[2.0, 2.5]]
    out = Sampler().sample(row(2, 2.5), [p], [[0]])
    assert out.token_ids == [1]  # token 0 would win (3 > 2.5) in the other order
    assert out.logprobs[0] == pytest.approx(row(2, 2.5).log_softmax(-1)[0, 1].item())


def test_order_repetition_before_presence():
    # 4 / 2 - 1 = 1; presence first would give (4 - 1) / 2 = 1.5
    p = SamplingParams(repetition_penalty=2.0, presence_penalty=1.0)
    t = Sampler.tensors([p], generated=[[0]], prompts=None, vocab_size=2)
    assert adjust_logits(row(4, 0), t).tolist() == [[1.0, 0.0]]


def test_order_penalties_before_top_k():
    # presence 2 turns [3, 2, 0] into [1, 2, 0]; top_k=1 then keeps token 1 only.
    # top-k first would keep token 0 only.
    p = SamplingParams(temperature=1.0, top_k=1, presence_penalty=2.0)
    sampler = Sampler()
    for seed in range(20):
        out = sampler.sample(row(3, 2, 0), [p], [[0]], generators=[seeded(seed)])
        assert out.token_ids == [1]


def test_order_top_k_before_top_p():
    # probs [0.4, 0.3, 0.2, 0.1], k=2, p=0.5. top-k, renormalise: [0.571, 0.429] -> top-p keeps {0}.
    # top-p first would keep {0, 1} (mass before token 1 is 0.4 < 0.5), then top-k keeps both.
    logits = log_probs_row(0.4, 0.3, 0.2, 0.1)
    p = SamplingParams(top_k=2, top_p=0.5)
    t = Sampler.tensors([p], [[]], None, 4)
    assert kept(filter_logits(logits, t)) == {0}
    assert draws(logits, p) == {0}


def test_order_top_p_before_min_p():
    # probs [0.5, 0.3, 0.2], top_p 0.6, min_p 0.5. top-p keeps {0, 1}; min-p (0.25) keeps both.
    # min-p first would keep {0, 1} renormalised to [0.625, 0.375], then top-p 0.6 keeps {0}.
    logits = log_probs_row(0.5, 0.3, 0.2)
    p = SamplingParams(top_p=0.6, min_p=0.5)
    t = Sampler.tensors([p], [[]], None, 3)
    assert kept(filter_logits(logits, t)) == {0, 1}
    assert draws(logits, p) == {0, 1}


def test_order_top_p_before_temperature():
    # top_p 0.5 at T=1 keeps {0} of [0.6, 0.3, 0.1]; at T=100 first the probs are ~1/3 each and
    # the nucleus would hold two tokens.
    logits = log_probs_row(0.6, 0.3, 0.1)
    assert draws(logits, SamplingParams(temperature=100.0, top_p=0.5)) == {0}


def test_order_min_p_before_temperature():
    # min_p 0.5 at T=1 keeps {0, 1} of [0.5, 0.3, 0.2] (0.3 >= 0.25); at T=0.5 first the ratio
    # 0.3/0.5 becomes 0.36 < 0.5 and only token 0 would survive.
    logits = log_probs_row(0.5, 0.3, 0.2)
    assert draws(logits, SamplingParams(temperature=0.5, min_p=0.5)) == {0, 1}


# ---------------------------------------------------------------------------------------------
# Greedy, sampling distribution, seeds
# ---------------------------------------------------------------------------------------------


def test_greedy_ties_go_to_the_lowest_id():
    out = Sampler().sample(row(1, 3, 3, 2), [SamplingParams(temperature=0)], [[]])
    assert out.token_ids == [1]
    assert sample(row(-INF, 0, 0), one(0.0)).tolist() == [1]


def test_greedy_rows_draw_no_randomness():
    gen = seeded(7)
    state = gen.get_state()
    Sampler().sample(row(1, 2, 3), [SamplingParams(temperature=0, seed=7)], [[]], generators=[gen])
    assert torch.equal(gen.get_state(), state)


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs.double() * counts.sum()
    return float(((counts.double() - expected) ** 2 / expected).sum())


CHI2_0999_5DOF = 20.52
SIX_LOGITS = (0.0, 0.5, 1.0, -0.5, 1.5, 0.2)


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_sampling_follows_softmax_chi_square(temperature):
    n = 20000
    logits = row(*SIX_LOGITS).expand(n, -1).contiguous()  # [n, 6]
    gen = seeded(1234)  # one generator shared by every row: n draws in row order
    params = [SamplingParams(temperature=temperature)] * n
    out = Sampler().sample(logits, params, [[]] * n, generators=[gen] * n)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=6)
    probs = (row(*SIX_LOGITS)[0] / temperature).softmax(-1)
    assert chi_square(counts, probs) < CHI2_0999_5DOF
    # and the test has power: the T=1 counts are far from the T=0.5 distribution and back
    other = (row(*SIX_LOGITS)[0] / (1.5 - temperature)).softmax(-1)
    assert chi_square(counts, other) > 10 * CHI2_0999_5DOF


def generate(seed: int, steps: int = 24, vocab: int = 50) -> list[int]:
    """A seeded multi-step run with a persistent generator and growing history."""
    logits = torch.linspace(-1, 1, vocab)[None]  # [1, V], fairly flat
    params = SamplingParams(temperature=1.0, top_k=40, repetition_penalty=1.1, seed=seed)
    gen = Sampler.make_generator(params)
    sampler, history = Sampler(), []
    for _ in range(steps):
        history.append(sampler.sample(logits, [params], [history], [[3, 4]], [gen]).token_ids[0])
    return history


def test_seeded_sampling_is_reproducible_in_process():
    a, b = generate(seed=42), generate(seed=42)
    assert a == b
    assert generate(seed=43) != a
    assert len(set(a)) > 5  # it did sample, not repeat one token


def test_seeded_sampling_is_reproducible_across_processes():
    # a fresh interpreter loads this file and runs the same generate(42)
    script = (
        "import importlib.util, json\n"
        f"spec = importlib.util.spec_from_file_location('sampling_case', {str(Path(__file__))!r})\n"
        "mod = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(mod)\n"
        "print(json.dumps(mod.generate(42)))\n"
    )
    env = dict(os.environ, PYTHONPATH=str(SRC))
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) == generate(42)


@pytest.mark.parametrize("a, b", [(1, 2**32 + 1), (2**63, -(2**63)), (-1, 2**64 - 1), (0, 2**32)])
def test_distinct_seeds_give_distinct_streams(a, b):
    # torch's CPU generator keeps only the low 32 bits of a seed: these pairs used to collide
    assert generate(seed=a) != generate(seed=b)
    sa, sb = SeedStream(a), SeedStream(b)
    assert [sa.uniform() for _ in range(4)] != [sb.uniform() for _ in range(4)]


def test_seed_stream_is_uniform_and_replayable():
    s = SeedStream(123)
    u = torch.tensor([s.uniform() for _ in range(20000)], dtype=torch.float64)
    assert 0 <= float(u.min()) and float(u.max()) < 1
    counts = torch.histc(u, bins=10, min=0, max=1)
    assert chi_square(counts, torch.full((10,), 0.1)) < 27.88  # chi-square 0.999, 9 dof
    s.set_state(5)
    again = SeedStream(123)
    assert [again.uniform() for _ in range(7)][5:] == [s.uniform(), s.uniform()]
    with pytest.raises(InvalidParameter):
        SeedStream(2**64)


def test_seed_gives_same_tokens_whatever_else_is_in_the_batch():
    logits = torch.linspace(-1, 1, 50)[None]
    p = SamplingParams(seed=5)
    alone = Sampler().sample(logits, [p], [[]]).token_ids[0]
    batch = logits.expand(3, -1).contiguous()
    others = [SamplingParams(), p, SamplingParams(temperature=0)]
    assert Sampler().sample(batch, others, [[]] * 3).token_ids[1] == alone


def test_batched_rows_with_mixed_params_match_each_row_alone():
    torch.manual_seed(0)
    vocab, steps = 32, 6
    params = [
        SamplingParams(temperature=0, repetition_penalty=1.3, logprobs=True, top_logprobs=3),
        SamplingParams(temperature=0.7, top_k=5, seed=1, logprobs=True),
        SamplingParams(temperature=1.2, top_p=0.8, min_p=0.05, presence_penalty=0.5, seed=2),
        SamplingParams(temperature=1.0, frequency_penalty=0.4, logit_bias={3: 2.0}, seed=3,
                       logprobs=True, top_logprobs=5),
    ]
    prompts = [[1, 2], [3], [], [4, 4, 5]]
    logits = [torch.randn(len(params), vocab) * 2 for _ in range(steps)]  # per step [B, V]
    sampler = Sampler()

    batch_gens = [Sampler.make_generator(p) for p in params]
    batch_hist = [[] for _ in params]
    batch_out = []
    for step in range(steps):
        out = sampler.sample(logits[step], params, batch_hist, prompts, batch_gens)
        for h, tok in zip(batch_hist, out.token_ids):
            h.append(tok)
        batch_out.append(out)

    for b, p in enumerate(params):
        gen, hist = [Sampler.make_generator(p)], []
        for step in range(steps):
            out = sampler.sample(logits[step][b : b + 1], [p], [hist], [prompts[b]], gen)
            hist.append(out.token_ids[0])
            if p.logprobs:
                assert out.logprobs[0] == pytest.approx(batch_out[step].logprobs[b], abs=1e-6)
                want = batch_out[step].top_logprobs[b]
                assert [t for t, _ in out.top_logprobs[0]] == [t for t, _ in want]
        assert hist == batch_hist[b], f"row {b}"


# ---------------------------------------------------------------------------------------------
# Logprobs
# ---------------------------------------------------------------------------------------------


def test_logprobs_come_after_penalties_before_filters_and_temperature():
    logits = row(1, 2, 3, 4)
    p = SamplingParams(temperature=0.5, top_k=1, presence_penalty=1.0, logprobs=True,
                       top_logprobs=3)
    out = Sampler().sample(logits, [p], [[3]], generators=[seeded(0)])
    adjusted = row(1, 2, 3, 3)  # presence on token 3; top_k and T do not enter
    expected = adjusted.log_softmax(-1)[0]
    assert out.token_ids == [2]  # top_k=1 keeps the lowest id of the tie
    assert out.logprobs[0] == pytest.approx(expected[2].item())
    # descending, ties to the lowest id
    assert [t for t, _ in out.top_logprobs[0]] == [2, 3, 1]
    assert [v for _, v in out.top_logprobs[0]] == pytest.approx(expected[[2, 3, 1]].tolist())


def test_logprobs_shapes_per_row():
    batch = torch.zeros(3, 8)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0, logprobs=True),
              SamplingParams(temperature=0, logprobs=True, top_logprobs=20)]
    out = Sampler().sample(batch, params, [[]] * 3)
    assert out.logprobs == pytest.approx([math.log(1 / 8)] * 3)
    assert [len(t) for t in out.top_logprobs] == [0, 0, 8]  # 20 > V: the whole vocabulary
    none = Sampler().sample(batch, [SamplingParams(temperature=0)] * 3, [[]] * 3)
    assert none == SampleOutput([0, 0, 0], None, None)


# ---------------------------------------------------------------------------------------------
# SamplingParams
# ---------------------------------------------------------------------------------------------


def test_params_are_normalised_frozen_and_hashable():
    p = SamplingParams(stop="</s>", stop_token_ids=[1, 2], logit_bias={5: 1, 2: -1.0})
    assert p.stop == ("</s>",)
    assert p.stop_token_ids == (1, 2)
    assert p.logit_bias == ((2, -1.0), (5, 1.0))
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert hash(p) == hash(dataclasses.replace(p))
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 0.5  # type: ignore[misc]
    assert SamplingParams(temperature=0).greedy and not SamplingParams().greedy


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": float("inf")}, "presence_penalty"),
        ({"frequency_penalty": "1"}, "frequency_penalty"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2.0}, "max_tokens"),
        ({"seed": "1"}, "seed"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"top_logprobs": -1, "logprobs": True}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),  # needs logprobs=True
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"logit_bias": {5: float("nan")}}, "logit_bias"),
        ({"stop": [""]}, "stop"),
        ({"stop": [1]}, "stop"),
        ({"stop_token_ids": [-3]}, "stop_token_ids"),
        ({"ignore_eos": 1}, "ignore_eos"),
        # bounds that keep every value inside what the engine thread can hold (issue 12)
        ({"top_k": 2**63}, "top_k"),  # overflowed torch's int64 in the engine thread
        ({"top_k": 10**30}, "top_k"),
        ({"top_k": 2**31}, "top_k"),
        ({"temperature": 10**400}, "temperature"),  # an int beyond float's range
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -1e30}, "frequency_penalty"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"seed": 2**64}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"seed": True}, "seed"),
        ({"logit_bias": {5: 100.5}}, "logit_bias"),
        ({"logit_bias": {5: -1e30}}, "logit_bias"),
        ({"logit_bias": {2**40: 1.0}}, "logit_bias"),
        ({"logit_bias": {i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}}, "logit_bias"),
        ({"stop_token_ids": [2**63]}, "stop_token_ids"),
        # bounds on the per-token work of stop matching (issue 34)
        ({"stop": ["x"] * (MAX_STOP_STRINGS + 1)}, "stop"),
        ({"stop": ["x" * (MAX_STOP_CHARS + 1)]}, "stop"),
        ({"stop_token_ids": list(range(MAX_STOP_TOKEN_IDS + 1))}, "stop_token_ids"),
    ],
)
def test_params_validation_names_the_field(kwargs, field):
    with pytest.raises(InvalidParameter, match=rf"SamplingParams\.{field}\b") as info:
        SamplingParams(**kwargs)
    assert info.value.param == field and isinstance(info.value, ValueError)


def test_params_at_their_bounds_are_accepted():
    SamplingParams(top_k=2**31 - 1, presence_penalty=-2, frequency_penalty=2, seed=2**64 - 1)
    SamplingParams(seed=-(2**63), logit_bias={i: (-100 if i % 2 else 100) for i in range(MAX_LOGIT_BIAS)})
    SamplingParams(repetition_penalty=1e-300, temperature=1e-300)
    SamplingParams(stop=["x" * MAX_STOP_CHARS] * MAX_STOP_STRINGS, stop_token_ids=range(MAX_STOP_TOKEN_IDS))


def test_error_for_a_huge_int_is_short():
    with pytest.raises(InvalidParameter, match=r"an integer of 16610 bits") as info:
        SamplingParams(seed=10**5000)  # repr() of an int over 4300 digits raises in Python itself
    assert len(str(info.value)) < 200


def test_extreme_valid_params_give_finite_numbers():
    logits = torch.tensor([[3.0, -2.0, 0.5, 8.0, -30.0]])  # [1, V]
    cases = [
        SamplingParams(repetition_penalty=1e-300, logprobs=True, top_logprobs=5, seed=1),  # was NaN
        SamplingParams(repetition_penalty=1e300, logprobs=True, top_logprobs=5, seed=1),
        SamplingParams(repetition_penalty=1e-30, temperature=1e-4, logprobs=True, top_logprobs=5),
        SamplingParams(temperature=1e300, logit_bias={1: 100.0}, logprobs=True, top_logprobs=5, seed=2),
        SamplingParams(presence_penalty=-2, frequency_penalty=-2, top_k=2**31 - 1, logprobs=True, seed=3),
    ]
    for p in cases:
        out = Sampler().sample(logits, [p], [[0, 3, 3, 4]], [[1, 2, 3, 4]])
        assert 0 <= out.token_ids[0] < 5
        assert math.isfinite(out.logprobs[0]), p
        assert all(math.isfinite(v) for _, v in out.top_logprobs[0]), p


@pytest.mark.parametrize("temperature", [1e-40, 1e-6, 0.0])
def test_temperatures_below_1e_5_are_greedy(temperature):
    # 1e-40: logits / T overflowed float32 and the softmax was NaN
    logits = torch.tensor([[3.0, 7.0, 6.9, -1.0]])
    p = SamplingParams(temperature=temperature, seed=4)
    assert p.greedy
    assert {Sampler().sample(logits, [p], [[]]).token_ids[0] for _ in range(5)} == {1}
    assert not SamplingParams(temperature=1e-5).greedy


def test_sampler_rejects_bad_inputs():
    sampler = Sampler()
    with pytest.raises(ValueError, match="logit_bias"):
        sampler.sample(row(0, 0), [SamplingParams(logit_bias={2: 1.0})], [[]])
    with pytest.raises(ValueError, match="generated"):
        sampler.sample(torch.zeros(2, 3), [SamplingParams()] * 2, [[]])
    with pytest.raises(ValueError, match="outside"):
        sampler.sample(row(0, 0), [SamplingParams(presence_penalty=1.0)], [[7]])
