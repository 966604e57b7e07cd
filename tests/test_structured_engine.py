"""Constrained decoding in the engine (issue 28): the grammar vocabulary, the mask as step 0 of the sampler,
one matcher per sequence (forks, preemption, abort), the grammar's end, and speculation staying exact.

The tiny random models (tests/model_fixtures.py, vocabulary 512) run with the tiny tokenizer (the first 512
real Gemma 4 tokens: every special token, the byte tokens, common pieces), so grammars can name Gemma's
special tokens and spell any text. A random model's output is whatever the grammar lets it be: every check
reads the output back through a fresh matcher (it must accept all of it, end included) or a regex.
"""
from __future__ import annotations

import dataclasses
import re
import time

import llguidance
import pytest
import torch

import gem4
from gem4 import Engine, SamplingParams
from gem4.engine import EngineError, InvalidParameter
from gem4.engine.pool import kv_pool_size
from gem4.sampling import Sampler, apply_grammar_mask
from gem4.structured import Budget, GrammarSpec, GrammarVocab, MatcherError, ThoughtBudget, Timing, grammar_vocab
from test_engine import wait_idle
from test_spec_decode import Oracle, with_drafter
from text_fixtures import tiny_tokenizer

NAMES = ("get_weather", "search")
TOOL_CALL = GrammarSpec(llguidance.LLMatcher.grammar_from_lark(r"""
start: call+
call: <|tool_call> "call:" NAME "{" "city:" <|"|> TEXT <|"|> "}" <tool_call|>
NAME: "get_weather" | "search"
TEXT: /[a-z ]{1,12}/
"""), "tools_required")
# the tokenizer's text of the three end ids, in decoded output
END = r"(<eos>|<turn\|>|<\|tool_response>)"
TOOL_CALL_RE = re.compile(r'(<\|tool_call>call:(get_weather|search)\{city:<\|"\|>[a-z ]{1,12}<\|"\|>\}<tool_call\|>)+' + END)
WORDS = GrammarSpec(llguidance.LLMatcher.grammar_from_regex(r"[a-z]{1,6}( [a-z]{1,6}){0,30}"), "regex")
WORDS_RE = re.compile(r"[a-z]{1,6}( [a-z]{1,6}){0,30}")


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model(variants):
    return gem4.load(variants["dense_plain"].hf_causal, dtype="float32")


@pytest.fixture(scope="module")
def fast_model(variants):
    return gem4.load(variants["dense_plain"].gguf["q8_0"], dtype="bfloat16")


def ids_of(events) -> list[int]:
    return [e.token_id for e in events]


def accepted(engine: Engine, spec: GrammarSpec, ids: list[int]) -> bool:
    """A fresh matcher takes every id and, after the final end id, has stopped: the output is a whole sentence
    of the grammar."""
    matcher = engine.grammar_vocab.matcher(spec)
    return matcher.consume_tokens(ids) and matcher.is_stopped() and not matcher.is_error()


# ---------------------------------------------------------------------------------------------
# The grammar vocabulary
# ---------------------------------------------------------------------------------------------


