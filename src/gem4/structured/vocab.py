"""The llguidance view of a gem4 `Tokenizer`, and grammars compiled against it.

llguidance computes, for a grammar state, which token ids may come next (a bitmask over the vocabulary). It
needs the vocabulary as bytes: `LLTokenizer` is built once per tokenizer from `Tokenizer.piece_table()` (the
bytes each id stands for, as decoding writes them). Gemma's CONTROL and USER_DEFINED tokens (`<|tool_call>`,
`<|"|>`, `<|channel>`, `<turn|>`, ...; `Tokenizer.structural_ids`) are passed as special tokens: llguidance
then gives them a byte form no text can produce, so a text rule (a regex, a JSON string) never matches one,
and a grammar names one as `<|tool_call>` (its text) or `<[48]>` (its id). Its EOS tokens are the engine's
end-of-generation ids (`SpecialIds.end_of_generation`: `<eos>`, `<turn|>`, `<|tool_response>`): a grammar
allows them only where it may end.

Building the view for the 262,144-token Gemma 4 vocabulary takes 1-3.5 s (the Python side ~0.1 s, then
llguidance's token trie and mask slices, which hold the GIL for their ~1-3 s). `GrammarVocab` builds it in
a thread of its own (`start()`; made with start=True, at once). Because that thread holds the GIL, every
other Python thread pauses while it runs: the engine starts it only while it is idle (engine.py), and
`lltokenizer()`, which a constrained request needs, starts it if it has not started and waits for it.
Slices: llguidance's general ones plus "any text" (`(?s:.+)`), which makes the masks of free text (a thought,
a Gemma string, prose in `auto`) cheap.

Compiling (`matcher`): `LLMatcher(lltokenizer, grammar, limits=LIMITS)`; a grammar that does not compile
raises `MatcherError`. The first compile of a grammar is kept (an LRU of `MAX_CACHED_GRAMMARS`, by the
grammar string) and every later request with the same grammar (an agent sends the same tools every turn)
gets a `deep_copy` of it (~1 us instead of ~1-6 ms). `LIMITS` bound what one grammar may cost: its size,
the lexer's states, and the work of one mask step (the lexer's fuel and the parser's items), so a hostile
grammar makes its own request fail (the matcher reports an error) instead of stalling the engine thread.
"""
from __future__ import annotations

import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Collection

from gem4.structured.spec import GrammarSpec
from gem4.structured.stats import Timing
from gem4.tokenizer import Tokenizer

MAX_CACHED_GRAMMARS = 64


class MatcherError(RuntimeError):
    """A grammar failed in the engine: constrained decoding is unavailable (the vocabulary view could not be
    built), the grammar does not compile, or its matcher reached an error state (a parser limit, a token it
    rejects). The request that carries it fails with this error; the engine goes on."""

TEXT_SLICE = r"(?s:.+)"

# llguidance's parser limits (their defaults in brackets; speeds from its documentation): one mask step
# costs at most ~7 ms of lexer work (fuel ~14k/ms) and ~1 ms of parser items (~20k/ms) per row; a grammar
# at most 200k symbols and 50k lexer states (~1-2 kB each).
LIMIT_FIELDS = dict(
    step_lexer_fuel=100_000,          # [200_000]
    step_max_items=20_000,            # [50_000]
    max_lexer_states=50_000,          # [250_000]
    max_grammar_size=200_000,         # [500_000]
    initial_lexer_fuel=1_000_000,     # [1_000_000]
    verbose_errors=False,             # errors go back to clients: no parser dumps in them
)


def parser_limits():
    """A fresh `llguidance.LLParserLimits` with LIMIT_FIELDS."""
    import llguidance

    return llguidance.LLParserLimits(**LIMIT_FIELDS)


