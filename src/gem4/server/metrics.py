"""Server metrics in the Prometheus text format (version 0.0.4) through `prometheus_client`, named `gem4:*`
like vLLM's `vllm:*` (same names after the prefix, same types and meanings unless the table says otherwise).

Every family has the label `model_name`. Families:

    gem4:num_requests_running            gauge      sequences in the engine's running batch (1)
    gem4:num_requests_waiting            gauge      sequences queued behind them (1)
    gem4:kv_cache_usage_perc             gauge      fraction (0..1) of the KV pool's full-attention blocks in use (2)
    gem4:cache_config_info               gauge      1, the KV pool's shape in labels: block_size, num_gpu_blocks (its
                                                    full-attention blocks), enable_prefix_caching (2)
    gem4:num_preemptions_total           counter    sequences preempted (KV freed, recomputed later) (2)
    gem4:prefix_cache_queries_total      counter    prompt tokens looked up in the prefix cache (2)
    gem4:prefix_cache_hits_total         counter    ... and found there (2)
    gem4:spec_decode_num_drafts_total    counter    verification steps with drafts (speculative decoding) (2)
    gem4:spec_decode_num_draft_tokens_total     counter  drafts checked (2)
    gem4:spec_decode_num_accepted_tokens_total  counter  drafts accepted (2)
    gem4:spec_decode_num_accepted_tokens_per_pos_total  counter  ... by draft `position` (0-based) (2)
    gem4:request_success_total           counter    finished requests, by finished_reason
    gem4:request_rejected_total          counter    requests refused with 503 (queue full)
    gem4:prompt_tokens_total             counter    prompt tokens of admitted requests
    gem4:generation_tokens_total         counter    generated tokens
    gem4:iteration_tokens_total          histogram  tokens per engine step (2, 3)
    gem4:iteration_seqs_total            histogram  sequences per engine step (2, 4)
    gem4:time_to_first_token_seconds     histogram  request accepted -> first generated token
    gem4:inter_token_latency_seconds     histogram  between consecutive generated tokens of a request
    gem4:e2e_request_latency_seconds     histogram  request accepted -> finished
    gem4:grammar_compile_seconds         histogram  a structured request's grammar compile (2, 5)
    gem4:grammar_mask_seconds            histogram  an engine step's grammar masks, all its constrained rows (2, 5)
    gem4:grammar_apply_seconds           histogram  an engine step's mask apply to the logits (2, 5)
    gem4:structured_requests_total       counter    structured requests, by `kind` of grammar (2, 5)

(1) From the engine's scheduler (`Engine.request_counts()`: what it runs, and its waiting queue with the
    requests not yet taken in). An engine without that accessor (a test's stand-in) gets an estimate
    from the server's requests in flight: the first max_num_seqs run (FCFS), the rest wait.
(2) Read from the engine at scrape time (`kv_cache_usage`, `num_preemptions`, `prefix_cache_counts`,
    `step_tokens`, `batch_sizes`: plain ints the engine thread alone updates; a scrape only reads them, so the engine's
    step takes no lock for metrics). Absent (the family has no sample) while there is no engine or for
    an engine that does not count them. Both histograms observe every engine step once, so their
    `_count` is the engine's step count.
(3) vLLM's buckets. The tokens a step ran through the model: its prefill chunks' tokens plus one per
    decoding sequence. vLLM counts instead the tokens a step sampled plus a request's whole prompt in
    the step that ends its prefill; over a run, our `_sum` is larger by what preemptions made the
    engine compute again and smaller by each request's last token (sampled, never run).
(4) Not a vLLM family (vLLM has none for sequences per step); named after iteration_tokens_total.
    Buckets are powers of two.
(5) Not vLLM families. From the engine's `grammar_stats` (gem4.structured.GrammarStats); `kind` is
    tools_required, tools_named, tools_auto, json_schema, json_object, regex, choice or grammar
    (docs/structured.md). A compile is counted where it happens: the server compiles each request's
    grammar before admission (a grammar seen recently is a copy, ~1 us), the engine then copies it.

Request-side values change on the event loop only (see request.py's thread model). The registry is this
object's own, never prometheus_client's process-wide default, so several apps in one process do not
collide; the `_created` series prometheus_client adds to counters and histograms are left out of the
rendering (vLLM switches them off process-wide; dropping them here leaves other registries alone).
"""
from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                2.5, 5.0, 10.0, 20.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                240.0, 480.0, 960.0, 1920.0)
_STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_STEP_SEQ_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
FINISHED_REASONS = ("stop", "length", "tool_calls", "abort")     # shown at 0 before the first of each
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Metrics:
    """One app's metrics. `engine` returns the app's engine, or None while it loads."""

    def __init__(self, model_name: str, max_num_seqs: int, engine: Callable[[], object | None] = lambda: None):
        self.model_name = model_name
        self.max_num_seqs = max_num_seqs
        self.in_flight = 0                 # submitted to the engine, not finished
        # the token totals are plain ints: the throughput line reads them too (prometheus_client's
        # counters have no public read)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self._engine = engine
        self.registry = CollectorRegistry()
        self.registry.register(_LiveCollector(self))
        r, labels = self.registry, ("model_name",)
        success = Counter("gem4:request_success", "Finished requests by finish reason.",
                          (*labels, "finished_reason"), registry=r)
        for reason in FINISHED_REASONS:
            success.labels(model_name, reason)
        self._success = success
        self._rejected = Counter("gem4:request_rejected", "Requests refused because the waiting queue was full.",
                                 labels, registry=r).labels(model_name)
        self.ttft = Histogram("gem4:time_to_first_token_seconds", "Time from request to first generated token.",
                              labels, registry=r, buckets=_TTFT_BUCKETS).labels(model_name)
        self.itl = Histogram("gem4:inter_token_latency_seconds", "Time between consecutive generated tokens.",
                             labels, registry=r, buckets=_ITL_BUCKETS).labels(model_name)
        self.e2e = Histogram("gem4:e2e_request_latency_seconds", "Time from request to its end.",
                             labels, registry=r, buckets=_E2E_BUCKETS).labels(model_name)
        self._last_snapshot: tuple[float, int, int] | None = None   # (time, prompt, generation tokens)

    # ---- updates (event loop) ----

    def request_admitted(self, prompt_tokens: int) -> None:
        self.in_flight += 1
        self.prompt_tokens += prompt_tokens

    def request_ended(self, e2e_seconds: float) -> None:
        """The engine sent the request's final event (or failed it)."""
        self.in_flight -= 1
        self.e2e.observe(e2e_seconds)

    def request_rejected(self) -> None:
        self._rejected.inc()

    def request_finished(self, reason: str) -> None:
        """How the client's reply ended (a finish_reason, "abort" or "error")."""
        self._success.labels(self.model_name, reason).inc()

    # ---- reads ----

    def running_waiting(self) -> tuple[int, int]:
        """The engine's (running, waiting) counts, or the estimate from requests in flight."""
        counts = getattr(self._engine(), "request_counts", None)
        if counts is not None:
            return counts()
        running = min(self.in_flight, self.max_num_seqs)
        return running, self.in_flight - running

    @property
    def waiting(self) -> int:
        return self.running_waiting()[1]

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
        running, waiting = self.running_waiting()
        return (f"Avg prompt throughput: {(self.prompt_tokens - prompt0) / dt:.1f} tokens/s, "
                f"Avg generation throughput: {(self.generation_tokens - gen0) / dt:.1f} tokens/s, "
                f"Running: {running} reqs, Waiting: {waiting} reqs")

    def render(self) -> str:
        return generate_latest(_WithoutCreated(self.registry)).decode()


