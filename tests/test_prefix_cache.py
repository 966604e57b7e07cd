"""The prefix cache through the engine: a request that starts with cached tokens computes only the rest and
gets exactly what a cold run gets -- greedy tokens, seeded samples and their logprobs -- on all four tiny
variants (E2B-like PLE + KV sharing, k_eq_v, plain dense, MoE), float32 and the fast mode.

The fixtures' sliding window is 8; the engines here use blocks of 4, so a hit's window spans two or three
blocks and the split points below fall inside the first window, on block boundaries, inside a block and
past the window."""
from __future__ import annotations

import dataclasses
import functools

import pytest

import gem4
from gem4 import Engine, SamplingParams
from gem4.engine.pool import kv_pool_size
from model_fixtures import prompt_ids
from test_engine import wait_idle

GREEDY = SamplingParams(temperature=0, max_tokens=6, logprobs=True, top_logprobs=3)
SEEDED = SamplingParams(temperature=1.0, seed=11, max_tokens=6, logprobs=True, top_logprobs=3)


def load(fx, dtype):
    return gem4.load(fx.gguf["q8_0"] if dtype == "bfloat16" else fx.hf_causal, dtype=dtype)


def outputs(events) -> list[tuple[int, float, list]]:
    return [(e.token_id, e.logprob, e.top_logprobs) for e in events]


def cold(model, prompt, params=GREEDY, kv="auto"):
    return outputs(Engine(model, prefill_chunk=8, block_size=4, enable_prefix_caching=False,
                          kv_cache_dtype=kv).generate(prompt, params))


def same(got, want, dtype, generated=False, tol=5e-2):
    """Tokens equal; logprobs equal to float32's rounding (a hit computes its rows in other chunks than the
    cold run, and float32 GEMMs of other shapes round differently in the last bits), bit for bit in the fast
    mode (its kernels are row-invariant and each position is computed by the kernels of its kind: runner.py).
    `generated`: the hit holds generated tokens, which the fast mode computed with its decode kernels (int8
    activations on these Q8_0 files) where a cold run computes them as prompt tokens (bf16): every logprob
    within 5e-2, alternatives may trade places where their logprobs are that close, and so may the chosen
    token -- a near-tie (within 5e-2 of the cold run's choice), after which the two paths part and are not
    compared (which near-ties flip depends on the CPU's kernels: AMX or not). `tol`: that 5e-2, or more where an
    8-bit cache stores those slightly different K/V (test_a_hit_at_any_split_gives_the_cold_output)."""
    if dtype == "bfloat16" and generated:
        for (t, lp, top), (t0, lp0, top0) in zip(got, want):
            if t != t0:
                return t in dict(top0) and lp0 - dict(top0)[t] <= tol
            near = [abs(v - dict(top0)[i]) <= tol for i, v in top if i in dict(top0)]
            if abs(lp - lp0) > tol or not all(near):
                return False
        return len(got) == len(want)
    floats = [x for _, lp, top in got for x in (lp, *(v for _, v in top))]
    ref = [x for _, lp, top in want for x in (lp, *(v for _, v in top))]
    if [(t, [i for i, _ in top]) for t, _, top in got] != [(t, [i for i, _ in top]) for t, _, top in want]:
        return False
    return floats == (ref if dtype == "bfloat16" else pytest.approx(ref, rel=1e-5, abs=1e-6))


def last_event(engine, prompt, params):
    events = list(engine.generate(prompt, params))
    return outputs(events), events[-1]


@pytest.mark.parametrize("dtype, kv", [("float32", "auto"), ("bfloat16", "auto"), ("bfloat16", "int8"),
                                       ("bfloat16", "fp8_e4m3")])