def test_the_vocabulary_view_names_gemmas_special_tokens(tok):
    vocab = GrammarVocab(tok)
    lt = vocab.lltokenizer(timeout=60)
    assert lt.vocab_size == tok.vocab_size == 512
    assert sorted(lt.eos_tokens) == sorted(tok.special.end_of_generation) == [1, 50, 106]
    special = tok.special
    for i in (special.tool_call_start, special.tool_call_end, special.string_delim, special.channel_start,
              special.channel_end, special.turn_end, special.bos):
        assert lt.is_special_token(i), tok.id_to_piece(i)
    assert not lt.is_special_token(tok.encode("a", add_bos=False)[0])

    def allowed(matcher) -> list[int]:
        mask = torch.tensor(list(matcher.compute_bitmask()), dtype=torch.uint8)
        return torch.nonzero(mask.unsqueeze(-1) >> torch.arange(8) & 1).mul(torch.tensor([8, 1])).sum(1).tolist()

    # a grammar names a special token by its text: exactly that id is allowed, and only it
    for text, want in (("<|tool_call>", 48), ('<|"|>', 52), ("<|channel>", 100), ("<channel|>", 101)):
        m = vocab.matcher(GrammarSpec(llguidance.LLMatcher.grammar_from_lark(f"start: {text} \"x\"")))
        assert allowed(m) == [want] and tok.id_to_piece(want) == text
    # free text never produces a special token, even one whose text it could spell
    m = vocab.matcher(GrammarSpec(llguidance.LLMatcher.grammar_from_regex(r"(?s:.{1,40})")))
    free = set(allowed(m))
    assert not free & tok.structural_ids and len(free) > 400
    # the end ids are allowed exactly where the grammar may end
    m = vocab.matcher(GrammarSpec(llguidance.LLMatcher.grammar_from_regex("ab")))
    assert not set(allowed(m)) & {1, 50, 106}
    assert m.consume_tokens(tok.encode("ab", add_bos=False))
    assert set(allowed(m)) == {1, 50, 106}


