"""Request state: one `Sequence` per choice of a request, plain Python (no tensors).

A request asking for n choices (OpenAI's `n`) is n Sequences with the same `request_id` and indices
0..n-1; each has its own `seq_id` (the key of its KV blocks and its sampling generator). Choice 0 is the
parent: it alone is queued and prefilled, and carries the others in `forks` until the scheduler forks
them off at the step where its prompt's last chunk samples (scheduler.py says how).

A Sequence is built and validated in the caller's thread (`Engine.submit`); from then on only the
engine thread touches it. It knows its token ids, how many of them are in the KV cache
(`num_computed`), and turns each sampled token into the text the client may see:

    token id -> end id?  -> finish "stop"   (the end token's text is never emitted)
             -> incremental detokenizer (complete UTF-8 only, CONTROL tokens dropped)
             -> stop strings (gem4/stops.py): text that could still become a stop string is held
                back; a completed stop string finishes "stop" and neither it nor what follows is emitted
             -> max_tokens reached -> finish "length" (held text is released)

so the concatenated text deltas of a request equal `tokenizer.decode(output, skip_special=True)`
cut before the first stop string (and without a final end token).

Media (docs/multimodal.md §5.4): a request's images and audio clips arrive preprocessed (`MediaInput`: arrays, no
tensors) with the positions of their soft tokens, whose prompt ids are placeholders. The runner turns them into soft
tokens once; the prefix cache keys a sequence by `cache_keys`, its ids with each soft-token position replaced by
(the item's content hash, the token's index in it), so two images (or clips) behind the same placeholder ids never
share K/V.
"""
from __future__ import annotations

import enum
import itertools
from collections.abc import Collection, Sequence as Seq
from dataclasses import dataclass

from gem4.sampling import SamplingParams
from gem4.stops import StopStrings

STOP, LENGTH, ABORT = "stop", "length", "abort"   # finish reasons (OpenAI's names)
MAX_DRAFT_PAUSE = 64     # decode steps without drafts at most, after verification rounds that accepted none


@dataclass(frozen=True, eq=False)
class MediaInput:
    """One media item of a request, preprocessed (gem4.media): its soft tokens take positions
    [start, start + num_tokens) of the prompt."""

    start: int
    num_tokens: int
    kind: str                 # "image" or "video" (one frame; gem4.media.image.ImagePatches in `data`) or "audio"
                              # (a 16 kHz waveform)
    data: object
    digest: str               # a hash of its content: its positions' prefix-cache key
    bidirectional: bool       # its tokens see each other both ways on sliding layers (the model's config says)

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


class Status(enum.Enum):
    WAITING = "waiting"      # submitted, not yet admitted by the scheduler
    RUNNING = "running"      # admitted: prefill chunks, then one decode step at a time
    FINISHED = "finished"


