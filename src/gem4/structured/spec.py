"""What a constrained request asks for: one llguidance grammar, as a frozen value.

A `GrammarSpec` travels inside `SamplingParams.structured`, so it must stay frozen, hashable and comparable
like every other sampling parameter: it holds the grammar as the top-level string `llguidance.LLMatcher`
takes (what `LLMatcher.grammar_from_lark`, `grammar_from_json_schema` or `grammar_from_regex` return),
not a compiled object. Compiling it against a vocabulary is `GrammarVocab.matcher`'s job (vocab.py); the
engine does it once per sequence, in the engine thread, on its first sample.

`kind` says which API feature built it ("tools_required", "tools_named", "json_schema", "json_object",
"regex", "choice", "grammar", ...); the engine counts structured requests by kind for the metrics and
never reads it otherwise.

Nothing here imports llguidance: SamplingParams (sampling.py) imports this module, and a process that never
constrains a request never loads the library.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GrammarSpec:
    """An llguidance grammar (the string `LLMatcher` takes) and the feature that built it (`kind`)."""

    grammar: str
    kind: str = "grammar"

    def __post_init__(self) -> None:
        if not isinstance(self.grammar, str) or not self.grammar:
            raise TypeError(f"GrammarSpec.grammar must be a non-empty str, got {self.grammar!r:.60}")
        if not isinstance(self.kind, str) or not self.kind:
            raise TypeError(f"GrammarSpec.kind must be a non-empty str, got {self.kind!r:.60}")

    def __repr__(self) -> str:
        shown = self.grammar if len(self.grammar) <= 60 else self.grammar[:57] + "..."
        return f"GrammarSpec(kind={self.kind!r}, grammar={shown!r})"