def test_the_vocabulary_is_padded_to_the_model_and_refuses_a_larger_tokenizer(tok):
    padded = GrammarVocab(tok, vocab_size=520)
    assert padded.lltokenizer(timeout=60).vocab_size == 520
    m = padded.matcher(WORDS)
    words = torch.tensor(list(m.compute_bitmask()), dtype=torch.uint8)
    assert words.numel() == 4 * 17 and int(words[512 // 8:].sum()) == 0       # 17 words; the padding: never allowed
    small = GrammarVocab(tok, vocab_size=500)
    with pytest.raises(MatcherError, match="512 tokens, more than the model's vocabulary of 500"):
        small.lltokenizer(timeout=60)
    with pytest.raises(MatcherError, match="end-of-generation"):
        GrammarVocab(tok, eos_ids=()).lltokenizer(timeout=60)


def test_grammars_compile_once_and_bad_ones_raise(tok):
    vocab = GrammarVocab(tok)
    timing = Timing()
    ab = GrammarSpec(llguidance.LLMatcher.grammar_from_regex("ab"), "regex")
    a, b = vocab.matcher(ab, timing), vocab.matcher(ab, timing)
    assert timing.count == 1 and a is not b                     # the second is a copy of the first compile
    ids = tok.encode("ab", add_bos=False)
    assert a.consume_tokens(ids) and a.validate_tokens(ids) == 0 and b.validate_tokens(ids) == 2   # b: at the start
    with pytest.raises(MatcherError, match="cannot be used"):
        vocab.matcher(GrammarSpec("start: nonexistent_rule", "grammar"))
    assert grammar_vocab(tok) is grammar_vocab(tok)            # engines sharing a tokenizer share its view
    assert grammar_vocab(tok, 520) is not grammar_vocab(tok)


def test_grammar_spec_is_a_frozen_sampling_parameter():
    spec = GrammarSpec("start: \"a\"", "grammar")
    assert SamplingParams(structured=spec) == SamplingParams(structured=GrammarSpec("start: \"a\"", "grammar"))
    assert hash(SamplingParams(structured=spec)) == hash(SamplingParams(structured=spec))
    with pytest.raises(InvalidParameter, match="structured"):
        SamplingParams(structured="start: \"a\"")
    with pytest.raises(TypeError):
        GrammarSpec("")


# ---------------------------------------------------------------------------------------------
# The mask: step 0 of the sampler
# ---------------------------------------------------------------------------------------------


def pack(allowed: torch.Tensor) -> torch.Tensor:
    """bool [B, V] -> llguidance's bitmask [B, ceil(V / 32)] int32 (token t: bit t % 32 of word t // 32)."""
    batch, vocab = allowed.shape
    words = (vocab + 31) // 32
    bits = torch.zeros(batch, words * 32, dtype=torch.int64)
    bits[:, :vocab] = allowed.long()
    value = (bits.view(batch, words, 32) << torch.arange(32)).sum(-1)           # [B, W] in [0, 2^32)
    return torch.where(value >= 2**31, value - 2**32, value).to(torch.int32)


def test_apply_grammar_mask_against_the_bits_one_by_one():
    gen = torch.Generator().manual_seed(0)
    for vocab in (32, 77, 512):
        allowed = torch.rand(4, vocab, generator=gen) < 0.3
        allowed[2, :] = False
        allowed[2, vocab - 1] = True                                      # the last id alone
        logits = torch.randn(4, vocab, generator=gen)
        masks = pack(allowed)
        got = apply_grammar_mask(logits.clone(), torch.arange(4), masks)
        for b in range(4):
            for t in range(vocab):
                assert got[b, t] == (logits[b, t] if allowed[b, t] else float("-inf"))
        # some rows constrained: the others untouched
        some = apply_grammar_mask(logits.clone(), torch.tensor([3, 0]), masks[[3, 0]])
        assert torch.equal(some[[0, 3]], got[[0, 3]]) and torch.equal(some[[1, 2]], logits[[1, 2]])
        assert torch.equal(apply_grammar_mask(logits.clone(), torch.tensor([], dtype=torch.long), masks[:0]), logits)
    with pytest.raises(ValueError, match="does not cover"):
        apply_grammar_mask(torch.zeros(1, 65), torch.tensor([0]), torch.zeros(1, 2, dtype=torch.int32))


def test_no_bias_or_penalty_revives_a_masked_token_and_logprobs_are_constrained():
    vocab = 40
    logits = torch.linspace(-2, 2, vocab).repeat(2, 1)                    # the largest logit: id 39
    allowed = torch.zeros(2, vocab, dtype=torch.bool)
    allowed[:, [3, 7, 11]] = True
    mask = pack(allowed)
    params = SamplingParams(temperature=0, logit_bias={39: 100, 38: 100}, repetition_penalty=0.01,
                            presence_penalty=-2, logprobs=True, top_logprobs=5)
    out = Sampler().sample(logits, [params, params], [[39, 38], []], [[39], [38]], grammar=(torch.arange(2), mask))
    assert out.token_ids == [11, 11]                                      # the best allowed token, not 39/38
    for top in out.top_logprobs:                                          # three allowed tokens: three entries
        assert [t for t, _ in top] == [11, 7, 3]
        assert sum(torch.tensor([v for _, v in top]).exp()) == pytest.approx(1.0)
    # seeded sampling only ever draws allowed tokens
    seeded = SamplingParams(temperature=5.0, logit_bias={39: 100})
    gen = torch.Generator().manual_seed(1)
    draws = {Sampler().sample(logits[:1], [seeded], [[]], generators=[gen], grammar=(torch.tensor([0]), mask[:1]))
             .token_ids[0] for _ in range(60)}
    assert draws == {3, 7, 11}
    # an unconstrained batch mate is untouched
    out = Sampler().sample(logits, [SamplingParams(temperature=0)] * 2, [[], []], grammar=(torch.tensor([0]), mask[:1]))
    assert out.token_ids == [11, 39]


# ---------------------------------------------------------------------------------------------
# Through the engine
# ---------------------------------------------------------------------------------------------


def test_greedy_and_seeded_output_follows_the_grammar(model, tok):
    engine = Engine(model, tok, prefill_chunk=8, max_num_seqs=4)
    prompt = tok.encode("the weather in paris")
    for params in (SamplingParams(temperature=0, max_tokens=200, structured=TOOL_CALL),
                   *(SamplingParams(temperature=1.0, seed=s, max_tokens=200, structured=TOOL_CALL) for s in range(4))):
        events = list(engine.generate(prompt, params))
        ids = ids_of(events)
        assert TOOL_CALL_RE.fullmatch(tok.decode(ids)), tok.decode(ids)
        assert events[-1].finish_reason == "stop" and ids[-1] in tok.special.end_of_generation
        assert accepted(engine, TOOL_CALL, ids)
    # the same seed gives the same constrained tokens, alone or beside other requests
    seeded = SamplingParams(temperature=1.0, seed=9, max_tokens=60, structured=WORDS)
    alone = ids_of(engine.generate(prompt, seeded))
    others = [engine.submit(tok.encode(f"other {i}"), SamplingParams(temperature=1.0, seed=i, max_tokens=30))
              for i in range(2)]
    mine = engine.submit(prompt, seeded)
    assert ids_of(mine) == alone and all(len(ids_of(s)) == 30 for s in others)
    assert WORDS_RE.fullmatch(tok.decode(alone[:-1] if alone[-1] in tok.special.end_of_generation else alone))
    stats = engine.grammar_stats
    assert stats.requests == {"tools_required": 5, "regex": 2}
    assert stats.compile.count == 2 and stats.mask.count > 50 and stats.apply.count == stats.mask.count
    wait_idle(engine)
    assert len(engine._runner.matchers) == 0


def test_the_grammar_end_is_the_requests_end_and_max_tokens_cuts_with_length(model, tok):
    engine = Engine(model, tok, prefill_chunk=8)
    prompt = tok.encode("yes or no")
    choice = GrammarSpec(llguidance.LLMatcher.grammar_from_lark('start: "yes" | "no"'), "choice")
    for params in (SamplingParams(temperature=0, structured=choice),
                   SamplingParams(temperature=0, structured=choice, ignore_eos=True)):   # the grammar still ends it
        events = list(engine.generate(prompt, params))
        text = tok.decode(ids_of(events)[:-1])
        assert text in ("yes", "no") and events[-1].finish_reason == "stop"
        assert events[-1].token_id in tok.special.end_of_generation
    events = list(engine.generate(prompt, SamplingParams(temperature=0, max_tokens=3, structured=TOOL_CALL)))
    assert len(events) == 3 and events[-1].finish_reason == "length"
    assert tok.decode(ids_of(events)).startswith("<|tool_call>")


def test_logit_bias_cannot_force_a_masked_token_and_logprobs_leave_masked_tokens_out(model, tok):
    engine = Engine(model, tok, prefill_chunk=8)
    prompt = tok.encode("pick")
    a, b, c = (tok.encode(x, add_bos=False)[0] for x in "abc")
    ab = GrammarSpec(llguidance.LLMatcher.grammar_from_regex("[ab]{4}"), "regex")
    params = SamplingParams(temperature=0, max_tokens=10, structured=ab, logit_bias={c: 100, 1: 100, 106: 100},
                            logprobs=True, top_logprobs=5)
    events = list(engine.generate(prompt, params))
    assert set(ids_of(events)[:4]) <= {a, b} and ids_of(events)[4] in tok.special.end_of_generation
    for e in events[:4]:
        assert {t for t, _ in e.top_logprobs} <= {a, b} and e.logprob > float("-inf")
    # only the end ids may follow "abab...": the top list holds them alone
    assert {t for t, _ in events[4].top_logprobs} <= set(tok.special.end_of_generation)
    # a forced token (the grammar allows one id) has probability 1
    forced = list(engine.generate(prompt, SamplingParams(temperature=0, max_tokens=2, structured=TOOL_CALL,
                                                         logprobs=True, top_logprobs=3)))
    assert forced[0].top_logprobs == [(48, 0.0)] and forced[0].logprob == 0.0


def test_n_choices_fork_the_matcher(model, tok):
    engine = Engine(model, tok, prefill_chunk=8, max_num_seqs=4)
    prompt = tok.encode("the weather in rome")
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=200, structured=TOOL_CALL)
    got: dict[int, list[int]] = {}
    for e in engine.submit(prompt, params, n=3):
        got.setdefault(e.index, []).append(e.token_id)
    assert sorted(got) == [0, 1, 2]
    for i, ids in got.items():
        assert TOOL_CALL_RE.fullmatch(tok.decode(ids)), tok.decode(ids)
        # choice i is the single request with seed + i (vLLM's rule), constrained the same way
        alone = ids_of(engine.generate(prompt, SamplingParams(temperature=1.0, seed=5 + i, max_tokens=200,
                                                              structured=TOOL_CALL)))
        assert ids == alone
    assert len({tuple(ids) for ids in got.values()}) > 1
    wait_idle(engine)
    assert len(engine._runner.matchers) == 0


def test_preemption_keeps_the_matcher(model, tok):
    letters = GrammarSpec(llguidance.LLMatcher.grammar_from_regex("[a-z]{60,200}"), "regex")   # no end in 40 tokens
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=40, structured=letters) for s in range(4)]
    prompts = [tok.encode(f"say {w}") for w in ("one", "two", "three", "four")]
    want = [ids_of(Engine(model, tok, prefill_chunk=8).generate(p, q)) for p, q in zip(prompts, params)]
    size = kv_pool_size(model.config, model.dtype, max_chunk=8, num_seqs=4, max_model_len=64, prefix_caching=True)
    engine = Engine(model, tok, prefill_chunk=8, max_num_seqs=4, max_model_len=64,
                    kv_cache_bytes=size.num_sliding_blocks * size.sliding_block_bytes + 5 * size.block_bytes)
    streams = [engine.submit(p, q) for p, q in zip(prompts, params)]
    assert [ids_of(s) for s in streams] == want
    assert engine.num_preemptions > 0
    for ids in want:
        assert len(ids) == 40 and re.fullmatch("[a-z]+", tok.decode(ids))


