"""Engine: greedy == transformers generate on every variant; stop logic, limits, abort, threads.

Stop / limit tests run a scripted stand-in for the model (greedy decoding yields a fixed token
script) with the demo tokenizer, so every expected text is exact and hand-checkable.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import re
import threading
import time

import pytest
import torch

import gem4
from gem4 import Engine, SamplingParams
from gem4.model.gemma4 import DECODE_ROWS
from gem4.demo import demo_tokenizer
from gem4.engine import EngineError, InvalidParameter, NonFiniteLogits
from gem4.config import FULL, SLIDING, build_config, rope_default
from gem4.engine.pool import kv_pool_size
from gem4.engine.scheduler import Scheduler
from gem4.engine.sequence import Sequence
from gem4.kv_cache import BlockManager

GREEDY = SamplingParams(temperature=0)


# ---------------------------------------------------------------------------------------------
# Greedy decoding against the transformers oracle
# ---------------------------------------------------------------------------------------------

# variant -> (checkpoint form, prefill chunk): small chunks exercise chunked prefill and the ring
GREEDY_CASES = {"ple_kvshare": ("hf", 7), "dense_keqv": ("gguf", 256), "dense_plain": ("hf", 5), "moe": ("gguf", 16)}


@pytest.mark.parametrize("name", list(GREEDY_CASES))
def test_greedy_matches_transformers_generate(variants, name):
    from transformers import GenerationConfig

    fx = variants[name]
    form, chunk = GREEDY_CASES[name]
    prompt = fx.ids[:24]                                        # 24 tokens, sliding window 8
    config = GenerationConfig(do_sample=False, max_new_tokens=48, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        ref = fx.hf_model.generate(torch.tensor([prompt]), generation_config=config)[0, len(prompt):].tolist()
    assert len(ref) == 48

    model = gem4.load(fx.hf_causal if form == "hf" else fx.gguf["f32"], dtype="float32")
    events = list(Engine(model, prefill_chunk=chunk).generate(prompt, SamplingParams(temperature=0, max_tokens=48)))
    got = [e.token_id for e in events]
    matched = sum(a == b for a, b in zip(got, ref))
    print(f"{name} ({form}, chunk {chunk}): greedy match {matched}/48")
    assert got == ref
    assert events[-1].finish_reason == "length" and events[-1].completion_tokens == 48
    assert [e.finish_reason for e in events[:-1]] == [None] * 47


def test_seeded_sampling_is_reproducible_alone_and_interleaved(variants):
    model = gem4.load(variants["dense_plain"].hf_causal, dtype="float32")
    seeded = SamplingParams(temperature=1.0, seed=11, max_tokens=20)
    alone = [e.token_id for e in Engine(model).generate(variants["dense_plain"].ids[:10], seeded)]
    assert alone == [e.token_id for e in Engine(model).generate(variants["dense_plain"].ids[:10], seeded)]
    # two requests admitted together share steps; each keeps its own generator
    engine = Engine(model, max_num_seqs=2, prefill_chunk=4)
    other = engine.submit(variants["dense_plain"].ids[5:20], SamplingParams(temperature=1.0, seed=3, max_tokens=20))
    mine = engine.submit(variants["dense_plain"].ids[:10], seeded)
    assert [e.token_id for e in mine] == alone
    assert len(list(other)) == 20
    assert len(set(alone)) > 1


# ---------------------------------------------------------------------------------------------
# A scripted model: greedy decoding yields `script`, whatever the prompt
# ---------------------------------------------------------------------------------------------


def fake_config(vocab_size: int, context: int):
    """The smallest real ModelConfig (one sliding, one full layer): the engine sizes its KV pool from it."""
    return build_config(
        vocab_size=vocab_size, hidden_size=8, layer_types=[SLIDING, FULL], n_heads=[1, 1], n_kv_heads=[1, 1],
        head_dims=[2, 2], k_eq_v=[False, False], intermediate_sizes=[4, 4], num_kv_shared_layers=0, sliding_window=4,
        rms_norm_eps=1e-6, final_logit_softcap=None, ple_dim=0, ple_vocab_size=0, moe=None,
        rope_inv_freq={SLIDING: rope_default(1e4, 2), FULL: rope_default(1e4, 2)}, tie_word_embeddings=True,
        max_position_embeddings=context)


class ScriptedModel:
    """Duck-types gem4's Model for the engine: each logit row of a step gets logits whose argmax is the next
    token of the script for that row's sequence (counted per sequence, which the model tells apart by the
    block holding its position 0: its engine needs the prefix cache off, which would share that block);
    rows without logits only advance."""

    decode_rows = DECODE_ROWS      # the runner packs chunks of up to this many rows into one pass

    def __init__(self, script: list[int], vocab_size: int = 4096, context: int = 4096, delay: float = 0.0):
        self.script = script
        self.config = fake_config(vocab_size, context)
        self.dtype = torch.float32
        self.device = torch.device("cpu")
        self.delay = delay
        self.calls: list[tuple[str, int, int]] = []   # per sequence per step: (kind, n_tokens, its first token)
        self.fail_at: int | None = None
        self.samples: dict[int, int] = {}             # sequence (its first block) -> tokens it sampled
        self.prompts: dict[int, int] = {}             # sequence -> its first token

    def sequences(self, ids, layout, pool) -> list[tuple[int, list[int]]]:
        """(sequence, flat rows) of each sequence of the step; remembers each new sequence's first token."""
        q_seq = layout.attend[FULL].q_seq.tolist()
        first_block = (layout.attend[FULL].key_rows[:, 0] // pool.block_size).tolist()
        out = []
        for b in sorted(set(q_seq)):
            rows = [t for t, s in enumerate(q_seq) if s == b]
            key = first_block[b]
            if int(layout.positions[rows[0]]) == 0:
                self.samples[key], self.prompts[key] = 0, int(ids[rows[0]])
            out.append((key, rows))
        return out

    def forward(self, ids, layout, pool):
        logit_rows = layout.logit_rows.tolist()
        seqs = self.sequences(ids, layout, pool)
        for key, rows in seqs:
            self.calls.append(("logits" if rows[-1] in logit_rows else "hidden", len(rows), self.prompts[key]))
        if self.fail_at is not None and len(self.calls) >= self.fail_at:
            raise RuntimeError("scripted failure")
        if self.delay:
            time.sleep(self.delay)
        logits = torch.full((len(logit_rows), self.config.vocab_size), -10.0)   # [M, V]
        seq_of = {row: key for key, rows in seqs for row in rows}
        for i, row in enumerate(logit_rows):
            key = seq_of[row]
            logits[i, self.script[self.samples[key] % len(self.script)]] = 10.0
            self.samples[key] += 1
        return logits


@pytest.fixture(scope="module")
def tok():
    return demo_tokenizer()


def scripted(tok, text: str, *extra: int, **kw) -> tuple[Engine, list[int]]:
    script = tok.encode(text, add_bos=False) + list(extra)
    return Engine(ScriptedModel(script, **kw), tok, enable_prefix_caching=False), script


def run(engine: Engine, prompt, params: SamplingParams):
    events = list(engine.generate(prompt, params))
    assert [e.finish_reason is not None for e in events].count(True) == 1 and events[-1].finish_reason
    return events, "".join(e.text for e in events)


TEXT = "Hello, world! Stop here please."   # H|ell|o|,| world|!| St|op| here| p|lease|.


def test_script_tokens_are_what_the_stop_tests_assume(tok):
    pieces = [tok.decode([i]) for i in tok.encode(TEXT, add_bos=False)]
    assert pieces == ["H", "ell", "o", ",", " world", "!", " St", "op", " here", " p", "lease", "."]


def test_stop_string_spanning_tokens_is_never_emitted(tok):
    engine, _ = scripted(tok, TEXT)
    events, text = run(engine, "Hi", SamplingParams(temperature=0, stop=["d! Sto"], max_tokens=50))
    # " world" ends with "d", a prefix of the stop string: held back until "!" and " St" decide
    assert [e.text for e in events] == ["H", "ell", "o", ",", " worl", "", "", ""]
    assert text == "Hello, worl"
    assert (events[-1].finish_reason, events[-1].stop_reason) == ("stop", "d! Sto")
    assert events[-1].completion_tokens == 8                      # "op" completed the stop string


def test_held_text_is_released_when_the_stop_string_fails(tok):
    engine, _ = scripted(tok, TEXT)
    events, text = run(engine, "Hi", SamplingParams(temperature=0, stop=["world!?", "please!"], max_tokens=12))
    # " world" -> "world" held ("world!?"), "op" -> "p" held ("please!"), "lease" -> "please" held
    assert [e.text for e in events] == ["H", "ell", "o", ",", " ", "", "world! St", "o", "p here", " ", "", "please."]
    assert text == TEXT and events[-1].finish_reason == "length"


def test_held_text_is_released_at_max_tokens(tok):
    engine, _ = scripted(tok, TEXT)
    events, text = run(engine, "Hi", SamplingParams(temperature=0, stop=["o, wonder"], max_tokens=5))
    assert [e.text for e in events] == ["H", "ell", "", "", "o, world"]
    assert (text, events[-1].finish_reason, events[-1].stop_reason) == ("Hello, world", "length", None)


def test_earliest_stop_string_wins(tok):
    engine, _ = scripted(tok, TEXT)
    events, text = run(engine, "Hi", SamplingParams(temperature=0, stop=["world", "o, w"], max_tokens=50))
    assert (text, events[-1].stop_reason) == ("Hell", "o, w")    # both complete with " world"; "o, w" starts first
    _, text = run(engine, "Hi", SamplingParams(temperature=0, stop=["Hello, world", "ello"], max_tokens=50))
    assert text == "H"                                            # "ello" completes first


def test_a_request_without_text_carries_the_same_token_ids(tok):
    """detokenize=False (the server's chat requests, whose output parser reads the ids): the same tokens and
    finish, no text; stop strings, which need the text, are refused at submit."""
    params = SamplingParams(temperature=0, max_tokens=8)
    engine, _ = scripted(tok, TEXT)
    with_text, text = run(engine, [2, 5], params)
    ids_only = list(engine.submit([2, 5], params, detokenize=False))
    assert text and [e.token_id for e in ids_only] == [e.token_id for e in with_text]
    assert ids_only[-1].finish_reason == with_text[-1].finish_reason and not any(e.text for e in ids_only)
    with pytest.raises(ValueError, match="stop strings need the text"):
        engine.submit([2, 5], SamplingParams(max_tokens=4, stop=("x",)), detokenize=False)


def test_stop_token_ids_end_without_their_text(tok):
    stop_tok = tok.encode(" here", add_bos=False)[0]
    engine, _ = scripted(tok, TEXT)
    events, text = run(engine, "Hi", SamplingParams(temperature=0, stop_token_ids=[stop_tok], max_tokens=50))
    assert text == "Hello, world! Stop"
    assert (events[-1].finish_reason, events[-1].stop_reason, events[-1].token_id) == ("stop", stop_tok, stop_tok)
    assert events[-1].completion_tokens == 9


@pytest.mark.parametrize("end", ["<turn|>", "<eos>", "<|tool_response>"])
def test_model_end_ids_stop_unless_ignore_eos(tok, end):
    end_id = tok.token_to_id(end)
    engine, script = scripted(tok, "Done.", end_id, *tok.encode(" more", add_bos=False))
    events, text = run(engine, "Hi", SamplingParams(temperature=0, max_tokens=50))
    assert (text, events[-1].finish_reason, events[-1].stop_reason) == ("Done.", "stop", end_id)
    events, text = run(engine, "Hi", SamplingParams(temperature=0, max_tokens=len(script), ignore_eos=True))
    shown = "" if tok.is_control(end_id) else end                  # CONTROL tokens are not text
    assert (text, events[-1].finish_reason) == ("Done." + shown + " more", "length")


def test_max_tokens_ends_with_length_and_exact_text(tok):
    engine, script = scripted(tok, TEXT)
    events, text = run(engine, "Hi", SamplingParams(temperature=0, max_tokens=7))
    assert [e.token_id for e in events] == script[:7]
    assert text == "Hello, world! St" and events[-1].finish_reason == "length"
    assert [e.completion_tokens for e in events] == list(range(1, 8))
    stats = events[-1].stats
    assert (stats.prompt_tokens, stats.completion_tokens) == (len(tok.encode("Hi")), 7)
    assert 0 <= stats.queue_s <= stats.ttft_s and stats.decode_s >= 0


def test_utf8_split_over_byte_tokens_is_held_whole(tok):
    engine, _ = scripted(tok, "café ☕!")                        # ☕ is three byte tokens
    events, text = run(engine, "Hi", SamplingParams(temperature=0, max_tokens=8))
    assert [e.text for e in events][-4:] == ["", "", "☕", "!"]
    assert text == "café ☕!"


def test_context_overflow(tok):
    model = ScriptedModel(tok.encode(TEXT, add_bos=False), context=64)
    prompt = list(range(200, 240))                                # 40 tokens
    with pytest.raises(ValueError, match=r"prompt \(40 tokens\) \+ max_tokens \(25\) = 65 exceeds the context length 64"):
        Engine(model, tok).submit(prompt, SamplingParams(temperature=0, max_tokens=25))
    with pytest.raises(ValueError, match=r"exceeds the context length 50"):
        Engine(model, tok, max_model_len=50).submit(prompt, SamplingParams(temperature=0, max_tokens=11))
    with pytest.raises(ValueError, match="leaves no room"):
        Engine(model, tok, max_model_len=40).submit(prompt, GREEDY)
    with pytest.raises(ValueError, match=r"max_model_len must be in \[1, 64\]"):
        Engine(model, tok, max_model_len=65)
    # without max_tokens the request runs until the context is full
    events, _ = run(Engine(model, tok, max_model_len=50), prompt, SamplingParams(temperature=0, ignore_eos=True))
    assert (len(events), events[-1].finish_reason) == (10, "length")


def test_bad_requests_fail_in_the_callers_thread(tok):
    model = ScriptedModel([500])
    with pytest.raises(ValueError, match="needs a tokenizer"):
        Engine(model).submit("text")
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        Engine(model).submit([2, 3], SamplingParams(stop="x"))
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 4096\)"):
        Engine(model).submit([2, 4096])
    with pytest.raises(ValueError, match="empty"):
        Engine(model, tok).submit([])
    with pytest.raises(ValueError, match="logit_bias: token ids must be < the vocabulary size 4096"):
        Engine(model).submit([2], SamplingParams(logit_bias={4096: 1.0}))
    assert model.calls == []


