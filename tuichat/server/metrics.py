"""`/metrics` in Prometheus' text format, by prometheus_client, under vLLM's metric names and meanings (with
tuichat's prefix): dashboards made for vLLM read tuichat's the same way."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from tuichat.backends.protocol import EngineStats, Usage

PREFIX = "tuichat:"
# vLLM's buckets for these histograms (seconds), so the same panels bin them alike.
_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0)


class _EngineGauges:
    """The engine's state, read when Prometheus scrapes (a collector, not gauges set per request)."""

    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self._stats = stats

    def collect(self):
        stats = self._stats()
        for name, help_text, value in (
            ("num_requests_running", "Requests in the engine's running batch.", stats.running),
            ("num_requests_waiting", "Requests waiting to be scheduled.", stats.waiting),
            ("kv_cache_usage_perc", "Share of the KV cache's blocks in use (1 is full).", stats.kv_usage),
        ):
            family = GaugeMetricFamily(PREFIX + name, help_text, labels=["model_name"])
            family.add_metric([stats.model], value)
            yield family


class ServerMetrics:
    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self.registry = CollectorRegistry()
        label = ["model_name"]

        def histogram(name: str, help_text: str, buckets) -> Histogram:
            return Histogram(PREFIX + name, help_text, label, buckets=buckets, registry=self.registry)

        def counter(name: str, help_text: str, labels=label) -> Counter:
            return Counter(PREFIX + name, help_text, labels, registry=self.registry)

        self.ttft = histogram("time_to_first_token_seconds", "Time to first token, from the request's arrival.", _TTFT)
        self.itl = histogram("inter_token_latency_seconds", "Time between two streamed pieces of a reply.", _ITL)
        self.e2e = histogram("e2e_request_latency_seconds", "A request's arrival to its last token.", _E2E)
        self.queue = histogram("request_queue_time_seconds", "A request's arrival to its first step.", _E2E)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens of finished requests.")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.success = counter("request_success", "Finished requests, by why they finished.",
                               ["model_name", "finished_reason"])
        self.registry.register(_EngineGauges(stats))

    def finished(self, model: str, usage: Usage) -> None:
        if usage.ttft_ms is not None:
            self.ttft.labels(model).observe(usage.ttft_ms / 1000)
        for gap in usage.itl_ms:
            self.itl.labels(model).observe(gap / 1000)
        if usage.e2e_ms is not None:
            self.e2e.labels(model).observe(usage.e2e_ms / 1000)
        if usage.queue_ms is not None:
            self.queue.labels(model).observe(usage.queue_ms / 1000)
        self.prompt_tokens.labels(model).inc(usage.prompt_tokens)
        self.generation_tokens.labels(model).inc(usage.completion_tokens)
        self.prefix_queries.labels(model).inc(usage.prompt_tokens)
        self.prefix_hits.labels(model).inc(usage.cached_tokens)
        self.success.labels(model, usage.finish_reason or "stop").inc()

    def text(self) -> bytes:
        return generate_latest(self.registry)