def test_abort_frees_the_matcher_and_a_failing_grammar_fails_its_request_alone(model, tok):
    engine = Engine(model, tok, prefill_chunk=8, max_num_seqs=2)
    endless = GrammarSpec(llguidance.LLMatcher.grammar_from_regex("[a-z]*"), "regex")
    stream = engine.submit(tok.encode("go on"), SamplingParams(temperature=0, ignore_eos=True, structured=endless))
    for _ in range(3):
        stream.get(timeout=30)
    assert len(engine._runner.matchers) == 1
    stream.abort()
    assert [e.finish_reason for e in stream][-1] == "abort"
    wait_idle(engine)
    assert len(engine._runner.matchers) == 0
    # a grammar that does not compile fails its request with the reason; the batch mate goes on
    bad = engine.submit(tok.encode("bad"), SamplingParams(temperature=0, max_tokens=5,
                                                          structured=GrammarSpec("start: undefined_rule")))
    good = engine.submit(tok.encode("good"), SamplingParams(temperature=0, max_tokens=5, structured=WORDS))
    with pytest.raises(EngineError, match="cannot be used") as info:
        list(bad)
    assert isinstance(info.value.__cause__, MatcherError)
    assert len(ids_of(good)) >= 1
    wait_idle(engine)
    assert len(engine._runner.matchers) == 0
    # without a tokenizer, or with structured=False, a constrained request is refused at submit
    for e in (Engine(model, prefill_chunk=8), Engine(model, tok, prefill_chunk=8, structured=False)):
        with pytest.raises(InvalidParameter, match="structured"):
            e.submit([2, 3], SamplingParams(structured=WORDS))