def test_chunked_prefill_computes_only_the_logits_it_needs(tok):
    model = ScriptedModel(tok.encode(TEXT, add_bos=False))
    engine = Engine(model, tok, prefill_chunk=7)
    events = list(engine.generate(list(range(300, 320)), SamplingParams(temperature=0, max_tokens=3)))
    assert [c[:2] for c in model.calls] == [("hidden", 7), ("hidden", 7), ("logits", 6), ("logits", 1), ("logits", 1)]
    assert len(events) == 3


def test_text_prompt_uses_the_tokenizer(tok):
    engine, _ = scripted(tok, TEXT)
    events, _ = run(engine, "Hello there", SamplingParams(temperature=0, max_tokens=2))
    assert events[-1].prompt_tokens == len(tok.encode("Hello there"))
    assert tok.encode("Hello there")[0] == tok.bos_id


def test_logprobs_are_reported(tok):
    engine, script = scripted(tok, TEXT)
    events, _ = run(engine, "Hi", SamplingParams(temperature=0, max_tokens=2, logprobs=True, top_logprobs=2))
    for e, t in zip(events, script):
        assert e.top_logprobs[0][0] == t and e.logprob == pytest.approx(e.top_logprobs[0][1])
        assert len(e.top_logprobs) == 2 and -1e-4 < e.logprob <= 0    # a 20-logit gap: probability ~1


