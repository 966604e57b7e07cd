"""Stop strings (gem4/stops.py): the automaton matcher equals the plain search on any text, stop list
and chunking; its work per character does not grow with the number of stop strings; the limits."""
from __future__ import annotations

import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gem4.stops import MAX_STOP_CHARS, MAX_STOP_STRINGS, StopStrings, check_stops


class PlainStopStrings:
    """The reference: each feed searches every stop string in held tail + text (earliest start wins, ties
    the longest) and holds back the longest tail that is a proper prefix of one of them."""

    def __init__(self, stops):
        self.stops = tuple(stops)
        self._held = ""

    def feed(self, text):
        buf = self._held + text
        hits = [(i, s) for s in self.stops if (i := buf.find(s)) >= 0]
        if hits:
            i, s = min(hits, key=lambda h: (h[0], -len(h[1])))
            self._held = ""
            return buf[:i], s
        keep = max((k for s in self.stops for k in range(min(len(s) - 1, len(buf)), 0, -1)
                    if buf.endswith(s[:k])), default=0)
        self._held = buf[len(buf) - keep:]
        return buf[:len(buf) - keep], None

    def flush(self):
        held, self._held = self._held, ""
        return held


def run(matcher, pieces):
    """Every feed's result, then the flush (or None after a match): the whole observable behaviour."""
    out = []
    for p in pieces:
        out.append(matcher.feed(p))
        if out[-1][1] is not None:
            return out, None
    return out, matcher.flush()


def test_table():
    s = StopStrings(["abc", "bd"])
    assert s.feed("xa") == ("x", None)
    assert s.feed("b") == ("", None)                              # "ab" could become "abc"; "b" could become "bd"
    assert s.feed("d") == ("a", "bd")
    s = StopStrings(["world", "o, w"])
    assert s.feed("Hello, world") == ("Hell", "o, w")             # both complete: "o, w" starts first
    s = StopStrings(["ab", "abc", "b"])
    assert s.feed("xabc") == ("x", "abc")                         # same start: the longest
    s = StopStrings(["abcd", "bc"])
    assert s.feed("abcd") == ("", "abcd")                         # seen at once: the earliest start
    s = StopStrings(["abcd", "bc"])
    assert [s.feed(c) for c in "abc"] == [("", None), ("", None), ("a", "bc")]   # "bc" completes first
    s = StopStrings(["aab"])
    assert [s.feed(c) for c in "aaac"] == [("", None), ("", None), ("a", None), ("aac", None)]
    assert s.flush() == ""
    s = StopStrings(["end"])
    assert (s.feed("the en"), s.flush(), s.feed("d")) == (("the ", None), "en", ("d", None))   # flush forgets
    assert StopStrings([]).feed("abc") == ("abc", None)


# small alphabets, so stops overlap, nest and recur in the text
_text = st.text(alphabet="abc☕", max_size=40)
_stops = st.lists(st.text(alphabet="abc☕", min_size=1, max_size=6), max_size=6)


@st.composite
def _chunked(draw):
    text = draw(_text)
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=12)))
    return [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]


@settings(max_examples=600, deadline=None)
@given(stops=_stops, pieces=_chunked())
def test_the_automaton_equals_the_plain_search(stops, pieces):
    assert run(StopStrings(stops), pieces) == run(PlainStopStrings(stops), pieces)


@settings(max_examples=300, deadline=None)
@given(stops=_stops, pieces=_chunked(), more=_chunked())
def test_a_matcher_goes_on_after_a_flush_or_a_match_as_a_new_one(stops, pieces, more):
    ours, plain = StopStrings(stops), PlainStopStrings(stops)
    assert run(ours, pieces) == run(plain, pieces)
    assert run(ours, more) == run(plain, more)


def _lines_run(fn) -> int:
    """Python lines executed in gem4/stops.py while `fn` runs: its operation count, machine-independent."""
    import gem4.stops
    here = gem4.stops.__file__
    count = 0

    def trace(frame, event, arg):
        nonlocal count
        if frame.f_code.co_filename != here:
            return None
        if event == "line":
            count += 1
        return trace

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        fn()
    finally:
        sys.settrace(previous)
    return count


def test_work_per_character_does_not_grow_with_the_number_of_stop_strings():
    """The same 4,000 characters, fed one token-sized piece at a time, through a matcher with one stop
    string and through one with the most and longest stop strings allowed, made to keep matching
    partially: the operations executed in the matcher differ by less than 2x (1.3x; the plain search: 1,900x)."""
    text = ("a" * 300 + "b") * 13 + "a" * 87                       # 4,000 characters
    pieces = [text[i:i + 4] for i in range(0, len(text), 4)]
    one = ["zz"]
    many = ["a" * (MAX_STOP_CHARS - 1) + chr(ord("c") + i) for i in range(MAX_STOP_STRINGS)]
    for stops in (one, many):
        StopStrings(stops)                                          # compile outside the count

    def feed_all(stops):
        s = StopStrings(stops)
        for p in pieces:
            assert s.feed(p)[1] is None
        s.flush()

    few, lots = _lines_run(lambda: feed_all(one)), _lines_run(lambda: feed_all(many))
    assert lots < 2 * few, (few, lots)


def test_limits():
    check_stops(["x" * MAX_STOP_CHARS] * MAX_STOP_STRINGS)
    with pytest.raises(ValueError, match=f"at most {MAX_STOP_STRINGS} stop strings, got {MAX_STOP_STRINGS + 1}"):
        check_stops(["x"] * (MAX_STOP_STRINGS + 1))
    with pytest.raises(ValueError, match=f"at most {MAX_STOP_CHARS} characters, got one of {MAX_STOP_CHARS + 1}"):
        check_stops(["x", "y" * (MAX_STOP_CHARS + 1)])