def test_a_sampler_failure_replays_the_constrained_rows_alone_with_their_masks(model, tok):
    """A batched sampler call that raises is replayed row by row (runner.py): each constrained row with its own
    mask, so the constrained batch mates get exactly the tokens they get alone."""
    prompts = {"a": tok.encode("first one"), "b": tok.encode("second"), "c": tok.encode("third request")}
    params = {"a": SamplingParams(temperature=1.0, seed=1, max_tokens=40, structured=TOOL_CALL),
              "b": SamplingParams(temperature=1.0, seed=2, max_tokens=12),
              "c": SamplingParams(temperature=0.7, seed=3, max_tokens=40, structured=WORDS)}
    want = {n: ids_of(Engine(model, tok, prefill_chunk=8).generate(prompts[n], params[n])) for n in ("a", "c")}
    engine = Engine(model, tok, prefill_chunk=8, max_num_seqs=3)
    real = engine._runner.sampler.sample

    def sample(logits, batch_params, *args, **kw):
        out = real(logits, batch_params, *args, **kw)
        if params["b"] in batch_params and len(args[0][batch_params.index(params["b"])]) == 3:
            raise RuntimeError("injected sampler failure")
        return out

    engine._runner.sampler.sample = sample
    streams = {n: engine.submit(prompts[n], params[n], request_id=n) for n in prompts}
    assert {n: ids_of(streams[n]) for n in ("a", "c")} == want
    with pytest.raises(EngineError, match="injected"):
        list(streams["b"])