# ---------------------------------------------------------------------------------------------
# Threads: abort, early close, arrival order, failures
# ---------------------------------------------------------------------------------------------


def wait_idle(engine: Engine, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not engine.idle():
        assert time.monotonic() < end, "engine thread did not go idle"
        time.sleep(0.005)


def test_abort_from_another_thread_stops_within_one_step(tok):
    model = ScriptedModel(tok.encode(TEXT, add_bos=False), delay=0.01)
    engine = Engine(model, tok)
    stream = engine.submit("Hi", SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True))
    events = [stream.get(timeout=5) for _ in range(5)]
    calls_at_abort = []

    def abort():
        calls_at_abort.append(len(model.calls))
        assert engine.abort(stream.request_id)

    t = threading.Thread(target=abort)
    t.start()
    t.join()
    events += list(stream)
    last = events[-1]
    assert (last.finish_reason, last.token_id) == ("abort", None)
    assert len(model.calls) <= calls_at_abort[0] + 1               # at most the step already under way
    assert last.completion_tokens == len(events) - 1 <= calls_at_abort[0] + 1
    assert not engine.abort(stream.request_id)                     # no longer in flight
    wait_idle(engine)
    assert engine._scheduler.blocks.usage == 0


@pytest.mark.parametrize("how", ["close", "break", "drop unstarted"])
def test_leaving_the_iterator_aborts(tok, how):
    model = ScriptedModel(tok.encode(TEXT, add_bos=False), delay=0.005)
    engine = Engine(model, tok)
    params = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
    if how == "close":
        gen = engine.generate("Hi", params)
        assert next(gen).text == "H"
        gen.close()
    elif how == "break":
        for event in engine.generate("Hi", params):
            break
        assert event.text == "H"
    else:
        engine.generate("Hi", params)                                  # submitted at once, then dropped
    wait_idle(engine)
    assert engine._scheduler.blocks.usage == 0 and len(model.calls) < 20


