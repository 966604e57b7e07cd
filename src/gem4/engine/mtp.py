"""The Gemma 4 assistant as the engine's drafter (speculative method "mtp"; docs/gemma4.md §5).

The runner owns it (it holds tensors). A sequence's drafts at a step come from its last token, at the
position p its decode step starts from (the target stores [0, p)), and the target's final-normed hidden
state of the row that chose that token: the last prompt row after prefill, the row that predicted the
final emitted token after a verification (`remember`). The assistant drafts greedily, K steps at p, all
sequences of the step in one batch; a sequence asking for fewer drafts takes the first ones.

The assistant reads the target's sliding K/V from p - W - 1 on (`DRAFT_SLACK` more than the target's own
step from p), so the engine keeps that many more sliding positions per sequence (block_manager's window).
"""
from __future__ import annotations

import torch

from gem4.model.assistant import DraftSeq, draft_view

# positions a draft at p reads before the target's own window (from p - W + 1): p - W - 1 and p - W
# (model.assistant.sliding_reads_from)
DRAFT_SLACK = 2


class MtpDrafter:
    def __init__(self, assistant, target, pool, blocks, num_speculative_tokens: int):
        self.assistant = assistant
        self.target = target
        self.pool = pool
        self.blocks = blocks                       # read only, as the runner's
        self.num_speculative_tokens = num_speculative_tokens
        self._hidden: dict[int, torch.Tensor] = {}   # seq_id -> [H] the state its next drafts start from

    def remember(self, seq_id: int, hidden: torch.Tensor) -> None:
        """hidden [H]: the target's final-normed state of the row that chose the sequence's last token."""
        self._hidden[seq_id] = hidden

    def forget(self, seq_id: int) -> None:
        self._hidden.pop(seq_id, None)

    def draft(self, chunks) -> list[list[int]]:
        """Per decode chunk (draft_slots > 0), up to its slots of drafts ([] for a sequence without a state)."""
        ready = [c for c in chunks if c.seq.seq_id in self._hidden and c.start >= 1]
        out = {id(c): [] for c in chunks}
        if ready:
            view = draft_view(self.pool, [DraftSeq(c.start, self.blocks.table(c.seq.seq_id),
                                                   self.blocks.sliding_table(c.seq.seq_id)) for c in ready])
            tokens = torch.tensor([c.seq.token_ids[c.start] for c in ready], device=self.pool.device)   # [B]
            hidden = torch.stack([self._hidden[c.seq.seq_id] for c in ready])                            # [B, H]
            drafts = self.assistant.draft(self.target, tokens, hidden, view, self.pool,
                                          max(c.draft_slots for c in ready)).tokens.tolist()          # [B, K]
            for c, d in zip(ready, drafts):
                out[id(c)] = d[:c.draft_slots]
        return [out[id(c)] for c in chunks]