# ---------------------------------------------------------------------------------------------
# Speculative decoding stays exact
# ---------------------------------------------------------------------------------------------


class GrammarBreaker(Oracle):
    """The oracle's drafts, with every `bad`-th draft round ending in a token the grammar rejects."""

    def __init__(self, continuation, k, wrong, bad, reject):
        super().__init__(continuation, k, wrong)
        self.bad, self.reject, self.rounds = bad, reject, 0

    def propose(self, tokens, max_drafts):
        drafts = super().propose(tokens, max_drafts)
        self.rounds += 1
        if drafts and self.rounds % self.bad == 0:
            drafts = drafts[:-1] + [self.reject]
        return drafts


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_speculative_tokens_equal_plain_constrained_decoding(model, fast_model, tok, dtype):
    m = fast_model if dtype == "bfloat16" else model
    prompt = tok.encode("the weather in oslo and the weather in lima")
    reject = tok.encode("Q", add_bos=False)[0]                  # never allowed by TOOL_CALL (no capitals)
    for params in (SamplingParams(temperature=0, max_tokens=120, structured=TOOL_CALL, logprobs=True),
                   SamplingParams(temperature=0.9, seed=4, max_tokens=120, structured=TOOL_CALL, logprobs=True)):
        want = [(e.token_id, e.logprob) for e in Engine(m, tok, prefill_chunk=8).generate(prompt, params)]
        drafter = GrammarBreaker({tuple(prompt): [t for t, _ in want]}, k=4, wrong=3, bad=2, reject=reject)
        engine = with_drafter(m, drafter, tokenizer=tok)
        got = [(e.token_id, e.logprob) for e in engine.generate(prompt, params)]
        assert [t for t, _ in got] == [t for t, _ in want]
        if dtype == "bfloat16":                                     # the decode kernels, bit for bit
            assert got == want
        else:
            assert [lp for _, lp in got] == pytest.approx([lp for _, lp in want], rel=1e-5, abs=1e-6)
        assert engine.spec_accepted_tokens > engine.spec_drafts > 0
        assert TOOL_CALL_RE.fullmatch(tok.decode([t for t, _ in got]))
    # drafts the grammar rejects are cut before the forward: a drafter proposing only those verifies nothing
    engine = with_drafter(m, GrammarBreaker({}, k=4, wrong=0, bad=1, reject=reject), tokenizer=tok)
    engine._runner.drafter.propose = lambda tokens, max_drafts: [reject] * max_drafts
    greedy = SamplingParams(temperature=0, max_tokens=30, structured=TOOL_CALL)
    assert ids_of(engine.generate(prompt, greedy)) == ids_of(Engine(m, tok, prefill_chunk=8).generate(prompt, greedy))
    assert engine.spec_drafts == 0


def test_prompt_lookup_with_a_grammar_equals_plain_decoding(model, tok):
    words = GrammarSpec(llguidance.LLMatcher.grammar_from_regex(r"(one|two|three)( (one|two|three)){0,40}"), "regex")
    prompt = tok.encode("one two three one two three one two three one two")
    params = SamplingParams(temperature=0, max_tokens=60, structured=words)
    want = ids_of(Engine(model, tok, prefill_chunk=8).generate(prompt, params))
    engine = Engine(model, tok, prefill_chunk=8, max_num_seqs=2,
                    speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
                                        "prompt_lookup_min": 1})
    assert ids_of(engine.generate(prompt, params)) == want
    streams = [engine.submit(prompt, params), engine.submit(tok.encode("two three"), params)]
    assert ids_of(streams[0]) == want and len(ids_of(streams[1])) >= 1
    wait_idle(engine)
    assert len(engine._runner.matchers) == 0