def test_requests_are_served_in_arrival_order(tok):
    model = ScriptedModel(tok.encode(TEXT, add_bos=False), delay=0.002)
    engine = Engine(model, tok, prefill_chunk=4)
    first = engine.submit(list(range(300, 310)), SamplingParams(temperature=0, max_tokens=6))
    second = engine.submit(list(range(400, 403)), SamplingParams(temperature=0, max_tokens=6))
    results = {}
    threads = [threading.Thread(target=lambda s=s: results.__setitem__(s.request_id, list(s))) for s in (second, first)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    caches = [c[2] for c in model.calls]
    switch = caches.index(caches[-1])
    assert len(set(caches)) == 2 and set(caches[:switch]) == {caches[0]}   # all of the first, then the second
    assert switch == 8 and set(caches[switch:]) == {caches[-1]}
    assert [c[1] for c in model.calls[:3]] == [4, 4, 2]                      # the first request's prompt first
    assert all(len(r) == 6 for r in results.values())


def test_engine_failure_reaches_every_stream(tok):
    model = ScriptedModel(tok.encode(TEXT, add_bos=False))
    model.fail_at = 3
    engine = Engine(model, tok)
    with pytest.raises(EngineError, match="scripted failure"):
        list(engine.generate("Hi", SamplingParams(temperature=0, max_tokens=10)))
    wait_idle(engine)
    model.fail_at = None                                           # the engine serves the next request
    assert len(list(engine.generate("Hi", SamplingParams(temperature=0, max_tokens=3)))) == 3


# ---------------------------------------------------------------------------------------------
# One bad request never hurts another (issue 12)
# ---------------------------------------------------------------------------------------------


class NoisyModel(ScriptedModel):
    """Logits are a fixed random function of the position (whatever the request), so seeded
    sampling gives varied tokens and the same request gives the same tokens alone or batched.
    `poison(first prompt token, position)` may return "raise" or "nan" to break one request's step."""

    def __init__(self, vocab_size: int = 64):
        super().__init__([0], vocab_size=vocab_size)
        self.poison = lambda first, position: None

    def forward(self, ids, layout, pool):
        seqs = self.sequences(ids, layout, pool)
        first_of = {row: self.prompts.get(key) for key, rows in seqs for row in rows}
        rows = layout.logit_rows.tolist()
        out = []
        for row in rows:
            position = int(layout.positions[row])
            what = self.poison(first_of[row], position)
            if what == "raise":
                raise RuntimeError("injected forward failure")
            g = torch.Generator().manual_seed(position)
            logits = 2.0 * torch.randn(1, self.config.vocab_size, generator=g)
            out.append(torch.full_like(logits, float("nan")) if what == "nan" else logits)
        for key, r in seqs:                          # (keyed by the block of position 0)
            self.calls.append(("logits" if r[-1] in rows else "hidden", len(r), self.prompts.get(key)))
        return torch.cat(out) if out else torch.empty(0, self.config.vocab_size)


PROMPTS = {"a": [10, 11, 12], "b": [20, 21], "c": [30, 31, 32, 33]}
SEEDED = {"a": SamplingParams(temperature=1.0, seed=1, max_tokens=12),
          "b": SamplingParams(temperature=0.8, seed=2**40, top_k=20, max_tokens=12),
          "c": SamplingParams(temperature=1.2, seed=-7, logprobs=True, top_logprobs=2, max_tokens=12)}


def alone(name: str) -> list[int]:
    return [e.token_id for e in Engine(NoisyModel()).generate(PROMPTS[name], SEEDED[name])]


def run_together(engine: Engine) -> dict[str, list[int] | Exception]:
    streams = {n: engine.submit(PROMPTS[n], SEEDED[n], request_id=n) for n in PROMPTS}
    out: dict[str, list[int] | Exception] = {}
    for n, stream in streams.items():
        try:
            out[n] = [e.token_id for e in stream]
        except EngineError as e:
            out[n] = e
    return out


@pytest.mark.parametrize("where", ["forward", "sampler"])
def test_a_failing_request_fails_alone(where, caplog):
    want = {n: alone(n) for n in PROMPTS}
    assert len({tuple(v) for v in want.values()}) == 3 and all(len(set(v)) > 3 for v in want.values())
    model = NoisyModel()
    engine = Engine(model, max_num_seqs=3, prefill_chunk=2)
    if where == "forward":
        model.poison = lambda first, position: "raise" if first == 20 and position == 5 else None
    else:
        real = engine._runner.sampler.sample

        def sample(logits, params, *args, **kw):
            out = real(logits, params, *args, **kw)            # draws first: the replay must undo them
            generated = args[0]
            if any(p is SEEDED["b"] for p in params) and len(generated[params.index(SEEDED["b"])]) == 3:
                raise RuntimeError("injected sampler failure")
            return out

        engine._runner.sampler.sample = sample
    with caplog.at_level("ERROR", logger="gem4.engine"):
        got = run_together(engine)
    assert got["a"] == want["a"] and got["c"] == want["c"]       # the same tokens as alone
    assert isinstance(got["b"], EngineError) and "injected" in str(got["b"])
    records = [r for r in caplog.records if r.name == "gem4.engine"]
    assert len(records) == 1 and "request b failed at engine step" in records[0].getMessage()
    wait_idle(engine)
    assert engine._scheduler.blocks.usage == 0
    if where == "forward":
        model.poison = lambda first, position: None
    else:
        engine._runner.sampler.sample = real
    assert [e.token_id for e in engine.generate(PROMPTS["b"], SEEDED["b"])] == alone("b")   # still serving


def test_the_finite_check_is_exact():
    """runner._finite: NaN, +inf, -inf or both anywhere -> False; finite logits whose float32 sum overflows -> True."""
    from gem4.engine.runner import _finite

    x = torch.randn(2, 1000)
    assert _finite(x)
    for bad in ([float("nan")], [float("inf")], [float("-inf")], [float("inf"), float("-inf")]):
        y = x.clone()
        y.view(-1)[[7, 1500][:len(bad)]] = torch.tensor(bad)
        assert not _finite(y), bad
    assert _finite(torch.full((1, 8), 3e38))                      # the sum is inf, every value finite


def test_non_finite_logits_end_that_request_with_an_error(caplog):
    model = NoisyModel()
    model.poison = lambda first, position: "nan" if first == 30 and position == 6 else None
    engine = Engine(model, max_num_seqs=3)
    with caplog.at_level("ERROR", logger="gem4.engine"):
        stream = engine.submit(PROMPTS["c"], SEEDED["c"], request_id="c")
        other = engine.submit(PROMPTS["a"], SEEDED["a"], request_id="a")
        events = []
        with pytest.raises(EngineError, match="non-finite logits") as info:
            for e in stream:
                events.append(e)
        assert [e.token_id for e in other] == alone("a")
    assert isinstance(info.value.__cause__, NonFiniteLogits)
    assert len(events) == 3                                     # positions 3, 4, 5 sampled; 6 was NaN: no token
    assert all(math.isfinite(e.logprob) for e in events)
    [record] = [r for r in caplog.records if r.name == "gem4.engine"]
    # the step is named; no token id or text is logged
    assert re.fullmatch(r"request c failed at engine step \d+: the model produced non-finite logits \(NaN or inf\) "
                        r"at position 6, choosing completion token 4", record.getMessage())
    assert record.exc_info is None                             # a model fault, not a traceback


def test_parameters_that_depend_on_the_model_are_refused_at_submit():
    engine = Engine(NoisyModel(vocab_size=64))
    for params, field in ((SamplingParams(top_k=65), "top_k"), (SamplingParams(logit_bias={64: 1.0}), "logit_bias"),
                          (SamplingParams(stop_token_ids=[70]), "stop_token_ids")):
        with pytest.raises(InvalidParameter, match=field) as info:
            engine.submit([1, 2], params)
        assert info.value.param == field
    engine.submit([1, 2], SamplingParams(top_k=64, max_tokens=1))   # top_k == V keeps everything
    with pytest.raises(TypeError, match="SamplingParams"):
        engine.submit([1, 2], {"top_k": 2**63})


def test_scheduler_is_fcfs_with_a_token_budget():
    def seq(name, n):
        return Sequence(name, list(range(n)), GREEDY, max_tokens=4, end_ids=())

    sched = Scheduler(BlockManager(num_blocks=8, block_size=16, num_sliding_blocks=8, window=4), max_chunk=4,
                      max_num_seqs=2, max_num_batched_tokens=6)
    a, b, c = seq("a", 9), seq("b", 3), seq("c", 2)
    for s in (a, b, c):
        sched.add(s)

    def plan(batch):
        return [(ch.seq.request_id, ch.start, ch.num_tokens, ch.samples) for ch in batch.chunks]

    batch = sched.schedule()
    assert plan(batch) == [("a", 0, 4, False), ("b", 0, 2, False)]         # budget 6, c waits (2 running)
    sched.postprocess(batch, [None, None], 0.0)
    batch = sched.schedule()
    assert plan(batch) == [("a", 4, 4, False), ("b", 2, 1, True)]
    sched.postprocess(batch, [None, [7]], 0.0)
    batch = sched.schedule()
    assert plan(batch) == [("b", 3, 1, True), ("a", 8, 1, True)]           # decodes first, then prefill
    sched.postprocess(batch, [[5], [6]], 0.0)
    assert sched.remove("b") == [b] and sched.remove("b") == []
    batch = sched.schedule()
    # c is admitted when b's seat frees; its first token is in the cache (b's block holds 0 1 2 7)
    assert plan(batch) == [("a", 9, 1, True), ("c", 1, 1, True)]


# ---------------------------------------------------------------------------------------------
# Continuous batching: one forward over all running sequences, one KV pool (issue 13)
# ---------------------------------------------------------------------------------------------

# prompts of different lengths (window 8: the longer ones wrap the sliding rings while prefilling)
BATCH_PROMPTS = [(0, 5), (3, 30), (10, 12), (1, 45), (20, 41)]


def greedy_alone(model, prompt: list[int], n: int, kv: str = "auto") -> list[int]:
    return [e.token_id for e in Engine(model, prefill_chunk=8, kv_cache_dtype=kv).generate(
        prompt, SamplingParams(temperature=0, max_tokens=n))]


@pytest.mark.parametrize("dtype, kv", [("float32", "auto"), ("bfloat16", "auto"), ("bfloat16", "int8"),
                                       ("bfloat16", "fp8_e4m3")])
@pytest.mark.parametrize("name", ["ple_kvshare", "dense_keqv", "dense_plain", "moe"])
def test_a_request_decodes_the_same_tokens_in_any_batch(variants, name, dtype, kv):
    """Greedy tokens equal running alone, with staggered arrivals, different prompt lengths, ring wraps in
    prefill and decode, a prefill chunk sharing steps with decodes, and an abort in the middle of a batch; with
    the bf16 KV cache and the 8-bit ones (each row quantized on its own, the attention kernels row-invariant)."""
    fx = variants[name]
    model = gem4.load(fx.gguf["q8_0"] if dtype == "bfloat16" else fx.hf_causal, dtype=dtype)
    prompts = [fx.ids[a:b] for a, b in BATCH_PROMPTS]
    want = [greedy_alone(model, p, 20, kv) for p in prompts]
    engine = Engine(model, prefill_chunk=8, max_num_seqs=4, max_num_batched_tokens=12, kv_cache_dtype=kv)
    params = SamplingParams(temperature=0, max_tokens=20)
    streams = [engine.submit(prompts[0], params), engine.submit(prompts[1], params)]
    got = [[e.token_id for e in itertools.islice(streams[0], 6)]]             # the first decodes alone a while
    streams += [engine.submit(p, params) for p in prompts[2:]]                # then the others arrive
    doomed = engine.submit(fx.ids[7:40], SamplingParams(temperature=0, max_tokens=50))
    assert next(iter(doomed)).token_id is not None
    engine.abort(doomed.request_id)                                           # leaves mid-batch
    got[0] += [e.token_id for e in streams[0]]
    got += [[e.token_id for e in s] for s in streams[1:]]
    assert got == want
    assert list(doomed)[-1].finish_reason == "abort"
    wait_idle(engine)
    assert engine._scheduler.blocks.usage == 0 and engine.batch_sizes[4] > 0  # four decoded together


def test_a_chunk_is_computed_in_passes_of_its_kind():
    """runner._pieces / _passes: a chunk's prompt rows in the step's one prefill pass, its generated rows (a
    preempted sequence computed again) after it in decode passes of at most decode_rows rows, each piece of a
    chunk in a later pass than the one before, decode steps packed into the first pass with room."""
    from types import SimpleNamespace
    from gem4.engine.runner import _passes, _pieces, _Rows

    seq = SimpleNamespace(num_prompt_tokens=10, num_tokens=26)
    chunk = SimpleNamespace(seq=seq, start=6, num_tokens=20, samples=True)
    pieces = _pieces(_Rows(chunk, 6, list(range(6, 26)), []), decode_rows=8)
    assert [(p.start, len(p.ids), p.prefill, p.last, p.num_logits) for p in pieces] == \
        [(6, 4, True, False, 0), (10, 8, False, False, 0), (18, 8, False, True, 1)]
    assert [p.ids[0] for p in pieces] == [6, 10, 18]
    decode = SimpleNamespace(seq=seq, start=25, num_tokens=1, samples=True)
    assert _pieces(_Rows(decode, 25, [25, 7, 7], [7, 7]), decode_rows=8) == [_Rows(decode, 25, [25, 7, 7], [7, 7])]
    # (chunk, prefill, rows): chunk 0 as above, chunk 1 a decode step, chunk 2 a prompt chunk, chunk 3 drafts
    assert _passes([(0, True, 4), (0, False, 8), (0, False, 8), (1, False, 1), (2, True, 30), (3, False, 3)], 8) == \
        [[0, 4], [1], [2], [3, 5]]
    assert _passes([(0, False, 1), (1, False, 8), (2, False, 3)], 8) == [[0, 2], [1]]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_pool_too_small_preempts_and_every_request_still_completes(variants, dtype):
    """...and gets the tokens it gets alone: in the fast mode too, whose preempted sequences compute their
    generated tokens again with the decode kernels (runner.py)."""
    fx = variants["dense_plain"]
    model = gem4.load(fx.gguf["q8_0"] if dtype == "bfloat16" else fx.hf_causal, dtype=dtype)
    prompts = [fx.ids[a:a + 6] for a in range(4)]
    want = [greedy_alone(model, p, 40) for p in prompts]
    size = kv_pool_size(model.config, model.dtype, max_chunk=8, num_seqs=4, max_model_len=64, prefix_caching=True)
    budget = size.num_sliding_blocks * size.sliding_block_bytes + 6 * size.block_bytes                       # 6 blocks of 16: 96 tokens for 4 x 46
    engine = Engine(model, prefill_chunk=8, max_num_seqs=4, max_model_len=64, kv_cache_bytes=budget)
    assert engine.pool_size.num_blocks == 6
    streams = [engine.submit(p, SamplingParams(temperature=0, max_tokens=40)) for p in prompts]
    assert [[e.token_id for e in s] for s in streams] == want
    assert engine.num_preemptions > 0
    wait_idle(engine)
    assert engine._scheduler.blocks.usage == 0


def test_seeded_sampling_survives_preemption(variants):
    fx = variants["dense_plain"]
    model = gem4.load(fx.hf_causal, dtype="float32")
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=40) for s in range(4)]
    prompts = [fx.ids[a:a + 6] for a in range(4)]
    want = [[e.token_id for e in Engine(model, prefill_chunk=8).generate(p, q)] for p, q in zip(prompts, params)]
    size = kv_pool_size(model.config, model.dtype, max_chunk=8, num_seqs=4, max_model_len=64, prefix_caching=True)
    engine = Engine(model, prefill_chunk=8, max_num_seqs=4, max_model_len=64,
                    kv_cache_bytes=size.num_sliding_blocks * size.sliding_block_bytes + 6 * size.block_bytes)
    streams = [engine.submit(p, q) for p, q in zip(prompts, params)]
    assert [[e.token_id for e in s] for s in streams] == want and engine.num_preemptions > 0


