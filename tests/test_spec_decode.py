"""Speculative decoding through the engine (issue 16): decode steps carry drafts, verified in one forward by
exact rejection sampling, the rejected rows written over later. A request's tokens must be the ones plain
decoding gives: greedy on all four tiny variants, float32 and the fast mode, with the sliding window (8)
wrapping inside verified steps; seeded sampling draws the same tokens in the fast mode (its verification
rows take the decode kernels, bit for bit)."""
from __future__ import annotations

import pytest
import torch

import gem4
from gem4 import Engine, SamplingParams
from gem4.engine.speculative import SpeculativeConfig
from test_engine import wait_idle

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def load(fx, dtype):
    return gem4.load(fx.gguf["q8_0"] if dtype == "bfloat16" else fx.hf_causal, dtype=dtype)


def tokens(engine, prompt, params):
    return [(e.token_id, e.logprob) for e in engine.generate(prompt, params)]


class Oracle:
    """A drafter that knows the plain run's continuation: it proposes the right tokens, except that every
    `wrong`-th draft is replaced by a wrong one (so steps accept some drafts and reject the rest)."""

    def __init__(self, continuation: dict[tuple[int, ...], list[int]], k: int, wrong: int = 0):
        self.continuation, self.num_speculative_tokens, self.wrong, self.calls = continuation, k, wrong, 0

    def propose(self, tokens, max_drafts):
        for prompt, out in self.continuation.items():
            n = len(prompt)
            if tuple(tokens[:n]) == prompt:
                drafts = out[len(tokens) - n:len(tokens) - n + max_drafts]
                self.calls += 1
                if self.wrong and self.calls % self.wrong == 0 and drafts:
                    drafts = drafts[:-1] + [(drafts[-1] + 1) % 512]
                return drafts
        return []


def with_drafter(model, drafter, **kw):
    engine = Engine(model, prefill_chunk=8, speculative_config={"method": "ngram",
                                                                  "num_speculative_tokens": drafter.num_speculative_tokens},
                    **kw)
    engine._runner.drafter = drafter
    return engine


@pytest.mark.parametrize("dtype, kv", [("float32", "auto"), ("bfloat16", "auto"), ("bfloat16", "int8"),
                                       ("bfloat16", "fp8_e4m3")])
@pytest.mark.parametrize("name", ["ple_kvshare", "dense_keqv", "dense_plain", "moe"])
def test_greedy_tokens_equal_plain_decoding(variants, name, dtype, kv):
    """Speculation gives plain decoding's tokens (and in the fast mode its logprobs, bit for bit), with the same KV
    cache dtype: a rejected draft's K/V rows (quantized, with an 8-bit cache) are overwritten when their positions
    are computed again."""
    fx = variants[name]
    model = load(fx, dtype)
    params = SamplingParams(temperature=0, max_tokens=30, logprobs=True)
    prompts = [fx.ids[:20] + fx.ids[:20], fx.ids[5:17]]          # a repeated prompt: prompt lookup finds drafts
    plain = [tokens(Engine(model, prefill_chunk=8, kv_cache_dtype=kv), p, params) for p in prompts]
    # prompt lookup, one request after another, then both at once
    engine = Engine(model, prefill_chunk=8, max_num_seqs=2, speculative_config=NGRAM, kv_cache_dtype=kv)
    for p, want in zip(prompts, plain):
        got = tokens(engine, p, params)
        assert [t for t, _ in got] == [t for t, _ in want]
    streams = [engine.submit(p, params) for p in prompts]
    assert [[e.token_id for e in s] for s in streams] == [[t for t, _ in w] for w in plain]
    assert engine.spec_drafts > 0 and engine.spec_draft_tokens > engine.spec_accepted_tokens > 0
    # a drafter that is mostly right: whole verified steps accepted, the window wrapping inside them
    oracle = Oracle({tuple(p): [t for t, _ in w] for p, w in zip(prompts, plain)}, k=4, wrong=3)
    engine = with_drafter(model, oracle, kv_cache_dtype=kv)
    for p, want in zip(prompts, plain):
        got = tokens(engine, p, params)
        assert [t for t, _ in got] == [t for t, _ in want]
        if dtype == "bfloat16":                                  # the decode kernels, bit for bit
            assert got == want
        else:
            assert [lp for _, lp in got] == pytest.approx([lp for _, lp in want], rel=1e-5, abs=1e-6)
    assert engine.spec_accepted_tokens > engine.spec_drafts         # several drafts accepted per step
    assert engine.spec_accepted_per_position[3] > 0 and engine.spec_draft_tokens > engine.spec_accepted_tokens
    wait_idle(engine)
    assert engine.kv_cache_usage == 0


def test_seeded_sampling_draws_the_plain_tokens(variants):
    fx = variants["dense_keqv"]
    model = load(fx, "bfloat16")
    params = SamplingParams(temperature=0.9, seed=21, max_tokens=40, logprobs=True)
    prompt = fx.ids[:24]
    want = tokens(Engine(model, prefill_chunk=8), prompt, params)
    oracle = Oracle({tuple(prompt): [t for t, _ in want]}, k=5, wrong=4)
    engine = with_drafter(model, oracle)
    assert tokens(engine, prompt, params) == want
    assert engine.spec_accepted_tokens > 10


