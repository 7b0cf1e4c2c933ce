"""Prometheus metrics of one server (its own registry: nothing global).

Latencies per modality: TTFT (first text), TPOT (per output token after the first), TTFP (first
audio packet), E2EL (end to end), RTF (processing time / audio duration); request counts by route
and status; requests running in the engine.
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class ServerMetrics:
    """The server's metrics, exposed as Prometheus text by `render()`."""

    def __init__(self, model: str, running: Callable[[], int]) -> None:
        self.registry = CollectorRegistry()
        labels = {"model": model}
        self.requests = Counter("omni_requests", "Finished HTTP requests", ["route", "status"], registry=self.registry)
        self.ttft = Histogram("omni_time_to_first_token_seconds", "Time to first text token", buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.tpot = Histogram("omni_time_per_output_token_seconds", "Time per output token after the first", buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.ttfp = Histogram("omni_time_to_first_packet_seconds", "Time to first audio packet", buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.e2el = Histogram("omni_e2e_request_latency_seconds", "End-to-end request latency", buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.rtf = Histogram("omni_real_time_factor", "Processing time / audio duration", buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10), registry=self.registry)
        self.cancelled = Counter("omni_requests_cancelled", "Requests cancelled (client gone or aborted)", registry=self.registry)
        self.running = Gauge("omni_requests_running", "Requests in flight in the engine", registry=self.registry)
        self.running.set_function(lambda: float(running()))
        info = Gauge("omni_model_info", "The served model", ["model"], registry=self.registry)
        info.labels(**labels).set(1)

    def observe(self, ttft: float | None, ttfp: float | None, e2el: float, output_tokens: int, audio_seconds: float | None) -> None:
        """Record one finished generation."""
        self.e2el.observe(e2el)
        if ttft is not None:
            self.ttft.observe(ttft)
            if output_tokens > 1:
                self.tpot.observe((e2el - ttft) / (output_tokens - 1))
        if ttfp is not None:
            self.ttfp.observe(ttfp)
        if audio_seconds:
            self.rtf.observe(e2el / audio_seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