# ---------------------------------------------------------------------------------------------
# Several choices of one prompt (n > 1): the prompt computed once, the choices forked off it
# ---------------------------------------------------------------------------------------------


def recording(model, engine_box: list):
    """Wrap model.forward: record each pass's rows and the full-attention blocks in use when it runs."""
    real = model.forward
    rows, blocks = [], []

    def forward(ids, layout, pool):
        rows.append(ids.numel())
        bm = engine_box[0]._scheduler.blocks
        blocks.append(bm.num_blocks - bm.free_blocks)
        return real(ids, layout, pool)

    model.forward = forward
    return rows, blocks


def choices(stream) -> dict[int, list]:
    """Events of a request by choice index; checks each choice ends with exactly one final event."""
    out: dict[int, list] = {}
    for e in stream:
        assert not (out.get(e.index) and out[e.index][-1].finished), "an event after the choice's final one"
        out.setdefault(e.index, []).append(e)
    assert all(evs[-1].finished for evs in out.values())
    return dict(sorted(out.items()))


def test_n_greedy_choices_equal_the_single_output_with_the_prompt_computed_once(variants):
    fx = variants["dense_plain"]
    model = gem4.load(fx.hf_causal, dtype="float32")
    prompt, new = fx.ids[:21], 20                          # 21 tokens: the shared last block is partly filled
    want = greedy_alone(model, prompt, new)
    box: list = []
    rows, blocks = recording(model, box)
    engine = Engine(model, prefill_chunk=8, max_num_seqs=4)
    box.append(engine)
    got = choices(engine.submit(prompt, SamplingParams(temperature=0, max_tokens=new), n=3))
    assert list(got) == [0, 1, 2]
    assert [[e.token_id for e in evs] for evs in got.values()] == [want] * 3
    assert all(evs[-1].finish_reason == "length" and evs[-1].stats.prompt_tokens == 21 for evs in got.values())
    # the prompt's 21 rows once (chunks of 8, 8, 5), then one row per choice per decode step
    assert sum(rows) == 21 + 3 * (new - 1) and rows[:3] == [8, 8, 5] and set(rows[3:]) == {3}
    # block 0 (positions 0-15) stays shared; block 1 is copied by two choices on their first write, and
    # each choice grows its own block 2 (positions 32-40): 1 + 3 + 3 blocks instead of 3 x 3
    assert max(blocks) == 7
    wait_idle(engine)
    assert engine.kv_cache_usage == 0 and not engine._runner._generators


