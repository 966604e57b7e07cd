"""Stop strings: their per-request limits, and the one matcher that the engine (completions) and the
server's chat output (`server/outputs.py`, on the content only) both use.

Text reaches the matcher a piece at a time (one token's worth), so `StopStrings.feed(text)` holds back
any tail that could still grow into a stop string and returns the text that is certain:

- the held tail plus the new text is searched; if a stop string occurs there, the one that **starts
  earliest** wins (ties: the longest), the text before it is returned with the string, and the rest of
  the stream is discarded (the caller ends the reply);
- otherwise the longest tail that is a proper prefix of some stop string is held back, the rest
  returned; `flush()` releases the held tail when the stream ends another way.

A match is decided by the text seen so far: with stops `["abcd", "bc"]`, "abcd" fed at once stops at
"abcd", fed a character at a time at "bc" (complete one character earlier). tests/test_stops.py checks
the matcher against that plain search on random texts, stop lists and chunkings.

Cost: the stop strings are compiled once into an Aho-Corasick automaton (a trie of the strings with
failure links; `_automaton` keeps the last 4, so the n choices of one request share one). Each new
character is one trie step plus failure steps that, over a stream, never outnumber its characters; the
state's depth is the held tail's length. So the work per character does not depend on how many stop
strings a request has, nor the held tail on more than the longest of them. The naive search (each string
searched in the text, every prefix of each tested against the tail) cost one request with 60,000 stop
strings about 50 ms per token on the engine thread, and every request batched with it waited for it.

Limits (`check_stops`, applied by `SamplingParams` and the server's request models): at most
MAX_STOP_STRINGS strings of at most MAX_STOP_CHARS characters (code points) each. OpenAI accepts 4
strings and TGI 4 by default; 64 leaves room for every list seen in practice while bounding what one
request can make the server build and hold (64 x 256 = 16K trie nodes at most: about 6 ms and 4 MB,
once per request), and no held tail is longer than 255 characters.
"""
from __future__ import annotations

import functools
from collections.abc import Collection

MAX_STOP_STRINGS = 64      # stop strings per request
MAX_STOP_CHARS = 256       # characters per stop string


def check_stops(stops: Collection[str]) -> None:
    """Raise ValueError (naming the limit) for a list of stop strings beyond the limits above."""
    if len(stops) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
    long = next((s for s in stops if len(s) > MAX_STOP_CHARS), None)
    if long is not None:
        raise ValueError(f"a stop string has at most {MAX_STOP_CHARS} characters, got one of {len(long)}")


class _Automaton:
    """Aho-Corasick over the stop strings. Node 0 is the root (the empty string); node v stands for a
    prefix of some stop string, `depth[v]` characters long. `goto[v]`: its trie children by character;
    `fail[v]`: the node of its longest proper suffix that is also a node; `word[v]`: the longest stop
    string that is a suffix of v's string (None if none is)."""

    def __init__(self, stops: tuple[str, ...]):
        goto: list[dict[str, int]] = [{}]
        depth, word = [0], [None]
        for s in stops:
            v = 0
            for ch in s:
                nxt = goto[v].get(ch)
                if nxt is None:
                    nxt = goto[v][ch] = len(goto)
                    goto.append({})
                    depth.append(depth[v] + 1)
                    word.append(None)
                v = nxt
            word[v] = s
        fail = [0] * len(goto)
        order = list(goto[0].values())               # breadth first: a node's fail node comes before it
        for v in order:
            for ch, child in goto[v].items():
                f = fail[v] if v else 0
                while f and ch not in goto[f]:
                    f = fail[f]
                fail[child] = goto[f].get(ch, 0) if v else 0
                if word[child] is None:               # its own string, if a stop, is longer than any suffix's
                    word[child] = word[fail[child]]
                order.append(child)
        self.goto, self.fail, self.depth, self.word = goto, fail, depth, word

    def step(self, v: int, ch: str) -> int:
        """The node after reading `ch` in node v: the longest suffix of (v's string + ch) that is a node."""
        goto, fail = self.goto, self.fail
        while True:
            nxt = goto[v].get(ch)
            if nxt is not None:
                return nxt
            if not v:
                return 0
            v = fail[v]


@functools.lru_cache(maxsize=4)
def _automaton(stops: tuple[str, ...]) -> _Automaton:
    return _Automaton(stops)


class StopStrings:
    """Streams text, holding back any tail that could still grow into a stop string.

    feed(text) -> (text safe to emit, stop string matched or None). After a match the rest of the
    stream is discarded; `flush()` releases the held tail when the stream ends otherwise.
    """

    def __init__(self, stops: Collection[str]):
        self.stops = tuple(stops)
        self._automaton = _automaton(self.stops) if self.stops else None
        self._longest = max(map(len, self.stops), default=0)
        self._node = 0                                # the automaton's state: the held tail's node
        self._held = ""

    def feed(self, text: str) -> tuple[str, str | None]:
        buf = self._held + text
        a = self._automaton
        if a is None:
            self._held = ""
            return buf, None
        # a match can only end in the new text (the held tail holds none) and start in the held tail
        v, base = self._node, len(self._held)
        best, best_start = None, len(buf)
        for j, ch in enumerate(text):
            end = base + j + 1
            if end - self._longest > best_start:      # nothing ending here or later starts as early
                break
            v = a.step(v, ch)
            s = a.word[v]                             # the longest stop ending here starts earliest
            if s is not None and end - len(s) <= best_start:
                best, best_start = s, end - len(s)    # a later end with the same start is longer
        if best is not None:
            self._node, self._held = 0, ""
            return buf[:best_start], best
        keep = a.depth[v]
        self._node, self._held = v, buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep], None

    def flush(self) -> str:
        held, self._held, self._node = self._held, "", 0
        return held