class _Bytes:
    """What `llguidance.TokenizerWrapper` reads: token bytes, special ids, and a tokenize function (used for
    the tokens a grammar forces, with gem4's own BPE so they are the ids the model knows)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos: int):
        self.tokens = list(tokenizer.piece_table()) + [b""] * (vocab_size - tokenizer.vocab_size)
        self.special_token_ids = sorted(tokenizer.structural_ids)
        self.eos_token_id = eos
        self.bos_token_id = tokenizer.special.bos
        self._tokenizer = tokenizer

    def __call__(self, text: bytes) -> list[int]:
        return self._tokenizer.encode(text.decode("utf-8"), add_bos=False)


class GrammarVocab:
    """A tokenizer's llguidance view (built in a background thread from construction) and the grammars
    compiled against it. Thread-safe: the engine thread and request handlers share one."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int | None = None, eos_ids: Collection[int] | None = None,
                 start: bool = True):
        self.vocab_size = tokenizer.vocab_size if vocab_size is None else vocab_size
        self.eos_ids = tuple(sorted(tokenizer.special.end_of_generation if eos_ids is None else eos_ids))
        self._tokenizer = tokenizer
        self._ready = threading.Event()
        self._result = None                           # the LLTokenizer, or the exception the build raised
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._compiled: OrderedDict[str, object] = OrderedDict()     # grammar -> pristine LLMatcher (LRU)
        self._limits = None
        self.build_seconds: float | None = None
        if start:
            self.start()

    def start(self) -> None:
        """Start the build in its own thread (once; later calls do nothing)."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._build, args=(self._tokenizer,), name="gem4-grammar-vocab",
                                                daemon=True)
                self._thread.start()

    @property
    def started(self) -> bool:
        return self._thread is not None

    def join(self, timeout: float | None = None) -> None:
        """Wait up to `timeout` s for a build in progress (none: return at once)."""
        if self._thread is not None:
            self._thread.join(timeout)

    def _build(self, tokenizer: Tokenizer) -> None:
        start = time.perf_counter()
        try:
            if tokenizer.vocab_size > self.vocab_size:
                raise MatcherError(f"the tokenizer has {tokenizer.vocab_size} tokens, more than the model's "
                                   f"vocabulary of {self.vocab_size}")
            if not self.eos_ids:
                raise MatcherError("constrained decoding needs end-of-generation ids (the grammar's EOS)")
            import llguidance

            wrapper = llguidance.TokenizerWrapper(_Bytes(tokenizer, self.vocab_size, self.eos_ids[0]))
            self._result = llguidance.LLTokenizer(wrapper, n_vocab=self.vocab_size, eos_token=list(self.eos_ids),
                                                  slices=llguidance.LLTokenizer.general_slices() + [TEXT_SLICE])
            self._limits = parser_limits()
        except BaseException as e:                    # noqa: BLE001 - handed to whoever waits for the view
            self._result = e
        self.build_seconds = time.perf_counter() - start
        self._ready.set()

    @property
    def ready(self) -> bool:
        """The view is built (or its build failed): `lltokenizer()` returns at once."""
        return self._ready.is_set()

    def lltokenizer(self, timeout: float | None = None):
        """The `llguidance.LLTokenizer`, waiting for the build (up to `timeout` s: TimeoutError after).
        A build that failed raises its error (MatcherError when the tokenizer cannot be constrained). Starts the
        build if it has not started."""
        self.start()
        if not self._ready.wait(timeout):
            raise TimeoutError(f"the grammar vocabulary is still being built after {timeout} s")
        if isinstance(self._result, BaseException):
            raise MatcherError(f"constrained decoding is unavailable: {self._result}") from self._result
        return self._result

    def matcher(self, spec: GrammarSpec, timing: Timing | None = None):
        """A fresh `llguidance.LLMatcher` for `spec` at its start state: a copy of the grammar's first compile,
        or its first compile (observed in `timing`). Raises MatcherError naming llguidance's error when the
        grammar does not compile (or exceeds LIMITS while compiling). Waits for the vocabulary."""
        tokenizer = self.lltokenizer()
        with self._lock:
            pristine = self._compiled.get(spec.grammar)
            if pristine is not None:
                self._compiled.move_to_end(spec.grammar)
                return pristine.deep_copy()
        import llguidance

        start = time.perf_counter()
        compiled = llguidance.LLMatcher(tokenizer, spec.grammar, log_level=0, limits=self._limits)
        if timing is not None:
            timing.observe(time.perf_counter() - start)
        if compiled.is_error():
            raise MatcherError(f"the {spec.kind} grammar cannot be used: {compiled.get_error()}")
        with self._lock:
            self._compiled[spec.grammar] = compiled
            self._compiled.move_to_end(spec.grammar)
            while len(self._compiled) > MAX_CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        return compiled.deep_copy()


_vocabs: "weakref.WeakKeyDictionary[Tokenizer, dict]" = weakref.WeakKeyDictionary()
_vocabs_lock = threading.Lock()


def grammar_vocab(tokenizer: Tokenizer, vocab_size: int | None = None,
                  eos_ids: Collection[int] | None = None, start: bool = True) -> GrammarVocab:
    """The GrammarVocab of (tokenizer, vocab_size, eos_ids), made at the first call (its build started then
    with `start`, else at its `start()` or first use): engines sharing a tokenizer share its view and its
    compiled grammars."""
    vocab_size = tokenizer.vocab_size if vocab_size is None else vocab_size
    eos = tuple(sorted(tokenizer.special.end_of_generation if eos_ids is None else eos_ids))
    with _vocabs_lock:
        views = _vocabs.setdefault(tokenizer, {})
        if (vocab_size, eos) not in views:
            views[vocab_size, eos] = GrammarVocab(tokenizer, vocab_size, eos, start=start)
        return views[vocab_size, eos]