@pytest.mark.parametrize("name, dtype", [("dense_plain", "float32"), ("ple_kvshare", "bfloat16")])
def test_seeded_choices_differ_reproduce_and_equal_single_requests_with_seed_plus_index(variants, name, dtype):
    """Choice i of a request with seed s == the same request alone with n=1 and seed s + i: tokens and
    logprobs (so its K/V after the choices diverged are its own: copy-on-write kept them apart). The fast
    mode is batch invariant bit for bit; float32 decodes 3 rows through a GEMM that rounds a little
    differently from 1 row, so there the logprobs agree to 1e-5."""
    fx = variants[name]
    model = gem4.load(fx.gguf["q8_0"] if dtype == "bfloat16" else fx.hf_causal, dtype=dtype)
    prompt = fx.ids[3:22]                                  # 19 tokens (window 8: rings wrap)
    params = SamplingParams(temperature=1.0, seed=41, max_tokens=24, logprobs=True, top_logprobs=2)

    def single(seed):
        evs = list(Engine(model, prefill_chunk=8).generate(prompt, dataclasses.replace(params, seed=seed)))
        return [(e.token_id, e.logprob, e.top_logprobs) for e in evs]

    def grouped(engine):
        got = choices(engine.submit(prompt, params, n=3))
        return [[(e.token_id, e.logprob, e.top_logprobs) for e in evs] for evs in got.values()]

    def same(got, ref):
        if dtype != "float32":
            return got == ref
        def ids(r):
            return [(t, [i for i, _ in top]) for c in r for t, _, top in c]

        def floats(r):
            return [x for c in r for _, lp, top in c for x in (lp, *(v for _, v in top))]

        return ids(got) == ids(ref) and floats(got) == pytest.approx(floats(ref), rel=1e-5)

    want = [single(41 + i) for i in range(3)]
    engine = Engine(model, prefill_chunk=8, max_num_seqs=4)
    first = grouped(engine)
    assert same(first, want)
    assert grouped(Engine(model, prefill_chunk=8, max_num_seqs=4)) == first            # reproducible
    tokens = [[t for t, _, _ in c] for c in first]
    assert len({tuple(t) for t in tokens}) == 3 and all(len(set(t)) > 3 for t in tokens)  # distinct choices
    # the choices decode beside another request and keep their tokens
    other = engine.submit(fx.ids[:9], SamplingParams(temperature=0.7, seed=5, max_tokens=30))
    assert same(grouped(engine), want) and len(list(other)) == 30
    wait_idle(engine)
    assert engine.kv_cache_usage == 0