@pytest.mark.parametrize("name", ["ple_kvshare", "dense_keqv", "dense_plain", "moe"])
def test_a_hit_at_any_split_gives_the_cold_output(variants, name, dtype, kv):
    """A hit at any split gives what a cold run with the same KV cache dtype gives (`same`); with an 8-bit cache
    too: a row is quantized once, when its position is written, so a hit reads the bits a cold run writes."""
    fx = variants[name]
    model = load(fx, dtype)
    cold_kv = functools.partial(cold, kv=kv)
    base = fx.ids[:40]
    other = prompt_ids(12, seed=99)[1:]
    # 4 seats: sliding blocks for 4 running windows and 4 cached ones, enough to keep every sliding part of
    # the base sequence (12 blocks; with 1 seat the parts of its first blocks would be evicted, see below)
    engine = Engine(model, prefill_chunk=8, block_size=4, max_num_seqs=4, kv_cache_dtype=kv)
    first, end = last_event(engine, base, GREEDY)
    assert same(first, cold_kv(model, base), dtype) and end.stats.cached_tokens == 0
    generated = [t for t, _, _ in first]
    # seeded sampling after a hit draws what a cold start with the same seed draws
    got, end = last_event(engine, base[:30] + other, SEEDED)
    assert end.stats.cached_tokens == 30 and same(got, cold_kv(model, base[:30] + other, SEEDED), dtype)
    for split in (3, 8, 13, 24, 39):              # in the first window, block boundaries, mid-block, past it
        prompt = base[:split] + other
        got, end = last_event(engine, prompt, GREEDY)
        assert end.stats.cached_tokens == split and same(got, cold_kv(model, prompt), dtype), split
    # the whole cached conversation and a new turn: the generated tokens are cached too (but the last,
    # sampled and never computed)
    turn = base + generated + other
    got, end = last_event(engine, turn, GREEDY)
    assert end.stats.cached_tokens == len(base) + len(generated) - 1
    # (an 8-bit cache rounds the generated tokens' slightly different K/V to its own steps, and one value on the
    # other side of a rounding boundary moves it by a step, ~1/127 of its row's largest: measured up to 0.04 on the
    # dense variants, 0.4 on MoE, where a routing choice follows; the prompt-only hits above stay bit-exact)
    assert same(got, cold_kv(model, turn), dtype, generated=True, tol=5e-2 if kv == "auto" else 0.5)
    # the same prompt again: its last token is computed again for its logits
    got, end = last_event(engine, base, GREEDY)
    assert end.stats.cached_tokens == len(base) - 1 and same(got, first, dtype)
    wait_idle(engine)
    queries, hits = engine.prefix_cache_counts
    assert hits == 3 + 8 + 13 + 24 + 39 + (len(base) + len(generated) - 1) + (len(base) - 1) + 30
    assert engine.kv_cache_usage == 0


@pytest.mark.parametrize("name, dtype", [("ple_kvshare", "float32"), ("dense_keqv", "bfloat16"),
                                         ("moe", "float32")])
def test_requests_sharing_a_system_prompt_interleaved(variants, name, dtype):
    """Six requests with a common 21-token prefix: some at once (a running request's blocks are hit), some
    while others decode; each equals its cold output."""
    fx = variants[name]
    model = load(fx, dtype)
    system = fx.ids[:21]
    prompts = [system + prompt_ids(5 + i, seed=200 + i)[1:] for i in range(6)]
    want = [cold(model, p) for p in prompts]
    engine = Engine(model, prefill_chunk=8, block_size=4, max_num_seqs=3)
    streams = [engine.submit(prompts[0], GREEDY)]
    head = next(iter(streams[0]))                               # the first has its prefix computed
    streams += [engine.submit(p, GREEDY) for p in prompts[1:]]   # the rest arrive while it decodes
    got = [[e for e in s] for s in streams]
    got[0].insert(0, head)
    for g, w in zip(got, want):
        assert same(outputs(g), w, dtype)
    cached = [g[-1].stats.cached_tokens for g in got]
    assert cached[0] == 0 and all(c >= 20 for c in cached[1:])   # whole blocks, then the partial one
    wait_idle(engine)
    assert engine.kv_cache_usage == 0


def test_a_small_pool_evicts_and_every_output_stays_cold_exact(variants):
    """A pool that holds about two sequences: cached blocks and sliding parts are evicted (least recently
    used first) as new requests need room, and hits cut back to a complete window are still exact."""
    fx = variants["dense_plain"]
    model = gem4.load(fx.hf_causal, dtype="float32")
    size = kv_pool_size(model.config, model.dtype, max_chunk=8, num_seqs=2, max_model_len=64, prefix_caching=True,
                        block_size=4)
    budget = size.num_sliding_blocks * size.sliding_block_bytes + 24 * size.block_bytes   # 24 blocks: 96 positions
    engine = Engine(model, prefill_chunk=8, block_size=4, max_num_seqs=2, max_model_len=64, kv_cache_bytes=budget)
    assert engine.pool_size.num_blocks == 24
    prompts = [fx.ids[a:a + 30] for a in (0, 5, 0, 10, 5, 0, 15)]       # repeats after others evicted them
    want = {tuple(p): cold(model, p) for p in prompts}
    cached = []
    for i in range(0, len(prompts), 2):
        streams = [engine.submit(p, GREEDY) for p in prompts[i:i + 2]]
        for p, s in zip(prompts[i:i + 2], streams):
            events = list(s)
            assert same(outputs(events), want[tuple(p)], "float32")
            cached.append(events[-1].stats.cached_tokens)
    assert cached[2] == 29 and 0 in cached[3:]                  # a hit, then misses after evictions
    wait_idle(engine)
    assert engine.kv_cache_usage == 0 and engine._scheduler.blocks.cached_blocks <= 24