class _LiveCollector:
    """The families read at scrape time: the request counts, the token totals and the engine's own counters."""

    def __init__(self, metrics: Metrics):
        self.m = metrics

    def describe(self) -> list[Metric]:
        return list(self._families().values())

    def _families(self) -> dict[str, Metric]:
        return {
            "running": GaugeMetricFamily("gem4:num_requests_running", "Requests in the engine's running batch.",
                                         labels=("model_name",)),
            "waiting": GaugeMetricFamily("gem4:num_requests_waiting", "Requests waiting to be scheduled.",
                                         labels=("model_name",)),
            "kv": GaugeMetricFamily("gem4:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                                    labels=("model_name",)),
            "cache_config": GaugeMetricFamily("gem4:cache_config_info", "The KV cache's configuration.",
                                              labels=("model_name", "block_size", "num_gpu_blocks",
                                                      "enable_prefix_caching")),
            "preempt": CounterMetricFamily("gem4:num_preemptions", "Cumulative number of preemptions from the engine.",
                                           labels=("model_name",)),
            "queries": CounterMetricFamily("gem4:prefix_cache_queries",
                                           "Prefix cache queries, in terms of number of queried tokens.",
                                           labels=("model_name",)),
            "hits": CounterMetricFamily("gem4:prefix_cache_hits",
                                        "Prefix cache hits, in terms of number of cached tokens.", labels=("model_name",)),
            "drafts": CounterMetricFamily("gem4:spec_decode_num_drafts", "Number of spec decoding drafts.",
                                          labels=("model_name",)),
            "draft_tokens": CounterMetricFamily("gem4:spec_decode_num_draft_tokens", "Number of draft tokens.",
                                                labels=("model_name",)),
            "accepted": CounterMetricFamily("gem4:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                                            labels=("model_name",)),
            "per_pos": CounterMetricFamily("gem4:spec_decode_num_accepted_tokens_per_pos",
                                           "Accepted tokens per draft position.", labels=("model_name", "position")),
            "prompt": CounterMetricFamily("gem4:prompt_tokens", "Prompt tokens of admitted requests.",
                                          labels=("model_name",)),
            "gen": CounterMetricFamily("gem4:generation_tokens", "Generated tokens.", labels=("model_name",)),
            "tokens": HistogramMetricFamily("gem4:iteration_tokens_total", "Histogram of tokens per engine step.",
                                            labels=("model_name",)),
            "seqs": HistogramMetricFamily("gem4:iteration_seqs_total", "Histogram of sequences per engine step.",
                                          labels=("model_name",)),
            "grammar_compile": HistogramMetricFamily("gem4:grammar_compile_seconds",
                                                     "Histogram of grammar compile times of structured requests.",
                                                     labels=("model_name",)),
            "grammar_mask": HistogramMetricFamily("gem4:grammar_mask_seconds",
                                                  "Histogram of grammar mask times per engine step.",
                                                  labels=("model_name",)),
            "grammar_apply": HistogramMetricFamily("gem4:grammar_apply_seconds",
                                                   "Histogram of grammar mask apply times per engine step.",
                                                   labels=("model_name",)),
            "structured": CounterMetricFamily("gem4:structured_requests", "Structured requests by grammar kind.",
                                              labels=("model_name", "kind")),
            "expert_hits": CounterMetricFamily("gem4:expert_cache_hits", "Streamed experts found in their layer's "
                                               "slots (per layer and step).", labels=("model_name",)),
            "expert_misses": CounterMetricFamily("gem4:expert_cache_misses", "Streamed experts read from the file.",
                                                 labels=("model_name",)),
            "expert_bytes": CounterMetricFamily("gem4:expert_cache_bytes_read", "Bytes of streamed experts read.",
                                                labels=("model_name",)),
            **{alias: GaugeMetricFamily(name, "The same as gem4:" + name.removeprefix("vllm:") + " (vLLM's name).",
                                        labels=()) for alias, (_, name) in _VLLM_NAMES.items()},
        }

    def collect(self) -> Iterator[Metric]:
        m, fam = self.m, self._families()
        label = [m.model_name]
        running, waiting = m.running_waiting()
        fam["running"].add_metric(label, running)
        fam["waiting"].add_metric(label, waiting)
        fam["prompt"].add_metric(label, m.prompt_tokens)
        fam["gen"].add_metric(label, m.generation_tokens)
        engine = m._engine()
        if engine is not None:
            if hasattr(engine, "kv_cache_usage"):
                fam["kv"].add_metric(label, engine.kv_cache_usage)
            size = getattr(engine, "pool_size", None)
            if size is not None:
                fam["cache_config"].add_metric([*label, str(size.block_size), str(size.num_blocks),
                                                str(bool(engine.prefix_caching))], 1)
            if hasattr(engine, "num_preemptions"):
                fam["preempt"].add_metric(label, engine.num_preemptions)
            if getattr(engine, "speculative_config", None) is not None:
                fam["drafts"].add_metric(label, engine.spec_drafts)
                fam["draft_tokens"].add_metric(label, engine.spec_draft_tokens)
                fam["accepted"].add_metric(label, engine.spec_accepted_tokens)
                per_pos = dict(engine.spec_accepted_per_position)
                for position in range(engine.speculative_config.num_speculative_tokens):
                    fam["per_pos"].add_metric([*label, str(position)], per_pos.get(position, 0))
            if hasattr(engine, "prefix_cache_counts"):
                queries, hits = engine.prefix_cache_counts
                fam["queries"].add_metric(label, queries)
                fam["hits"].add_metric(label, hits)
            cache = getattr(getattr(engine, "model", None), "expert_cache", None)
            if cache is not None:                                        # 26B-A4B, streamed experts
                stats = cache.stats
                fam["expert_hits"].add_metric(label, stats.hits)
                fam["expert_misses"].add_metric(label, stats.misses)
                fam["expert_bytes"].add_metric(label, stats.bytes_read)
            grammar = getattr(engine, "grammar_stats", None)
            if grammar is not None:
                for key, timing in (("grammar_compile", grammar.compile), ("grammar_mask", grammar.mask),
                                    ("grammar_apply", grammar.apply)):
                    cumulative, total = timing.histogram()
                    fam[key].add_metric(label, [(floatToGoString(b), n) for b, n in cumulative], total)
                for kind, n in sorted(dict(grammar.requests).items()):
                    fam["structured"].add_metric([*label, kind], n)
            for key, attr, bounds in (("tokens", "step_tokens", _STEP_TOKEN_BUCKETS),
                                      ("seqs", "batch_sizes", _STEP_SEQ_BUCKETS)):
                counts = getattr(engine, attr, None)
                if counts is not None:
                    buckets, total = _buckets(dict(counts), bounds)   # dict(): one C-level copy, atomic
                    fam[key].add_metric(label, buckets, total)
        for alias, (key, name) in _VLLM_NAMES.items():
            fam[alias].samples = [sample._replace(name=name) for sample in fam[key].samples]
        yield from fam.values()


# the families also shown under vLLM's name (see the module's docstring): alias key -> (gem4 key, vLLM name)
_VLLM_NAMES = {
    "vllm_running": ("running", "vllm:num_requests_running"),
    "vllm_waiting": ("waiting", "vllm:num_requests_waiting"),
    "vllm_kv": ("kv", "vllm:kv_cache_usage_perc"),
    "vllm_cache_config": ("cache_config", "vllm:cache_config_info"),
}


def _buckets(steps: Mapping[int, int], bounds: tuple[int, ...]) -> tuple[list[tuple[str, int]], int]:
    """Cumulative histogram buckets (`le` bounds, then +Inf) and the sum of the observations, from
    {observed value: how many times}."""
    per_bucket = [0] * (len(bounds) + 1)
    for value, n in steps.items():
        per_bucket[bisect.bisect_left(bounds, value)] += n
    cumulative = list(itertools.accumulate(per_bucket))
    les = [floatToGoString(b) for b in bounds] + ["+Inf"]
    return list(zip(les, cumulative)), sum(v * n for v, n in steps.items())


class _WithoutCreated:
    """A registry's families without their `_created` samples."""

    def __init__(self, registry: CollectorRegistry):
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            family.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield family