@dataclass(frozen=True)
class RequestStats:
    """Counts and timings of one request (seconds, `time.perf_counter` clock)."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int       # prompt tokens found in the prefix cache (not computed)
    draft_tokens: int        # speculation: drafts checked ...
    accepted_tokens: int     # ... and accepted
    queue_s: float           # submit -> first scheduled
    ttft_s: float            # submit -> first generated token (time to first token)
    prefill_s: float         # first scheduled -> first generated token (the prompt's forward passes)
    decode_s: float          # first generated token -> finish

    @property
    def prompt_tps(self) -> float:
        """Prompt tokens computed (not found in the prefix cache) per second of prefill."""
        computed = self.prompt_tokens - self.cached_tokens
        return computed / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def generation_tps(self) -> float:
        """Tokens after the first one per second of decoding (the first comes from the prefill)."""
        return (self.completion_tokens - 1) / self.decode_s if self.decode_s > 0 else 0.0


@dataclass(frozen=True)
class TokenOutput:
    """What one sampled token produced for the client."""

    token_id: int
    text: str                       # text that became certain ('' while held back)
    finish_reason: str | None       # None while running
    stop_reason: int | str | None   # the end token id or stop string that finished the request


_request_counter = itertools.count()
_seq_counter = itertools.count()


def next_request_id() -> str:
    return f"req-{next(_request_counter)}"


class Sequence:
    """One request: prompt, generated tokens, cache progress, stop logic, timings."""

    def __init__(
        self,
        request_id: str,
        prompt_ids: Seq[int],
        params: SamplingParams,
        *,
        max_tokens: int,
        end_ids: Collection[int],
        detokenizer=None,
        arrival_time: float = 0.0,
        index: int = 0,
        media: Seq[MediaInput] = (),
    ):
        self.request_id = request_id
        self.index = index                            # the choice's index within its request
        self.seq_id = next(_seq_counter)              # unique per sequence: the block manager's and runner's key
        self.forks: list[Sequence] = []               # choice 0 only, until forked: the other choices
        self.prompt_ids: list[int] = list(prompt_ids)
        self.media: tuple[MediaInput, ...] = tuple(media)
        self.spans: tuple[tuple[int, int], ...] = tuple((m.start, m.end) for m in media if m.bidirectional)
        self._prompt_keys: list | None = None
        if media:                                     # soft-token positions keyed by content, not placeholder id
            self._prompt_keys = list(self.prompt_ids)
            for m in media:
                self._prompt_keys[m.start:m.end] = [(m.digest, i) for i in range(m.num_tokens)]
        self.output_ids: list[int] = []
        self.params = params
        self.max_tokens = max_tokens                  # params.max_tokens, or what the context leaves
        self.stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.goes_past_end else frozenset(end_ids))
        self.status = Status.WAITING
        self.num_computed = 0                         # token_ids[:num_computed] are in the KV cache
        self.num_cached_tokens: int | None = None     # prompt tokens the prefix cache held at its first admission
        self.num_draft_tokens = 0                     # speculation: drafts verified for it ...
        self.num_accepted_tokens = 0                  # ... and accepted
        self.draft_misses = 0                         # verification rounds in a row that accepted no draft
        self.draft_pause = 0                          # decode steps left to run without drafts (back-off)
        self.draft_limit = 0                          # most drafts its next round may carry; 0: speculation's K
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self._detok = detokenizer                     # None: token ids only, no text
        self._stops = StopStrings(params.stop)
        self.arrival_time = arrival_time
        self.scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finish_time: float | None = None

    # ---- views ----

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def cache_keys(self) -> list:
        """What the prefix cache names its positions by: the token ids, soft-token positions replaced by (the
        media item's digest, index)."""
        return self.token_ids if self._prompt_keys is None else self._prompt_keys + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_pending(self) -> int:
        """Tokens not yet in the cache: the rest of the prompt while prefilling, then 1 per decode step."""
        return self.num_tokens - self.num_computed

    @property
    def is_finished(self) -> bool:
        return self.status == Status.FINISHED

    # ---- state changes (engine thread) ----

    def append_token(self, token_id: int, now: float) -> TokenOutput:
        """Record a sampled token; decide whether the request ends here and what text it shows."""
        if self.is_finished:
            raise RuntimeError(f"{self.request_id}: token appended after finish")
        self.output_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = now
        if token_id in self.stop_ids:
            return TokenOutput(token_id, self._release_text(), *self._finish(STOP, token_id, now))
        text = self._detok.feed(token_id) if self._detok is not None else ""
        text, matched = self._stops.feed(text)
        if matched is not None:
            return TokenOutput(token_id, text, *self._finish(STOP, matched, now))
        if len(self.output_ids) >= self.max_tokens:
            return TokenOutput(token_id, text + self._release_text(), *self._finish(LENGTH, None, now))
        return TokenOutput(token_id, text, None, None)

    def record_drafts(self, drafted: int, accepted: int) -> None:
        """A verification round's outcome, and how the sequence's next rounds draft (the scheduler reads
        `draft_limit` and `draft_pause`):

        - a round that accepts a draft: the next round may carry K drafts again (`draft_limit` 0), no pause;
        - a round that accepts none of its d drafts, the m-th such round in a row: the next round carries at
          most max(1, d // 2) drafts (K = 7: 7, 3, 1, 1, ...), and from the second such round on the next
          min(4^(m-2), MAX_DRAFT_PAUSE) decode steps draft nothing (1, 4, 16, 64, 64, ...).

        So a drafter that keeps missing (prompt lookup on text that no longer repeats, an assistant that does
        not fit the target) verifies at decode steps 1, 2, 4, 9, 26, 91, 156, ...: 6 rounds in the first 128
        tokens (K = 7: 7, 3, 1, 1, 1, 1 drafts), then one per 65 steps, and past the first two each costs a
        2-row step (~1.15x a decode step) instead of a K + 1-row one (8 rows: ~2x).
        Only a round that accepts nothing shrinks the next one, and only a second miss in a row pauses: with
        drafts right independently of each other (benchmarks/spec.py's forced drafters), one round's outcome
        says little of the next one's, and shrinking after a partial acceptance (to the accepted count + 1,
        as dynamic draft lengths do) or pausing after a single miss loses speed at acceptance 0.7 and 0.9.
        benchmarks/RESULTS.md S ("adaptive draft length") has the measurements and the choice."""
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        if accepted:
            self.draft_misses = self.draft_pause = self.draft_limit = 0
            return
        self.draft_misses += 1
        self.draft_limit = max(1, drafted // 2)
        self.draft_pause = min(4 ** (self.draft_misses - 2), MAX_DRAFT_PAUSE) if self.draft_misses >= 2 else 0

    def abort(self, now: float) -> str:
        """Finish with "abort"; returns the held text (it was not a stop string)."""
        text = self._release_text()
        self._finish(ABORT, None, now)
        return text

    def _release_text(self) -> str:
        """End of stream: flush the detokenizer through the stop-string filter, then the held tail."""
        tail = self._detok.flush() if self._detok is not None else ""
        text, matched = self._stops.feed(tail)
        if matched is not None:
            return text
        return text + self._stops.flush()

    def _finish(self, reason: str, stop_reason: int | str | None, now: float) -> tuple[str, int | str | None]:
        self.status = Status.FINISHED
        self.finish_reason, self.stop_reason = reason, stop_reason
        self.finish_time = now
        return reason, stop_reason

    def stats(self) -> RequestStats:
        end = self.finish_time if self.finish_time is not None else self.arrival_time
        scheduled = self.scheduled_time if self.scheduled_time is not None else end
        first = self.first_token_time if self.first_token_time is not None else end
        return RequestStats(
            prompt_tokens=self.num_prompt_tokens,
            completion_tokens=len(self.output_ids),
            cached_tokens=self.num_cached_tokens or 0,
            draft_tokens=self.num_draft_tokens,
            accepted_tokens=self.num_accepted_tokens,
            queue_s=scheduled - self.arrival_time,
            ttft_s=first - self.arrival_time,
            prefill_s=first - scheduled,
            decode_s=end - first,
        )

    def __repr__(self) -> str:
        choice = f"[{self.index}]" if self.index else ""
        return (f"Sequence({self.request_id!r}{choice}, {self.status.value}, prompt={self.num_prompt_tokens}, "
                f"output={len(self.output_ids)}, computed={self.num_computed})")