def test_an_aborted_prefill_leaves_its_computed_prefix_cached(variants):
    fx = variants["ple_kvshare"]
    model = gem4.load(fx.hf_causal, dtype="float32")
    engine = Engine(model, prefill_chunk=8, block_size=4)
    real, calls = engine._runner.run, []

    def run(batch):                               # abort the request after its second prefill chunk ran
        out = real(batch)
        calls.append(batch)
        if len(calls) == 2:
            engine.abort("long")
        return out

    engine._runner.run = run
    events = list(engine.generate(fx.ids, GREEDY, request_id="long"))
    assert [e.finish_reason for e in events] == ["abort"] and events[-1].completion_tokens == 0
    engine._runner.run = real
    got, end = last_event(engine, fx.ids, GREEDY)
    assert end.stats.cached_tokens == 16 and same(got, cold(model, fx.ids), "float32")


def test_caching_off_computes_every_prompt_token(variants):
    fx = variants["dense_plain"]
    model = gem4.load(fx.hf_causal, dtype="float32")
    engine = Engine(model, prefill_chunk=8, block_size=4, enable_prefix_caching=False)
    for _ in range(2):
        _, end = last_event(engine, fx.ids[:20], GREEDY)
        assert end.stats.cached_tokens == 0
    assert engine.prefix_cache_counts == (0, 0) and not engine.prefix_caching


def test_n_choices_after_a_hit(variants):
    """The parent of several choices takes the cached prefix; the choices fork off it as usual."""
    fx = variants["dense_plain"]
    model = gem4.load(fx.hf_causal, dtype="float32")
    engine = Engine(model, prefill_chunk=8, block_size=4, max_num_seqs=4)
    list(engine.generate(fx.ids[:30], GREEDY))
    params = dataclasses.replace(SEEDED, seed=5)
    events = list(engine.generate(fx.ids[:26] + [7, 8, 9], params, n=3))
    for i in range(3):
        mine = [e for e in events if e.index == i]
        want = cold(model, fx.ids[:26] + [7, 8, 9], dataclasses.replace(params, seed=5 + i))
        assert same(outputs(mine), want, "float32")
    assert {e.cached_tokens for e in events} == {26}                          # the request's, on every choice
    wait_idle(engine)
    assert engine.kv_cache_usage == 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("chunk", [6, 8])
def test_a_repeated_or_extended_prompt_reuses_all_of_it_at_any_length(variants, chunk, dtype):
    """Whatever step a request ends in -- the one that completes its prompt (max_tokens 1; a stop at the first
    token ends there too) or a decode step that fills a block -- everything it computed stays cached: the
    same prompt again reuses all but its last token (computed again for its logits), the prompt and a few
    more tokens reuse all of it. Prompt lengths on and off the chunk and block (4) boundaries, shorter and
    longer than the window (8); a chunk of 6 ends inside blocks."""
    fx = variants["ple_kvshare"]
    model = load(fx, dtype)
    extra = prompt_ids(4, seed=99)[1:]
    for max_tokens in (1, 2):
        params = dataclasses.replace(GREEDY, max_tokens=max_tokens, ignore_eos=True)
        for n in (2, 3, 4, 5, 7, 8, 9, 11, 12, 13, 16, 18, 23, 24, 31, 45):
            prompt = prompt_ids(n, seed=300 + n)
            longer = prompt + extra
            want, want_longer = cold(model, prompt, params), cold(model, longer, params)
            engine = Engine(model, prefill_chunk=chunk, block_size=4)
            got = []
            for p, hit, w in ((prompt, 0, want), (prompt, n - 1, want), (longer, n, want_longer),
                              (longer, n + len(extra) - 1, want_longer), (prompt, n - 1, want)):
                out, end = last_event(engine, p, params)
                got.append(end.stats.cached_tokens)
                assert same(out, w, dtype), (max_tokens, n, len(got))
            assert got == [0, n - 1, n, n + len(extra) - 1, n - 1], (max_tokens, n)
            wait_idle(engine)
            assert engine.kv_cache_usage == 0


def test_the_server_reports_the_reuse(variants):
    """`usage.prompt_tokens_details.cached_tokens` of /v1/completions with token ids is the engine's count: a
    one-token completion, the same prompt again, then that prompt and two more tokens."""
    from fastapi.testclient import TestClient
    from text_fixtures import tiny_tokenizer

    from gem4.server import ServerConfig, create_app

    model = gem4.load(variants["dense_plain"].hf_causal, dtype="float32")
    engine = Engine(model, tiny_tokenizer(), prefill_chunk=8, block_size=4)
    prompt = prompt_ids(29, seed=5)
    with TestClient(create_app(ServerConfig(served_model_name="tiny"), engine)) as client:
        for ids, hit in ((prompt, 0), (prompt, 28), (prompt + [7, 8], 29)):
            body = {"model": "tiny", "prompt": ids, "max_tokens": 1, "temperature": 0}
            usage = client.post("/v1/completions", json=body).json()["usage"]
            assert (usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]) == (len(ids), hit)
