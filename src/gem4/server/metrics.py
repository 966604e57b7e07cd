"""Server metrics in the Prometheus text format (version 0.0.4), named `gem4:*` like vLLM's `vllm:*`.

Only the event-loop thread updates and renders them (see app.py's thread model), so there is no
lock. Families:

    gem4:num_requests_running            gauge      requests the engine has admitted (FCFS: the first max_num_seqs)
    gem4:num_requests_waiting            gauge      requests queued behind them
    gem4:request_success                 counter    finished requests, by finished_reason
    gem4:request_rejected                counter    requests refused with 503 (queue full)
    gem4:prompt_tokens                   counter    prompt tokens of admitted requests
    gem4:generation_tokens               counter    generated tokens
    gem4:time_to_first_token_seconds     histogram  request accepted -> first generated token
    gem4:inter_token_latency_seconds     histogram  between consecutive generated tokens of a request
    gem4:e2e_request_latency_seconds     histogram  request accepted -> finished
"""
from __future__ import annotations

import bisect
from collections import Counter

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                2.5, 5.0, 10.0, 20.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                240.0, 480.0, 960.0, 1920.0)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)     # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str, labels: str) -> list[str]:
        out, cumulative = [], 0
        for bound, n in zip((*self.buckets, float("inf")), self.counts):
            cumulative += n
            le = "+Inf" if bound == float("inf") else repr(float(bound))
            out.append(f'{name}_bucket{{{labels},le="{le}"}} {cumulative}')
        out.append(f"{name}_sum{{{labels}}} {self.sum!r}")
        out.append(f"{name}_count{{{labels}}} {self.count}")
        return out


class Metrics:
    def __init__(self, model_name: str, max_num_seqs: int):
        self.model_name = model_name
        self.max_num_seqs = max_num_seqs
        self.in_flight = 0                 # submitted to the engine, not finished
        self.finished: Counter[str] = Counter()
        self.rejected = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.ttft = Histogram(_TTFT_BUCKETS)
        self.itl = Histogram(_ITL_BUCKETS)
        self.e2e = Histogram(_E2E_BUCKETS)
        self._last_snapshot: tuple[float, int, int] | None = None   # (time, prompt, generation tokens)

    @property
    def running(self) -> int:
        return min(self.in_flight, self.max_num_seqs)

    @property
    def waiting(self) -> int:
        return self.in_flight - self.running

    def throughput_line(self, now: float) -> str | None:
        """Token rates since the previous call and the request counts; None when nothing ran in between
        (the first call only takes the snapshot)."""
        last, self._last_snapshot = self._last_snapshot, (now, self.prompt_tokens, self.generation_tokens)
        if last is None or now <= last[0]:
            return None
        t0, prompt0, gen0 = last
        if self.prompt_tokens == prompt0 and self.generation_tokens == gen0 and self.in_flight == 0:
            return None
        dt = now - t0
        return (f"Avg prompt throughput: {(self.prompt_tokens - prompt0) / dt:.1f} tokens/s, "
                f"Avg generation throughput: {(self.generation_tokens - gen0) / dt:.1f} tokens/s, "
                f"Running: {self.running} reqs, Waiting: {self.waiting} reqs")

    def render(self) -> str:
        labels = f'model_name="{_escape(self.model_name)}"'
        lines: list[str] = []

        def family(name: str, kind: str, help_: str) -> None:
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} {kind}")

        family("gem4:num_requests_running", "gauge", "Requests admitted by the engine.")
        lines.append(f"gem4:num_requests_running{{{labels}}} {self.running}")
        family("gem4:num_requests_waiting", "gauge", "Requests waiting to be admitted.")
        lines.append(f"gem4:num_requests_waiting{{{labels}}} {self.waiting}")
        family("gem4:request_success", "counter", "Finished requests by finish reason.")
        for reason in sorted(set(self.finished) | {"stop", "length", "tool_calls", "abort"}):
            lines.append(f'gem4:request_success_total{{{labels},finished_reason="{reason}"}} '
                         f"{self.finished[reason]}")
        family("gem4:request_rejected", "counter", "Requests refused because the waiting queue was full.")
        lines.append(f"gem4:request_rejected_total{{{labels}}} {self.rejected}")
        family("gem4:prompt_tokens", "counter", "Prompt tokens of admitted requests.")
        lines.append(f"gem4:prompt_tokens_total{{{labels}}} {self.prompt_tokens}")
        family("gem4:generation_tokens", "counter", "Generated tokens.")
        lines.append(f"gem4:generation_tokens_total{{{labels}}} {self.generation_tokens}")
        for name, hist, help_ in (
            ("gem4:time_to_first_token_seconds", self.ttft, "Time from request to first generated token."),
            ("gem4:inter_token_latency_seconds", self.itl, "Time between consecutive generated tokens."),
            ("gem4:e2e_request_latency_seconds", self.e2e, "Time from request to its end."),
        ):
            family(name, "histogram", help_)
            lines.extend(hist.lines(name, labels))
        return "\n".join(lines) + "\n"


def _escape(s: str) -> str:
    return s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