def test_the_vocabulary_builds_while_the_engine_is_idle(model, tok, monkeypatch):
    """The build holds the GIL for most of its time, so the engine starts it only while idle: VOCAB_AFTER_S after
    construction or after its last request, or at once for a constrained request (which waits for it)."""
    from gem4.engine import engine as engine_module
    from gem4.tokenizer import Tokenizer
    from text_fixtures import tiny_tokenizer_dir

    monkeypatch.setattr(engine_module, "VOCAB_AFTER_S", 0.3)
    fresh = Tokenizer.from_file(tiny_tokenizer_dir())                 # a tokenizer whose view is not built yet
    engine = Engine(model, fresh, prefill_chunk=8)
    assert engine.grammar_vocab is grammar_vocab(fresh, model.config.vocab_size, fresh.special.end_of_generation)
    assert not engine.grammar_vocab.started
    stream = engine.submit(fresh.encode("x"), SamplingParams(temperature=0, max_tokens=40))
    stream.get(timeout=30)
    time.sleep(0.5)                                                  # the timer fired while a request ran
    busy = not engine.idle()
    assert not busy or not engine.grammar_vocab.started
    list(stream)
    wait_idle(engine)
    deadline = time.monotonic() + 10
    while not engine.grammar_vocab.ready:                            # idle now: it starts, then completes
        assert time.monotonic() < deadline
        time.sleep(0.05)
    # a constrained request starts it at once
    other = Tokenizer.from_file(tiny_tokenizer_dir())
    engine = Engine(model, other, prefill_chunk=8)
    events = list(engine.generate(other.encode("x"), SamplingParams(temperature=0, max_tokens=8, structured=WORDS)))
    assert engine.grammar_vocab.ready and events[-1].finish_reason in ("stop", "length")
    assert engine.shutdown(timeout=10)



def test_greedy_rows_check_the_argmax_first_and_choose_what_the_mask_chooses():
    """A greedy row without logprobs is masked only when its argmax is refused (sampling.greedy_within_grammar):
    the token is the masked argmax's in every case, ties to the lowest id included; the same with logprobs
    (masked first) and for the unconstrained rows (not masked)."""
    gen = torch.Generator().manual_seed(3)
    plain = SamplingParams(temperature=0, top_k=5, logit_bias={7: 3.0})
    with_logprobs = SamplingParams(temperature=0, logit_bias={7: 3.0}, logprobs=True)
    params = [plain, plain, plain, with_logprobs, plain, plain]
    rows = torch.tensor([0, 2, 3, 5])                                     # 1 and 4 unconstrained
    # the argmax allowed (kept), refused with few allowed ids (argmax over them), refused with many (masked)
    for trial, (vocab, density) in enumerate([(300, 0.7), (300, 0.02), (4099, 0.001), (4099, 0.3)] * 10):
        logits = torch.randn(6, vocab, generator=gen).round(decimals=1)      # many ties
        allowed = torch.rand(6, vocab, generator=gen) < density
        allowed[:, 5] = True
        allowed[:, vocab - 1] = trial % 3 == 0                               # the last id, in the last word
        out = Sampler().sample(logits, params, [[]] * 6, grammar=(rows, pack(allowed)[rows]))
        biased = logits.clone()
        biased[:, 7] += 3.0
        masked = biased.masked_fill(~allowed, float("-inf"))
        want = [int((masked if b in rows.tolist() else biased)[b].argmax()) for b in range(6)]
        assert out.token_ids == want


# ---------------------------------------------------------------------------------------------
# A thought budget: masks where it binds
# ---------------------------------------------------------------------------------------------


def budget_cut(budget: ThoughtBudget, ids: list[int]) -> int:
    """The position at which `budget` first forces the thought closed in an unbudgeted output `ids` (len(ids):
    nowhere)."""
    state = budget.start()
    for k, t in enumerate(ids):
        if budget.rule(state) == Budget.CLOSE:
            return k
        state = budget.advance(state, (t,))
    return len(ids)


