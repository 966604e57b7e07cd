"""Constrained decoding (structured outputs) with llguidance: what a request asks for and how it is compiled.

- `spec.py`: `GrammarSpec`, the frozen grammar a request carries in `SamplingParams.structured`, and
  `ThoughtBudget` (`SamplingParams.thought_budget`), a bound on the thought's tokens applied as masks too.
- `vocab.py`: `GrammarVocab`, the llguidance view of a gem4 tokenizer (built once, in the background) and
  the grammars compiled against it (`LLMatcher`s, one per sequence; the engine's runner owns them).
- `stats.py`: `Timing` / `GrammarStats`, compile and mask times for the metrics.

The engine applies the masks (engine/runner.py; the mask is step 0 of the sampler, sampling.py).
docs/structured.md describes the whole path.
"""
from gem4.structured.spec import Budget, GrammarSpec, ThoughtBudget
from gem4.structured.stats import GrammarStats, Timing
from gem4.structured.vocab import GrammarVocab, MatcherError, grammar_vocab

__all__ = ["Budget", "GrammarSpec", "GrammarStats", "GrammarVocab", "MatcherError", "ThoughtBudget", "Timing",
           "grammar_vocab"]
