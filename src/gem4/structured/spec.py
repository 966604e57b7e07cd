"""What a constrained request asks for: one llguidance grammar, as a frozen value.

A `GrammarSpec` travels inside `SamplingParams.structured`, so it must stay frozen, hashable and comparable
like every other sampling parameter: it holds the grammar as the top-level string `llguidance.LLMatcher`
takes (what `LLMatcher.grammar_from_lark`, `grammar_from_json_schema` or `grammar_from_regex` return),
not a compiled object. Compiling it against a vocabulary is `GrammarVocab.matcher`'s job (vocab.py); the
engine does it once per sequence, in the engine thread, on its first sample.

`kind` says which API feature built it ("tools_required", "tools_named", "json_schema", "json_object",
"regex", "choice", "grammar", ...); the engine counts structured requests by kind for the metrics and
never reads it otherwise.

`ThoughtBudget` is the other constraint a request may carry (`SamplingParams.thought_budget`): at most so many
tokens of thought in the reply (Anthropic's `thinking.budget_tokens`). It is no grammar, since a grammar counts
bytes, not tokens (llguidance's `max_tokens` would count tokens but disables the rollback that verifying
speculative drafts needs); the engine applies it as a bitmask beside the grammar's (engine/grammar.py), so it
works wherever masks do: streaming, `n` choices, speculative decoding (exactly: the mask is step 0 of each
verified row's sampling), with or without a grammar.

Nothing here imports llguidance: SamplingParams (sampling.py) imports this module, and a process that never
constrains a request never loads the library.
"""
from __future__ import annotations

import enum
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


class Budget(enum.Enum):
    """What a thought budget allows at one position (`ThoughtBudget.rule`)."""

    FREE = "free"                  # any token
    CLOSE = "close"                # only the thought's closing token: the thought is spent
    NO_OPEN = "no_open"            # any token but the opening one: the budget is spent, no new thought may open


@dataclass(frozen=True)
class ThoughtBudget:
    """At most `tokens` tokens of thought in a reply. Thought tokens are those generated between `open_id`
    (Gemma 4's `<|channel>`) and `close_id` (`<channel|>`), both excluded: the channel's name (`thought`) and
    its newline count. A thought that reaches the budget is closed (the next token is forced to `close_id`) and the
    answer follows; once the budget is spent no other thought opens. `inside`: the prompt ends inside an open
    thought (a continued reasoning prefill), whose prompt tokens do not count.

    The state is (open, used), a function of the generated ids alone (`advance`), so a preempted sequence, a
    fork and a verified draft each find theirs from the ids they have."""

    tokens: int
    open_id: int
    close_id: int
    inside: bool = False

    def __post_init__(self) -> None:
        for name in ("tokens", "open_id", "close_id"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise TypeError(f"ThoughtBudget.{name} must be an int >= 0, got {value!r:.60}")
        if self.open_id == self.close_id:
            raise TypeError("ThoughtBudget.open_id and close_id must differ")

    def start(self) -> tuple[bool, int]:
        """(open, used) before the first generated token."""
        return self.inside, 0

    def advance(self, state: tuple[bool, int], ids) -> tuple[bool, int]:
        """The state after `ids` were generated from `state`."""
        is_open, used = state
        for t in ids:
            if is_open:
                is_open = t != self.close_id
                used += is_open           # every token inside the thought counts (a repeated <|channel> too)
            else:
                is_open = t == self.open_id
        return is_open, used

    def rule(self, state: tuple[bool, int]) -> Budget:
        """What the next token may be in `state`."""
        is_open, used = state
        if used < self.tokens:
            return Budget.FREE
        return Budget.CLOSE if is_open else Budget.NO_OPEN
