"""gem4.parser: golden outputs, chunking invariance, argument JSON, prompt-tail states, robustness.

Token streams are written as text and tokenized with the real Gemma 4 tokenizer with specials
parsed, so `<|"|>`, `<|tool_call>`, ... are the single structural tokens a model emits, and rare
characters (🦙) arrive as byte-fallback tokens.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent))
from text_fixtures import real_tokenizer, tiny_tokenizer  # noqa: E402

from gem4 import chat  # noqa: E402
from gem4.parser import (  # noqa: E402
    ArgumentDecoder,
    ContentDelta,
    Expect,
    Gemma4Parser,
    Malformed,
    Mode,
    ReasoningDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    gemma_args_to_json,
    parse,
)

SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def ids_of(text: str, tok=None) -> list[int]:
    return (tok or real_tokenizer()).encode(text, add_bos=False, parse_special=True)


def run(ids, chunks=None, tok=None, **kw):
    """Parse `ids` fed in the given chunk sizes; returns (result, events)."""
    p = Gemma4Parser(tok or real_tokenizer(), call_id_prefix="call_", **kw)
    events, i = [], 0
    for n in chunks or [len(ids)]:
        events += p.feed(ids[i:i + n])
        i += n
    events += p.feed(ids[i:])
    events += p.finish()
    return p.result, events


def summary(events):
    """Everything the events say, independent of how deltas were grouped."""
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    starts = [(e.index, e.id, e.name) for e in events if isinstance(e, ToolCallStart)]
    ends = [(e.index, e.arguments, e.complete) for e in events if isinstance(e, ToolCallEnd)]
    args = {}
    for e in events:
        if isinstance(e, ToolCallArgsDelta):
            args[e.index] = args.get(e.index, "") + e.text
    return content, reasoning, starts, ends, args


def check_consistent(result, events):
    content, reasoning, starts, ends, args = summary(events)
    assert content == result.content
    assert reasoning == (result.reasoning_content or "")
    assert [s[0] for s in starts] == list(range(len(result.tool_calls)))
    assert [e[0] for e in ends] == list(range(len(result.tool_calls)))
    for i, c in enumerate(result.tool_calls):
        assert starts[i][1:] == (c.id, c.name)
        assert args[i] == c.arguments == ends[i][1]
        assert ends[i][2] == c.complete
        assert isinstance(json.loads(c.arguments), dict)
    # events never carry structural text
    for e in events:
        if isinstance(e, (ContentDelta, ReasoningDelta)):
            assert e.text and "<|" not in e.text and "|>" not in e.text


Q = '<|"|>'

# (name, output text, expected fields)
GOLDEN = [
    ("plain", "Hello, world!<turn|>",
     dict(content="Hello, world!", reasoning=None, calls=[], stop=106)),
    ("thinking_then_answer", "<|channel>thought\nI'm\nthinking<channel|>Hello, world!\nWhat's up?<turn|>",
     dict(content="Hello, world!\nWhat's up?", reasoning="I'm\nthinking", calls=[], stop=106)),
    ("one_call", f"<|tool_call>call:get_weather{{city:{Q}Paris{Q}}}<tool_call|><|tool_response>",
     dict(content="", calls=[("get_weather", {"city": "Paris"})], stop=50, finish="tool_calls")),
    ("several_calls",
     f"<|tool_call>call:get_weather{{city:{Q}Paris{Q}}}<tool_call|>"
     f"<|tool_call>call:get_weather{{city:{Q}Berlin{Q},unit:{Q}c{Q}}}<tool_call|>"
     f"<|tool_call>call:get_time{{}}<tool_call|><|tool_response>",
     dict(calls=[("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Berlin", "unit": "c"}),
                 ("get_time", {})], stop=50)),
    ("call_after_thinking",
     f"<|channel>thought\nThe user wants weather.\n<channel|><|tool_call>call:get_weather{{city:{Q}Oslo{Q}}}"
     "<tool_call|><|tool_response>",
     dict(reasoning="The user wants weather.\n", content="", calls=[("get_weather", {"city": "Oslo"})], stop=50)),
    ("tricky_strings",
     f"<|tool_call>call:f{{s:{Q}{{ }} , \" ' \\ \\n\n é 🦙 [ ] : key:value <b>{Q},t:{Q}{Q}}}<tool_call|><|tool_response>",
     dict(calls=[("f", {"s": "{ } , \" ' \\ \\n\n é 🦙 [ ] : key:value <b>", "t": ""})], stop=50)),
    ("empty_arguments", "<|tool_call>call:get_time{}<tool_call|><|tool_response>",
     dict(calls=[("get_time", {})], stop=50)),
    ("nested_values",
     f"<|tool_call>call:set_config{{config:{{theme:{Q}dark{Q},count:3}},"
     f"a:[1,-2.5,1e3,0.5E-2,true,false,null,[],{{}},[[{Q}x{Q}]]]}}<tool_call|><|tool_response>",
     dict(calls=[("set_config", {"config": {"theme": "dark", "count": 3},
                                 "a": [1, -2.5, 1000.0, 0.005, True, False, None, [], {}, [["x"]]]})], stop=50)),
    ("spaces_in_arguments", f"<|tool_call>call:f{{ a : 1 , b :\n[ 1 , 2 ] , c : {Q} x {Q} }}<tool_call|><turn|>",
     dict(calls=[("f", {"a": 1, "b": [1, 2], "c": " x "})], stop=106)),
    ("quoted_and_json_keys", f"<|tool_call>call:f{{{Q}my key{Q}:1,\"j\":2}}<tool_call|><turn|>",
     dict(calls=[("f", {"my key": 1, "j": 2})])),
    ("python_literals", "<|tool_call>call:f{a:None,b:True,c:False}<tool_call|><turn|>",
     dict(calls=[("f", {"a": None, "b": True, "c": False})])),
    ("text_around_calls", "Let me check.<|tool_call>call:f{x:1}<tool_call|>Done<turn|>",
     dict(content="Let me check.Done", calls=[("f", {"x": 1})], stop=106)),
    ("missing_end_marker", "<|tool_call>call:f{a:1}<|tool_response>",
     dict(calls=[("f", {"a": 1})], stop=50, malformed=False)),
    ("call_inside_open_thought", "<|channel>thought\nthinking<|tool_call>call:f{}<tool_call|><|tool_response>",
     dict(reasoning="thinking", calls=[("f", {})], stop=50)),
    ("leading_turn_header", "<|turn>model\nHi<turn|>", dict(content="Hi", stop=106)),
    ("trailing_empty_thought", "Answer.<|channel>thought\n<channel|><turn|>",
     dict(content="Answer.", reasoning="", stop=106)),
    ("stray_tokens_dropped", f"A<channel|>B{Q}C<bos>D<tool_call|>E<|think|>F<tool_response|>G<turn|>",
     dict(content="ABCDEFG", stop=106, malformed=False)),
    ("unknown_channel_is_content", "<|channel>analysis: x<channel|> then<turn|>",
     dict(content="analysis: x then", reasoning=None)),
    ("ignored_after_stop", "Hi<turn|>more text<eos>", dict(content="Hi", stop=106)),
    ("eos_stop", "Hi<eos>", dict(content="Hi", stop=1, finish="stop")),
    ("new_turn_ends", "Hi<|turn>user\nmore", dict(content="Hi", stop=105)),
    ("byte_fallback_text", "Llama 🦙 and ☃ — 日本語<turn|>", dict(content="Llama 🦙 and ☃ — 日本語")),
    ("no_stop", "Unfinished", dict(content="Unfinished", stop=None, finish="length", truncated=False)),
    # cut off by max_tokens
    ("truncated_in_string", f"<|tool_call>call:f{{a:{Q}abc",
     dict(calls=[("f", {"a": "abc"}, False)], stop=None, truncated=True, malformed=False, finish="length")),
    ("truncated_in_number", "<|tool_call>call:f{a:1,b:[12",
     dict(calls=[("f", {"a": 1, "b": [12]}, False)], truncated=True, malformed=False)),
    ("truncated_in_key", "<|tool_call>call:f{a:1,bb", dict(calls=[("f", {"a": 1}, False)], truncated=True)),
    ("truncated_after_key", "<|tool_call>call:f{a:{b:", dict(calls=[("f", {"a": {}}, False)], truncated=True)),
    ("truncated_header", "Sure.<|tool_call>call:get_w", dict(content="Sure.", calls=[], truncated=True, malformed=False)),
    ("truncated_in_reasoning", "<|channel>thought\nstill thinking",
     dict(reasoning="still thinking", content="", truncated=True)),
    # malformed: plain content with a flag
    ("malformed_header", "<|tool_call>cal f{}<tool_call|>done<turn|>",
     dict(content="cal f{}done", calls=[], malformed=True, stop=106)),
    ("malformed_name", "<|tool_call>call:bad name{}<tool_call|><turn|>",
     dict(content="call:bad name{}", calls=[], malformed=True)),
    ("malformed_arguments", "<|tool_call>call:f{a:1 2}<tool_call|>after<turn|>",
     dict(content="2}after", calls=[("f", {"a": 1}, False)], malformed=True, stop=106)),
    ("bare_word_value", "<|tool_call>call:f{city:Paris}<tool_call|><turn|>",
     dict(content="Paris}", calls=[("f", {}, False)], malformed=True)),
    ("unclosed_before_end_marker", f"<|tool_call>call:f{{a:{Q}x{Q}<tool_call|>ok<turn|>",
     dict(content="ok", calls=[("f", {"a": "x"}, False)], malformed=True)),
    ("stop_inside_arguments", f"<|tool_call>call:f{{a:{Q}x<turn|>",
     dict(calls=[("f", {"a": "x"}, False)], malformed=True, stop=106, truncated=False)),
]


@pytest.mark.parametrize("name,text,expected", GOLDEN, ids=[g[0] for g in GOLDEN])
def test_golden(name, text, expected):
    ids = ids_of(text)
    result, events = run(ids, chunks=[1] * len(ids))
    check_consistent(result, events)
    if "content" in expected:
        assert result.content == expected["content"]
    if "reasoning" in expected:
        assert result.reasoning_content == expected["reasoning"]
    if "calls" in expected:
        got = [(c.name, json.loads(c.arguments), c.complete) for c in result.tool_calls]
        want = [(c[0], c[1], c[2] if len(c) > 2 else True) for c in expected["calls"]]
        assert got == want
        assert [c.id for c in result.tool_calls] == [f"call_{i}" for i in range(len(want))]
    if "stop" in expected:
        assert result.stop_token_id == expected["stop"]
    if "finish" in expected:
        assert result.finish_reason == expected["finish"]
    assert result.truncated == expected.get("truncated", False)
    assert result.malformed == expected.get("malformed", False)
    assert result.malformed == bool(result.errors)


@SETTINGS
@given(st.sampled_from(GOLDEN), st.data())
def test_rechunking_gives_identical_results(case, data):
    ids = ids_of(case[1])
    ref_result, ref_events = run(ids, chunks=[1] * len(ids))
    ref = summary(ref_events)
    sizes = data.draw(st.lists(st.integers(1, 6), max_size=len(ids)))
    for chunks in (sizes, [len(ids)], [1] * len(ids)):
        result, events = run(ids, chunks=chunks)
        assert result == ref_result
        assert summary(events) == ref
        check_consistent(result, events)


def test_events_are_merged_within_a_feed():
    ids = ids_of(f"<|channel>thought\nab cd<channel|>ef gh<|tool_call>call:f{{a:{Q}x y{Q}}}<tool_call|><|tool_response>")
    _, events = run(ids)  # one chunk
    assert events == [ReasoningDelta("ab cd"), ContentDelta("ef gh"), ToolCallStart(0, "call_0", "f"),
                      ToolCallArgsDelta(0, '{"a":"x y"}'), ToolCallEnd(0, '{"a":"x y"}', True)]


def test_streaming_is_incremental():
    tok = real_tokenizer()
    p = Gemma4Parser(tok, call_id_prefix="c")
    assert p.feed(ids_of("<|channel>thought\nHmm")) == [ReasoningDelta("Hmm")]
    assert p.mode == Mode.REASONING
    assert p.feed(ids_of("<channel|>Sure")) == [ContentDelta("Sure")]
    assert p.feed(ids_of("<|tool_call>call:")) == []  # header held
    assert p.mode == Mode.CALL_HEADER
    assert p.feed(ids_of("f{a:")) == [ToolCallStart(0, "c0", "f"), ToolCallArgsDelta(0, "{")]
    assert p.feed(ids_of(f"{Q}hi")) == [ToolCallArgsDelta(0, '"a":"hi')]
    assert p.feed(ids_of(f"{Q},n:4")) == [ToolCallArgsDelta(0, '"')]  # the number waits for its end
    assert p.args_decoder is not None and p.args_decoder.expects() & Expect.LITERAL_BODY
    assert p.feed(ids_of("2}")) == [ToolCallArgsDelta(0, ",\"n\":42}"), ToolCallEnd(0, '{"a":"hi","n":42}', True)]
    assert p.mode == Mode.CALL_END
    assert p.feed(ids_of("<tool_call|><|tool_response>")) == []
    assert p.mode == Mode.DONE and p.finish() == []
    assert p.result.finish_reason == "tool_calls"


def test_byte_fallback_is_held_until_complete():
    tok = real_tokenizer()
    llama = [238 + b for b in "🦙".encode()]
    p = Gemma4Parser(tok)
    assert [p.feed([i]) for i in llama[:3]] == [[], [], []]
    assert p.feed(llama[3:]) == [ContentDelta("🦙")]
    # a sequence interrupted by a structural token becomes U+FFFD, never half a character
    assert p.feed(llama[:2] + [tok.special.channel_start]) == [ContentDelta("\ufffd")]


# ---- generated tool calls: arguments round-trip through the template's own value syntax ----------

STRUCTURAL_TEXTS = [t for i, t in enumerate(real_tokenizer().tokens) if real_tokenizer().is_structural(i)]
safe_text = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\u2581"), max_size=20).filter(
    lambda s: not any(t in s for t in STRUCTURAL_TEXTS))
keys = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,8}", fullmatch=True)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**15, 10**15)
    | st.floats(allow_nan=False, allow_infinity=False) | safe_text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner, max_size=4),
    max_leaves=12)
arguments = st.dictionaries(keys, json_values, max_size=5)


def render_call(name, args):
    # exactly how the official chat template writes a call (docs/gemma4.md §7.3)
    text = chat.render([{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": name, "arguments": args}}]}], template=None)
    return text[text.index("<|tool_call>"):text.index("<tool_call|>") + len("<tool_call|>")]


def jsonable(v):
    # the template writes None as `None`; the parser reads it back as null
    return json.loads(json.dumps(v))


@SETTINGS
@given(st.lists(arguments, min_size=1, max_size=3), safe_text, st.data())
def test_generated_calls_round_trip_and_rechunk(calls, prefix, data):
    text = prefix.replace("<", "") + "".join(render_call(f"tool_{i}", a) for i, a in enumerate(calls)) + "<|tool_response>"
    ids = ids_of(text)
    ref_result, ref_events = run(ids, chunks=[1] * len(ids))
    check_consistent(ref_result, ref_events)
    assert not ref_result.malformed and ref_result.stop_token_id == 50
    assert [json.loads(c.arguments) for c in ref_result.tool_calls] == [jsonable(a) for a in calls]
    assert ref_result.content == prefix.replace("<", "")
    sizes = data.draw(st.lists(st.integers(1, 8), max_size=len(ids)))
    for chunks in (sizes, [len(ids)]):
        result, events = run(ids, chunks=chunks)
        assert result == ref_result and summary(events) == summary(ref_events)


@SETTINGS
@given(arguments, st.integers(1, 200))
def test_truncated_calls_always_close_into_valid_json(args, cut):
    ids = ids_of(render_call("f", args))
    ids = ids[:min(cut, len(ids))]
    result, events = run(ids)
    check_consistent(result, events)
    assert result.stop_token_id is None
    for c in result.tool_calls:
        json.loads(c.arguments)


interesting_ids = st.sampled_from([1, 2, 48, 49, 50, 51, 52, 98, 100, 101, 105, 106, 107, 236743, 236787,
                                   45518, 6639, 2364, 236782, 236783, 236840, 236761, 236778, 238 + 0xF0, 238 + 0x9F,
                                   238 + 0x41, 0, 5, 6])


@SETTINGS
@given(st.lists(st.one_of(interesting_ids, st.integers(0, 262143)), max_size=60), st.data())
def test_random_token_streams_never_raise(ids, data):
    # random ids, dense in structural tokens and the pieces of `call:`, `{`, `}`, `:` ...
    ref_result, ref_events = run(ids, chunks=[1] * len(ids))
    check_consistent(ref_result, ref_events)
    sizes = data.draw(st.lists(st.integers(1, 10), max_size=len(ids)))
    result, events = run(ids, chunks=sizes)
    assert result == ref_result and summary(events) == summary(ref_events)


def test_tokens_outside_the_vocabulary_are_flagged():
    result, _ = run([9259, 300000, 1902])
    assert result.content == "Hello world" and result.malformed


def test_feed_after_finish_is_an_error():
    p = Gemma4Parser(real_tokenizer())
    p.feed([9259])
    p.finish()
    assert p.finish() == []  # idempotent
    with pytest.raises(RuntimeError):
        p.feed([1902])


def test_with_ignore_eos_nothing_ends_the_output():
    """An engine run with ignore_eos generates on past its end ids: the parser reads on too (the end tokens
    and a later <|turn> dropped as stray tokens), where it would otherwise read nothing more."""
    ids = ids_of("A<turn|>B<eos>C<|tool_response>D<|turn>user\nE<|tool_call>call:f{x:1}<tool_call|>")
    stopped, _ = run(ids)
    assert stopped.content == "A" and stopped.stop_token_id == ids[1]
    result, events = run(ids, ignore_eos=True)
    assert result.content == "ABCDuser\nE" and result.stop_token_id is None and not result.malformed
    assert [(c.name, c.arguments) for c in result.tool_calls] == [("f", '{"x":1}')]
    assert summary(events)[0] == result.content
    assert summary(run(ids, chunks=[1] * len(ids), ignore_eos=True)[1]) == summary(events)
    opened, _ = run(ids_of("<|turn>model\nHi<turn|>there"), ignore_eos=True)     # a leading turn header
    assert opened.content == "Hithere"


# ---- where the parser starts ------------------------------------------------------------------------


def test_start_state_from_the_prompt_tail():
    tok = real_tokenizer()
    msgs = [{"role": "user", "content": "Hi"}]
    think_prompt = chat.encode_prompt(tok, msgs, enable_thinking=True)  # ...<|turn>model\n
    plain_prompt = chat.encode_prompt(tok, msgs, enable_thinking=False)  # ...<|channel>thought\n<channel|>
    out = ids_of("<|channel>thought\nR<channel|>C<turn|>")
    for prompt in (think_prompt, plain_prompt):
        r, _ = run(out, prompt_ids=prompt)
        assert (r.reasoning_content, r.content) == ("R", "C")
    r, _ = run(ids_of("C<turn|>"), prompt_ids=plain_prompt)
    assert (r.reasoning_content, r.content) == (None, "C")
    # a prefilled, still-open thought: the output continues the reasoning; the prefill is not repeated
    prefill = think_prompt + ids_of("<|channel>thought\nI began")
    r, events = run(ids_of(" and went on<channel|>answer<turn|>"), prompt_ids=prefill)
    assert (r.reasoning_content, r.content) == (" and went on", "answer")
    assert events[0] == ReasoningDelta(" and went on")
    # the prompt ends inside the channel name
    r, _ = run(ids_of("ught\nR<channel|>C"), prompt_ids=think_prompt + ids_of("<|channel>tho"))
    assert (r.reasoning_content, r.content) == ("R", "C")
    # an explicit start mode
    r, _ = run(ids_of("R<channel|>C"), initial_mode=Mode.REASONING)
    assert (r.reasoning_content, r.content) == ("R", "C")
    with pytest.raises(ValueError):
        Gemma4Parser(tok, initial_mode=Mode.CALL_ARGS)


def test_declared_tool_names():
    text = f"<|tool_call>call:f{{}}<tool_call|><|tool_call>call:g{{a:{Q}x{Q}}}<tool_call|><|tool_response>"
    r, _ = run(ids_of(text), tool_names={"g"})
    assert [c.name for c in r.tool_calls] == ["g"] and r.content == "call:f{}" and r.malformed


def test_copy_is_independent():
    tok = real_tokenizer()
    ids = ids_of(f"<|channel>thought\nx<channel|>A🦙<|tool_call>call:f{{a:{Q}b{Q},c:[1,2]}}<tool_call|><|tool_response>")
    for cut in range(len(ids) + 1):
        p = Gemma4Parser(tok, call_id_prefix="c")
        p.feed(ids[:cut])
        q = p.copy()
        q.feed([106])  # diverge
        q.finish()
        p.feed(ids[cut:])
        p.finish()
        assert p.result == parse(tok, ids, call_id_prefix="c")


def test_works_with_a_small_vocabulary():
    # (no spaces: the 512-token subset lacks '▁', see test_tokenizer.test_tiny_tokenizer_round_trip)
    tiny = tiny_tokenizer()
    text = f"<|channel>thought\nplan:é<channel|>ok<|tool_call>call:f{{q:{Q}Zürich,🦙{Q},n:-1.5}}<tool_call|><|tool_response>"
    ids = ids_of(text, tiny)
    result, events = run(ids, chunks=[1] * len(ids), tok=tiny)
    check_consistent(result, events)
    assert (result.reasoning_content, result.content) == ("plan:é", "ok")
    assert json.loads(result.tool_calls[0].arguments) == {"q": "Zürich,🦙", "n": -1.5}


def test_default_call_ids_are_unique_per_parser():
    a = parse(real_tokenizer(), ids_of("<|tool_call>call:f{}<tool_call|>"))
    b = parse(real_tokenizer(), ids_of("<|tool_call>call:f{}<tool_call|>"))
    assert a.tool_calls[0].id.startswith("call_") and a.tool_calls[0].id != b.tool_calls[0].id


# ---- the argument decoder on its own ------------------------------------------------------------------


def test_gemma_args_to_json():
    assert gemma_args_to_json(f"{{a:{Q}x{Q},b:[1,{{c:null}}]}}") == '{"a":"x","b":[1,{"c":null}]}'
    assert gemma_args_to_json("{}") == "{}"
    assert gemma_args_to_json("  { k : -0.5e-3 }  ") == '{"k":-0.5e-3}'
    for bad in ("{a:1", "[1]", "{a:01}", "{:1}", "{a:1}}", "{a:1}x", "{a::1}", "{a:[1 2]}", "{a:+1}", f"{{a:{Q}x}}"):
        with pytest.raises(ValueError):
            gemma_args_to_json(bad)


def test_argument_decoder_states():
    d = ArgumentDecoder()
    assert d.expects() == Expect.WHITESPACE | Expect.VALUE
    d.feed_text("{")
    assert d.expects() == Expect.WHITESPACE | Expect.KEY | Expect.CLOSE
    d.feed_text("city")
    assert d.expects() == Expect.KEY_BODY
    d.feed_text(":")
    assert d.expects() == Expect.WHITESPACE | Expect.VALUE
    d.feed_quote()
    assert d.expects() == Expect.STRING_BODY
    d.feed_text("Par, is}")
    d.feed_quote()
    assert d.expects() == Expect.WHITESPACE | Expect.COMMA | Expect.CLOSE
    assert d.take() == '{"city":"Par, is}"'
    d.feed_text(",n:[")
    assert d.expects() == Expect.WHITESPACE | Expect.VALUE | Expect.CLOSE
    d.feed_text("1")
    assert d.expects() & Expect.LITERAL_BODY
    assert d.feed_text("]} trailing") == 2 and d.done and d.expects() == Expect.NOTHING
    assert d.take() == ',"n":[1]}'
    e = ArgumentDecoder()
    e.feed_text("{a:[1,")
    with pytest.raises(Malformed) as info:
        e.feed_text(" }")
    assert info.value.position == 1
    e.close()
    assert e.take() == '{"a":[1]}'