def test_stop_inside_accepted_drafts_and_max_tokens(variants, tmp_path):
    """A request that ends inside a verified step keeps the tokens up to its end (max_tokens, an end token),
    and its cache is given back."""
    fx = variants["dense_plain"]
    model = load(fx, "float32")
    prompt = fx.ids[:16]
    full = [e.token_id for e in Engine(model, prefill_chunk=8).generate(prompt, SamplingParams(temperature=0,
                                                                                               max_tokens=20))]
    oracle = Oracle({tuple(prompt): full}, k=6)
    engine = with_drafter(model, oracle)
    for n in (1, 2, 7, 9):
        events = list(engine.generate(prompt, SamplingParams(temperature=0, max_tokens=n)))
        assert [e.token_id for e in events] == full[:n] and events[-1].finish_reason == "length"
        assert [e.completion_tokens for e in events] == list(range(1, n + 1))
    stop = full[5]
    events = list(engine.generate(prompt, SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop])))
    assert [e.token_id for e in events] == full[:full.index(stop) + 1] and events[-1].finish_reason == "stop"
    wait_idle(engine)
    assert engine.kv_cache_usage == 0


@pytest.mark.parametrize("k", [1, 3, 7])
def test_drafts_that_keep_missing_back_off(variants, k):
    """A drafter that is always wrong: the output is still plain decoding's, and the sequence drafts less
    (K, then half as many, then one) and less often (after the second miss in a row 1, 4, 16, 64 steps without
    drafts), so verification rounds are few and cheap; a right draft ends the back-off."""
    fx = variants["dense_plain"]
    model = load(fx, "float32")
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    prompt = fx.ids[:16]
    want = [e.token_id for e in Engine(model, prefill_chunk=8).generate(prompt, params)]
    wrong = Oracle({tuple(prompt): [(t + 1) % 512 for t in want]}, k=k)
    engine = with_drafter(model, wrong)
    assert [e.token_id for e in engine.generate(prompt, params)] == want
    # 127 decode steps: rounds at steps 1, 2, 4, 9, 26 and 91 (after 0, 1, 4, 16 and 64 plain steps; the next
    # would be at 156), of K, max(1, K // 2), 1, 1, 1, 1 drafts
    assert engine.spec_drafts == 6 and engine.spec_accepted_tokens == 0
    assert engine.spec_draft_tokens == k + max(1, k // 2) + 4
    # every 5th round's last draft wrong: never two misses in a row, so no pause: every decode step drafts
    # but the last (max_tokens leaves no room); the 2 prefill steps draft nothing
    right = Oracle({tuple(prompt): want}, k=k, wrong=5)
    engine = with_drafter(model, right)
    assert [e.token_id for e in engine.generate(prompt, params)] == want
    assert engine.steps - 2 - engine.spec_drafts <= 1 and engine.spec_accepted_tokens > engine.spec_drafts // 2


def test_draft_count_shrinks_after_a_miss_and_grows_back_after_a_hit():
    """The rule of Sequence.record_drafts on a scripted run, scheduler only: a round that accepts nothing
    halves the next round's drafts (at least 1) and, from the second such round in a row, pauses drafting
    1, 4, ... steps; a round that accepts any draft (all of them or some) brings back K drafts at once."""
    from gem4.engine.scheduler import Scheduler
    from gem4.engine.sequence import Sequence
    from gem4.kv_cache import BlockManager

    sched = Scheduler(BlockManager(num_blocks=16, block_size=16, num_sliding_blocks=16, window=4), max_chunk=8,
                      max_num_batched_tokens=8, num_speculative_tokens=7)
    seq = Sequence("r", list(range(4)), SamplingParams(temperature=0), max_tokens=200, end_ids=())
    sched.add(seq)
    sched.postprocess(sched.schedule(), [[1]], 0.0)                      # the prompt, and the first token
    accepted = iter([0, 0, 0, 1, 3, 0, 0, 1, 0, 0])                         # per round: drafts accepted
    slots = []
    while len(slots) < 16:
        batch = sched.schedule()
        (chunk,) = batch.chunks
        slots.append(chunk.draft_slots)
        a = next(accepted) if chunk.draft_slots else 0
        sched.postprocess(batch, [[1] * (a + 1)], 0.0)
        if chunk.draft_slots:
            seq.record_drafts(chunk.draft_slots, a)
    # drafts per decode step, and the round's outcome:
    #        miss miss pause miss  4 paused  all  3 of 7 miss miss pause all miss miss
    assert slots == [7, 3, 0, 1, 0, 0, 0, 0, 1, 7, 7, 3, 0, 1, 7, 3]
    assert (seq.draft_misses, seq.draft_pause, seq.draft_limit) == (2, 1, 1)
    assert seq.num_draft_tokens == 7 + 3 + 1 + 1 + 7 + 7 + 3 + 1 + 7 + 3 and seq.num_accepted_tokens == 1 + 3 + 1


def test_speculative_config_is_checked():
    assert SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}').ngram().prompt_lookup_max == 5
    for bad, message in [({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of"),
                         ({"method": "ngram", "num_speculative_tokens": 8}, r"\[1, 7\]"),
                         ({"method": "ngram"}, "num_speculative_tokens"),
                         ({"method": "mtp", "num_speculative_tokens": 2}, "needs 'model'"),
                         ({"method": "ngram", "num_speculative_tokens": 2, "speed": 1}, "unknown field"),
                         ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
                           "prompt_lookup_max": 2}, "prompt_lookup_min=4"),
                         ("{not json", "not JSON")]:
        with pytest.raises(ValueError, match=message):
            SpeculativeConfig.parse(bad)


