"""Durations of the constrained-decoding work, for the metrics and the benchmarks.

A `Timing` keeps one kind of duration (a grammar's compile, a step's mask fill, a step's mask apply) twice:
as a Prometheus-style histogram (fixed bucket bounds, counts, sum; what a /metrics scrape reads) and as a
window of the latest observations (what a percentile is taken from). Observations may come from several
threads (a handler compiling a grammar, the engine thread filling masks), so `observe` takes a short lock;
a reader copies under the same lock.
"""
from __future__ import annotations

import bisect
import math
import threading
from collections import Counter, deque
from dataclasses import dataclass, field

# seconds: 10 us .. 1 s (a mask of one row is ~3-25 us, a step's fill and apply for 8 rows ~0.1-2 ms, a
# grammar's compile ~1-6 ms; a hostile grammar is cut off by the parser limits well under 1 s)
TIME_BOUNDS = (1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1, 0.2, 0.5, 1.0)
WINDOW = 4096                                # latest observations kept for percentiles


class Timing:
    """Observed durations (seconds): a histogram over TIME_BOUNDS and a window of the latest WINDOW values."""

    def __init__(self, bounds: tuple[float, ...] = TIME_BOUNDS, window: int = WINDOW):
        self.bounds = bounds
        self._counts = [0] * (len(bounds) + 1)         # per bucket; the last one is +Inf
        self._sum = 0.0
        self._recent: deque[float] = deque(maxlen=window)
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        with self._lock:
            self._counts[bisect.bisect_left(self.bounds, seconds)] += 1
            self._sum += seconds
            self._recent.append(seconds)

    @property
    def count(self) -> int:
        with self._lock:
            return sum(self._counts)

    def histogram(self) -> tuple[list[tuple[float, int]], float]:
        """([(upper bound, cumulative count), ..., (inf, total)], sum of the observations)."""
        with self._lock:
            counts, total = list(self._counts), self._sum
        cumulative, running = [], 0
        for bound, n in zip((*self.bounds, math.inf), counts):
            running += n
            cumulative.append((bound, running))
        return cumulative, total

    def percentile(self, q: float) -> float | None:
        """The q-th percentile (0..100, nearest rank) of the latest observations; None before the first."""
        with self._lock:
            values = sorted(self._recent)
        if not values:
            return None
        rank = min(len(values) - 1, max(0, math.ceil(q / 100 * len(values)) - 1))
        return values[rank]


@dataclass
class GrammarStats:
    """An engine's constrained-decoding counters: each request's grammar compile (0 when a compiled copy
    of the same grammar was at hand), each step's mask fill (all its constrained rows, one batched call)
    and mask apply, and the structured requests by `GrammarSpec.kind`."""

    compile: Timing = field(default_factory=Timing)
    mask: Timing = field(default_factory=Timing)
    apply: Timing = field(default_factory=Timing)
    requests: Counter = field(default_factory=Counter)     # kind -> requests submitted
