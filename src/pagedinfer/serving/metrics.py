"""``/metrics``: the server's Prometheus metrics, in one registry per app (no global state).

Engine gauges and counters (requests running and waiting, tokens computed, prefix-cache hit
rate, KV usage, preemptions) are read from ``Engine.stats()`` when Prometheus scrapes;
latencies are observed by the request handlers as tokens reach them: time to first token,
the gap between consecutive tokens (inter-token latency), and the whole request. The
handlers also count each request's prompt tokens once, when its first token arrives (vLLM's
``prompt_tokens_total``: every prompt token, whether computed or served by the prefix
cache), and the ones the prefix cache served. An engine with ``speculative_config`` adds
vLLM's ``spec_decode`` counters (drafts, draft tokens, accepted tokens, accepted tokens by
position); without it they are not registered, as in vLLM.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pagedinfer.engine.engine import EngineStats
from pagedinfer.engine.stats import HostTierStats

__all__ = ["CONTENT_TYPE", "RequestTimer", "ServerMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_PREFIX = "pagedinfer_"
# Seconds. TTFT spans queueing and prefill; inter-token latency one decode step.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
                0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)  # fmt: skip
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0, 480.0, 960.0)  # fmt: skip


class _EngineStatsCollector(Collector):
    """Reports the latest ``EngineStats`` snapshot (taken by the ``/metrics`` handler); the
    speculative-decoding counters only if the engine speculates (as vLLM registers them)."""

    def __init__(self, speculative: bool) -> None:
        self.stats: EngineStats | None = None
        self.speculative = speculative

    def collect(self) -> Iterator[Metric]:
        stats = self.stats
        if stats is None:
            return
        yield _gauge("num_requests_running", "Requests in the running batch.", stats.num_running)
        yield _gauge(
            "num_requests_waiting", "Requests queued, waiting to be admitted.", stats.num_waiting
        )
        yield _gauge(
            "kv_cache_usage_ratio",
            "Fraction of KV-cache blocks in use (0 to 1).",
            stats.kv_cache_usage,
        )
        yield _gauge("num_kv_blocks", "KV-cache blocks in the pool.", stats.num_kv_blocks)
        yield _gauge(
            "prefix_cache_hit_rate",
            "Fraction of looked-up prompt tokens served from the prefix cache (0 to 1).",
            stats.prefix_cache_hit_rate,
        )
        yield _counter(
            "prompt_tokens_computed",
            "Prompt tokens computed in prefill steps (recomputation after preemption included).",
            stats.num_prompt_tokens,
        )
        yield _counter("generation_tokens", "Tokens generated.", stats.num_generated_tokens)
        yield _counter(
            "num_preemptions", "Requests preempted to free KV blocks.", stats.num_preemptions
        )
        yield _counter(
            "engine_requests_finished",
            "Requests the engine finished (any reason).",
            stats.num_requests_finished,
        )
        if self.speculative:
            yield from _spec_decode_metrics(stats)
        if stats.host_tier is not None:
            yield from _host_tier_metrics(stats.host_tier)


def _host_tier_metrics(tier: HostTierStats) -> Iterator[Metric]:
    """The host KV tier (``--kv-offloading-size``): size, use, hits, copies, waits."""
    yield _gauge("host_kv_blocks", "Blocks the host KV tier holds at most.", tier.num_blocks)
    yield _gauge("host_kv_bytes_used", "Bytes of the host KV tier in use.", tier.bytes_used)
    yield _counter(
        "host_kv_hit_tokens", "Prompt tokens found in the host KV tier.", tier.hit_tokens
    )
    yield _counter(
        "host_kv_lookup_tokens",
        "Prompt tokens looked up in the host KV tier after a device miss.",
        tier.lookup_tokens,
    )
    yield _counter(
        "host_kv_blocks_copied_out",
        "KV blocks copied from the device to the host tier.",
        tier.blocks_copied_out,
    )
    yield _counter(
        "host_kv_blocks_copied_in",
        "KV blocks copied from the host tier back to the device.",
        tier.blocks_copied_in,
    )
    yield _counter(
        "host_kv_load_wait_steps",
        "Steps requests waited for their blocks from the host tier (summed over requests).",
        tier.load_wait_steps,
    )


def _spec_decode_metrics(stats: EngineStats) -> Iterator[Metric]:
    """vLLM's ``spec_decode`` counters: acceptance rate = accepted / draft tokens, mean
    acceptance length = 1 + accepted / drafts."""
    yield _counter(
        "spec_decode_num_drafts",
        "Verify rows that carried drafts (speculative decoding).",
        stats.spec_decode_num_drafts,
    )
    yield _counter(
        "spec_decode_num_draft_tokens",
        "Draft tokens verified (speculative decoding).",
        stats.spec_decode_num_draft_tokens,
    )
    yield _counter(
        "spec_decode_num_accepted_tokens",
        "Draft tokens accepted (speculative decoding).",
        stats.spec_decode_num_accepted_tokens,
    )
    per_position = CounterMetricFamily(
        _PREFIX + "spec_decode_num_accepted_tokens_per_pos",
        "Draft tokens accepted at each position of a verify row (0: the first draft).",
        labels=["position"],
    )
    for position, accepted in enumerate(stats.spec_decode_num_accepted_tokens_per_pos):
        per_position.add_metric([str(position)], accepted)
    yield per_position


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(_PREFIX + name, documentation, value=value)


def _counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(_PREFIX + name, documentation, value=value)


class ServerMetrics:
    """The registry of one server and the metrics its handlers observe. ``speculative``:
    the engine decodes speculatively, so the ``spec_decode`` counters are exported."""

    def __init__(self, *, speculative: bool = False) -> None:
        self.registry = CollectorRegistry()
        self._engine = _EngineStatsCollector(speculative)
        self.registry.register(self._engine)
        self.time_to_first_token = Histogram(
            _PREFIX + "time_to_first_token_seconds",
            "Time from a request's arrival to its first generated token.",
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        )
        self.inter_token_latency = Histogram(
            _PREFIX + "inter_token_latency_seconds",
            "Time between consecutive generated tokens of a request.",
            buckets=_ITL_BUCKETS,
            registry=self.registry,
        )
        self.request_latency = Histogram(
            _PREFIX + "e2e_request_latency_seconds",
            "Time from a request's arrival to its last token.",
            buckets=_E2E_BUCKETS,
            registry=self.registry,
        )
        self.requests_finished = Counter(
            _PREFIX + "requests_finished",
            "HTTP generation requests the server finished, by finish reason "
            "(abort: the client disconnected or the server shut down).",
            ["finish_reason"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            _PREFIX + "prompt_tokens",
            "Prompt tokens of the requests that reached their first token, each counted once "
            "(computed or served by the prefix cache).",
            registry=self.registry,
        )
        self.prompt_tokens_cached = Counter(
            _PREFIX + "prompt_tokens_cached",
            "Of those, prompt tokens served by the prefix cache.",
            registry=self.registry,
        )
        self.requests_rejected = Counter(
            _PREFIX + "requests_rejected",
            "HTTP requests answered with an error status.",
            ["status"],
            registry=self.registry,
        )

    def render(self, stats: EngineStats | None) -> bytes:
        self._engine.stats = stats
        return generate_latest(self.registry)

    def timer(self) -> RequestTimer:
        return RequestTimer(self)


class RequestTimer:
    """Observes the latencies of one request (one completion) as its tokens arrive."""

    __slots__ = ("_arrival", "_last", "_metrics", "_tokens")

    def __init__(self, metrics: ServerMetrics) -> None:
        self._metrics = metrics
        self._arrival = time.perf_counter()
        self._last: float | None = None
        self._tokens = 0

    def tokens(self, num_tokens: int, prompt_tokens: int = 0, cached_tokens: int = 0) -> None:
        """``num_tokens`` (the total so far) have arrived by now, for a prompt of
        ``prompt_tokens`` of which the prefix cache served ``cached_tokens``.

        The first arrival is the time to first token, and counts the prompt; after that,
        ``k`` tokens that arrive together after a gap ``t`` count as ``k`` inter-token
        latencies of ``t / k``.
        """
        new = num_tokens - self._tokens
        if new <= 0:
            return
        now = time.perf_counter()
        if self._last is None:
            self._metrics.time_to_first_token.observe(now - self._arrival)
            self._metrics.prompt_tokens.inc(prompt_tokens)
            self._metrics.prompt_tokens_cached.inc(cached_tokens)
        else:
            gap = (now - self._last) / new
            for _ in range(new):
                self._metrics.inter_token_latency.observe(gap)
        self._last = now
        self._tokens = num_tokens

    def finished(self, reason: str | None) -> None:
        self._metrics.request_latency.observe(time.perf_counter() - self._arrival)
        self._metrics.requests_finished.labels(finish_reason=reason or "unknown").inc()