def test_abort_ends_every_choice_and_frees_the_shared_blocks(variants):
    fx = variants["dense_plain"]
    model = gem4.load(fx.hf_causal, dtype="float32")
    engine = Engine(model, prefill_chunk=8, max_num_seqs=3)
    stream = engine.submit(fx.ids[:20], SamplingParams(temperature=1.0, max_tokens=200), n=3)
    seen = set()
    for e in stream:                                       # wait until every choice has a token
        seen.add(e.index)
        if len(seen) == 3:
            break
    assert engine.abort(stream.request_id)
    finals = [e for e in stream if e.finished]
    assert sorted(e.index for e in finals) == [0, 1, 2] and {e.finish_reason for e in finals} == {"abort"}
    assert stream.finished
    wait_idle(engine)
    assert engine.kv_cache_usage == 0 and not engine._runner._generators


def test_aborting_one_choice_stops_it_alone(variants):
    """Engine.abort(request_id, index): that choice ends with "abort" within one step, the others give the
    tokens they give without it, and every block is given back."""
    fx = variants["dense_plain"]
    model = gem4.load(fx.hf_causal, dtype="float32")
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=30)
    want = choices(Engine(model, prefill_chunk=8, max_num_seqs=3).submit(fx.ids[:20], params, n=3))
    engine = Engine(model, prefill_chunk=8, max_num_seqs=3)
    stream = engine.submit(fx.ids[:20], params, n=3)
    got: dict[int, list] = {}
    made = None                 # choice 1's events made when the abort was recorded (the engine runs ahead of us)
    for e in stream:
        got.setdefault(e.index, []).append(e)
        if e.index == 1 and len(got[1]) == 5:
            assert engine.abort(stream.request_id, 1)
            for _ in range(stream._queue.qsize()):
                e = stream.get()
                got.setdefault(e.index, []).append(e)
            made = len(got[1])
    assert got[1][-1].finish_reason == "abort" and len(got[1]) <= made + 2     # one more step at most
    assert [e.token_id for e in got[1][:5]] == [e.token_id for e in want[1][:5]]
    for i in (0, 2):
        assert [e.token_id for e in got[i]] == [e.token_id for e in want[i]] and got[i][-1].finish_reason == "length"
    assert not engine.abort(stream.request_id, 0)                             # finished: nothing to stop
    wait_idle(engine)
    assert engine.kv_cache_usage == 0 and not engine._runner._generators