def test_a_thought_budget_closes_the_thought_and_the_answer_follows(model, tok):
    """A prompt that ends inside an open thought, a bias that keeps the thought from ending: with a budget of N
    tokens the output is the unbudgeted one up to N thought tokens, then <channel|>, then an answer in which no
    thought opens; a budget that never binds changes nothing; n choices, and speculation (exact), keep it."""
    sp = tok.special
    prompt = tok.encode("<|turn>user\nthe weather<turn|>\n<|turn>model\n<|channel>thought\n", parse_special=True)
    bias = {sp.channel_end: -100, sp.channel_start: 3}
    budget = ThoughtBudget(6, sp.channel_start, sp.channel_end, inside=True)
    engine = Engine(model, tok, prefill_chunk=8, max_num_seqs=4)
    for params in (SamplingParams(temperature=0, max_tokens=40, logit_bias=bias),
                   SamplingParams(temperature=1.0, seed=3, max_tokens=40, logit_bias=bias)):
        plain = ids_of(engine.generate(prompt, params))
        assert sp.channel_end not in plain and len(plain) == 40
        got = ids_of(engine.generate(prompt, dataclasses.replace(params, thought_budget=budget)))
        k = budget_cut(budget, plain)
        assert k < 40 and got[:k] == plain[:k] and got[k] == sp.channel_end
        assert k == 6 and sp.channel_start not in got[k + 1:] and len(got) > k + 1      # the answer follows
        loose = dataclasses.replace(params, thought_budget=dataclasses.replace(budget, tokens=1000))
        assert ids_of(engine.generate(prompt, loose)) == plain
    # a prompt outside a thought: the budget counts from the <|channel> the model writes
    outside = ThoughtBudget(2, sp.channel_start, sp.channel_end)
    opened = SamplingParams(temperature=0, max_tokens=12, logit_bias={sp.channel_start: 100, sp.channel_end: -100})
    got = ids_of(engine.generate(prompt[:-3], dataclasses.replace(opened, thought_budget=outside)))
    first = got.index(sp.channel_start)
    assert sp.channel_end in got
    close = got.index(sp.channel_end)
    assert close == first + 3 and sp.channel_start not in got[close:]
    # n choices: each its own budget state, each the single request with seed + i
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=30, logit_bias=bias, thought_budget=budget)
    choices: dict[int, list[int]] = {}
    for e in engine.submit(prompt, seeded, n=3):
        choices.setdefault(e.index, []).append(e.token_id)
    for i, ids in choices.items():
        assert ids == ids_of(engine.generate(prompt, dataclasses.replace(seeded, seed=7 + i)))
        close = ids.index(sp.channel_end)
        assert close == 6 and sp.channel_start not in ids[close:]
    wait_idle(engine)
    assert len(engine._runner.matchers) == 0
    # speculation: drafts through the forced close, some wrong, give the plain budgeted tokens
    for params in (SamplingParams(temperature=0, max_tokens=40, logit_bias=bias, thought_budget=budget),
                   SamplingParams(temperature=0.9, seed=4, max_tokens=40, logit_bias=bias, thought_budget=budget)):
        want = ids_of(Engine(model, tok, prefill_chunk=8).generate(prompt, params))
        spec = with_drafter(model, Oracle({tuple(prompt): want}, k=4, wrong=3), tokenizer=tok)
        assert ids_of(spec.generate(prompt, params)) == want
        assert spec.spec_accepted_tokens > 0
        # a drafter that always proposes more thought: the drafts the budget rejects are cut before the forward
        stubborn = with_drafter(model, Oracle({}, k=4), tokenizer=tok)
        stubborn._runner.drafter.propose = lambda tokens, max_drafts: [want[0]] * max_drafts
        assert ids_of(stubborn.generate(prompt, params)) == want


def test_a_thought_budget_is_checked_against_the_vocabulary(model, tok):
    engine = Engine(model, tok, prefill_chunk=8)
    with pytest.raises(InvalidParameter, match="thought_budget"):
        engine.submit([2, 3], SamplingParams(thought_budget=ThoughtBudget(4, 100, 10**6)))
    with pytest.raises(TypeError):
        ThoughtBudget(-1, 100, 101)
    with pytest.raises(InvalidParameter, match="thought_budget"):
        SamplingParams(thought_budget=4)