# ---- the Gemma 4 assistant (method "mtp") ----

@pytest.fixture(scope="module")
def assistant_dirs(tmp_path_factory):
    from test_assistant import build_assistant

    root = tmp_path_factory.mktemp("mtp")
    for name in ("ple_kvshare", "dense_keqv", "dense_plain", "moe"):
        build_assistant(name, root / name)
    return root


def mtp(assistant_dirs, name, k=3):
    return {"method": "mtp", "model": str(assistant_dirs / name), "num_speculative_tokens": k}


@pytest.mark.parametrize("dtype, kv", [("float32", "auto"), ("bfloat16", "auto"), ("bfloat16", "int8")])
@pytest.mark.parametrize("name", ["ple_kvshare", "dense_keqv", "dense_plain", "moe"])
def test_mtp_greedy_tokens_equal_plain_decoding(variants, assistant_dirs, name, dtype, kv):
    """The assistant's drafts, verified, give plain decoding's tokens (the fast mode: and logprobs, bit for bit); also
    with an int8 cache, whose rows and scales the assistant's attention reads as the target's layers do."""
    fx = variants[name]
    model = load(fx, dtype)
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=True)
    prompts = [fx.ids[:20], fx.ids[7:40]]
    plain = [tokens(Engine(model, prefill_chunk=8, kv_cache_dtype=kv), p, params) for p in prompts]
    engine = Engine(model, prefill_chunk=8, max_num_seqs=2, speculative_config=mtp(assistant_dirs, name),
                    kv_cache_dtype=kv)
    assert engine.speculative_config.method == "mtp"
    streams = [engine.submit(p, params) for p in prompts]             # both drafted in one assistant batch
    got = [[(e.token_id, e.logprob) for e in s] for s in streams]
    assert [[t for t, _ in g] for g in got] == [[t for t, _ in w] for w in plain]
    if dtype == "bfloat16":
        assert got == plain
    assert engine.spec_drafts > 0 and engine.spec_draft_tokens >= engine.spec_drafts
    wait_idle(engine)
    assert engine.kv_cache_usage == 0 and not engine._runner.drafter._hidden


def test_mtp_drafts_start_from_the_row_that_chose_the_last_token(variants, assistant_dirs):
    """Each engine draft equals the assistant's draft from a fresh prefill of the tokens before it: the
    hidden state kept after a verification is that of the row that predicted the final token, and the
    sliding rows the assistant reads (two more than the target's window) are still held."""
    from gem4.model.assistant import DraftSeq, draft_view

    fx = variants["ple_kvshare"]
    model = load(fx, "float32")
    engine = Engine(model, prefill_chunk=8, speculative_config=mtp(assistant_dirs, "ple_kvshare", k=4))
    drafter, calls = engine._runner.drafter, []
    real = drafter.draft
    greedy = SamplingParams(temperature=0, max_tokens=30)
    oracle = Oracle({tuple(fx.ids[:12]): [t for t, _ in tokens(Engine(model, prefill_chunk=8), fx.ids[:12], greedy)]},
                    k=4, wrong=3)

    def draft(chunks):
        # record what the assistant drafts from the engine's state, but verify the oracle's drafts, so that
        # rounds accept several drafts and the next state is a later row's (random weights accept none)
        out = real(chunks)
        calls.extend((list(c.seq.token_ids[:c.start + 1]), d) for c, d in zip(chunks, out))
        return [oracle.propose(c.seq.token_ids, c.draft_slots) for c in chunks]

    drafter.draft = draft
    list(engine.generate(fx.ids[:12], greedy))
    assert len(calls) > 3 and engine.spec_accepted_tokens > engine.spec_drafts
    assistant = drafter.assistant
    for seq_tokens, got in calls:
        p = len(seq_tokens) - 1                                        # the drafted-from token sits at p
        cache = model.new_cache()
        _, h = model.forward(torch.tensor(seq_tokens[:p]), cache.step(p), cache.pool, hidden=True)
        cache.commit(p)
        view = draft_view(cache.pool, [DraftSeq(p, cache.block_table, cache.sliding_table)])
        want = assistant.draft(model, torch.tensor(seq_tokens[p:]), h[-1:], view, cache.pool, len(got)).tokens
        assert want[0].tolist() == got, p