def test_choices_preempted_for_room_still_give_their_tokens(variants):
    fx = variants["dense_plain"]
    model = gem4.load(fx.hf_causal, dtype="float32")
    prompt = fx.ids[:6]
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=40)
    want = [[e.token_id for e in Engine(model, prefill_chunk=8).generate(prompt, dataclasses.replace(params, seed=7 + i))]
            for i in range(4)]
    size = kv_pool_size(model.config, model.dtype, max_chunk=8, num_seqs=4, max_model_len=64, prefix_caching=True)
    engine = Engine(model, prefill_chunk=8, max_num_seqs=4, max_model_len=64,
                    kv_cache_bytes=size.num_sliding_blocks * size.sliding_block_bytes + 6 * size.block_bytes)   # 6 blocks for 4 x 46 tokens
    got = choices(engine.submit(prompt, params, n=4))
    assert [[e.token_id for e in evs] for evs in got.values()] == want and engine.num_preemptions > 0
    wait_idle(engine)
    assert engine.kv_cache_usage == 0


def test_one_failing_choice_fails_its_request_once_and_no_other(caplog):
    params = SamplingParams(temperature=1.0, seed=100, max_tokens=12)
    model = NoisyModel()
    engine = Engine(model, max_num_seqs=4, prefill_chunk=2)
    real = engine._runner.sampler.sample

    def sample(logits, ps, generated, *args, **kw):
        out = real(logits, ps, generated, *args, **kw)
        if any(p.seed == 101 and len(g) == 3 for p, g in zip(ps, generated)):   # choice 1, its 4th token
            raise RuntimeError("injected sampler failure")
        return out

    engine._runner.sampler.sample = sample
    with caplog.at_level("ERROR", logger="gem4.engine"):
        doomed = engine.submit(PROMPTS["b"], params, n=3, request_id="b")
        other = engine.submit(PROMPTS["a"], SEEDED["a"], request_id="a")
        events = []
        with pytest.raises(EngineError, match="injected"):
            for e in doomed:
                events.append(e)
        assert [e.token_id for e in other] == alone("a")
    assert not any(e.finished for e in events) and {e.index for e in events} == {0, 1, 2}
    records = [r for r in caplog.records if r.name == "gem4.engine"]
    assert len(records) == 1 and "request b failed at engine step" in records[0].getMessage()
    wait_idle(engine)
    assert engine.kv_cache_usage == 0 and not engine._runner._generators


def test_non_finite_logits_at_the_fork_fail_every_choice_once(caplog):
    model = NoisyModel()
    model.poison = lambda first, position: "nan" if first == 30 and position == 3 else None   # the prompt's last row
    engine = Engine(model, max_num_seqs=3)
    with caplog.at_level("ERROR", logger="gem4.engine"):
        stream = engine.submit(PROMPTS["c"], SEEDED["c"], n=3, request_id="c")
        with pytest.raises(EngineError, match="non-finite logits"):
            list(stream)
    assert len([r for r in caplog.records if r.name == "gem4.engine"]) == 1
    wait_idle(engine)
    assert engine.kv_cache_usage == 0


def test_n_is_checked_at_submit():
    engine = Engine(NoisyModel(), max_num_seqs=4)
    for bad in (0, 5, True, 2.0):
        with pytest.raises(InvalidParameter, match=r"\[1, 4\]") as info:
            engine.submit([1, 2], SamplingParams(max_tokens=1), n=bad)
        assert info.value.param == "n"
    with pytest.raises(InvalidParameter, match="seed \\+ n - 1") as info:
        engine.submit([1, 2], SamplingParams(seed=2**64 - 2, max_tokens=1), n=3)
    assert info.value.param == "seed"
    assert len(choices(engine.submit([1, 2], SamplingParams(seed=2**64 - 2, max_tokens=1), n=2))) == 2


def test_scheduler_forks_the_choices_at_the_prompts_last_chunk():
    def seq(name, n, index=0):
        return Sequence(name, list(range(n)), GREEDY, max_tokens=4, end_ids=(), index=index)

    bm = BlockManager(num_blocks=8, block_size=4, num_sliding_blocks=8, window=2)
    sched = Scheduler(bm, max_chunk=4, max_num_seqs=3, max_num_batched_tokens=6)
    parent, c1, c2 = seq("r", 6), seq("r", 6, 1), seq("r", 6, 2)
    parent.forks = [c1, c2]
    late = seq("late", 2)
    sched.add(parent)
    sched.add(late)

    def plan(batch):
        return [(ch.seq.index, ch.start, ch.num_tokens, ch.source) for ch in batch.chunks]

    batch = sched.schedule()
    assert plan(batch) == [(0, 0, 4, None)] and batch.block_copies == batch.sliding_copies == ()  # late waits: r's group fills the seats
    sched.postprocess(batch, [None], 0.0)
    batch = sched.schedule()
    assert plan(batch) == [(0, 4, 2, None), (1, 6, 0, 0), (2, 6, 0, 0)]      # the last chunk samples for three
    assert batch.block_copies == batch.sliding_copies == ()               # the choices share the parent's blocks
    assert bm.table(c1.seq_id) == bm.table(parent.seq_id) == [0, 1] and bm.refs(1) == 3
    sched.postprocess(batch, [[5], [6], [7]], 0.0)
    assert [s.output_ids for s in (parent, c1, c2)] == [[5], [6], [7]] and c2.num_computed == 6
    batch = sched.schedule()                                                # position 6 is in shared block 1
    assert plan(batch) == [(0, 6, 1, None), (1, 6, 1, None), (2, 6, 1, None)]
    assert batch.block_copies == ((1, 2), (1, 3)) and bm.refs(1) == 1      # the last writer keeps block 1
    assert batch.sliding_copies == ((1, 2), (1, 3))                         # and its sliding part (window 2)
    assert sched.remove("r") == [parent, c1, c2] and bm.usage == 0
