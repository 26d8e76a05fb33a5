"""Metrics: the server's Prometheus metrics in a CollectorRegistry of its own, and /metrics.

What the front end sees is counted as it happens (HTTP answers, finished requests, routing bytes,
weight-update time, end-to-end latency); what the engine knows is read from it at scrape time
(EngineCollector: queue, KV, throughput, time to first token, inter-token latency). Metric names
are SGLang's (`sglang:*`, python/sglang/srt/metrics/collector.py) where they mean the same thing,
so SGLang's dashboards read this server, beside the project's own `rollout_*`.
"""
from __future__ import annotations

from typing import Any, Awaitable, Callable, Optional, Sequence

from fastapi import FastAPI
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.exposition import generate_latest
from starlette.responses import Response

from rollout.generate_io import RolloutOutput
from rollout.server.http_io import IgnoredFields

# SGLang's buckets (TokenizerMetricsCollector: e2e request latency, retractions per request)
E2E_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 20.0, 40.0, 60.0, 80.0, 100.0, 200.0, 400.0,
               600.0, 1200.0, 1800.0, 2400.0)
RETRACTION_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 15, 20, 25, 30, 40, 50, 75, 100)
WEIGHT_UPDATE_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
ENGINE_TYPE = "unified"   # SGLang's label for a server that both prefills and decodes
TEXT_FORMAT = "text/plain; version=0.0.4; charset=utf-8"


class Metrics:
    """Per server (no process-global registry: several servers may share a process)."""

    def __init__(self, known_paths: set[str], ignored: Optional[IgnoredFields], *, model_name: str = ""):
        self.known_paths = known_paths
        self.ignored = ignored
        self.labels = {"model_name": model_name, "engine_type": ENGINE_TYPE}
        self.registry = r = CollectorRegistry(auto_describe=False)
        names = list(self.labels)
        self._http = Counter("rollout_http_requests", "HTTP requests by path and status", ["path", "status"],
                             registry=r)
        self._finish = Counter("rollout_requests_finished", "generation requests finished, by finish reason",
                               ["reason"], registry=r)
        self._routing = Counter("rollout_routed_experts_bytes", "routed-expert bytes sent (base64), by wire format",
                                ["format"], registry=r)
        self._routing_msgs = Counter("rollout_routed_experts_messages",
                                     "responses/chunks carrying routed experts, by format", ["format"], registry=r)
        self._weight_update = Histogram(
            "rollout_weight_update_seconds", "weight updates that succeeded, from the call to the new weights serving "
            "(checks, reading, staging, waiting for earlier requests, copying), by source", ["source"],
            buckets=WEIGHT_UPDATE_BUCKETS, registry=r)
        # SGLang's TokenizerMetricsCollector, observed when a request finishes
        self._prompt_tokens = Counter("sglang:prompt_tokens", "Number of prefill tokens processed.", names,
                                      registry=r).labels(**self.labels)
        self._generation_tokens = Counter("sglang:generation_tokens", "Number of generation tokens processed.",
                                          names, registry=r).labels(**self.labels)
        self._cached_tokens = Counter("sglang:cached_tokens", "Number of cached prompt tokens.", names,
                                      registry=r).labels(**self.labels)
        self._requests = Counter("sglang:num_requests", "Number of requests processed.", names,
                                 registry=r).labels(**self.labels)
        self._aborted = Counter("sglang:num_aborted_requests", "Number of requests aborted.", names,
                                registry=r).labels(**self.labels)
        self._e2e = Histogram("sglang:e2e_request_latency_seconds",
                              "Histogram of End-to-end request latency in seconds", names, buckets=E2E_BUCKETS,
                              registry=r).labels(**self.labels)
        self._retractions = Histogram("sglang:num_retractions", "Histogram of retraction counts per request.",
                                      names, buckets=RETRACTION_BUCKETS, registry=r).labels(**self.labels)

    # ---- what the front end sees -----------------------------------------------------------------
    def request(self, path: str, status: int) -> None:
        self._http.labels(path if path in self.known_paths else "other", str(status)).inc()

    def routing_bytes(self, fmt: str, n: int) -> None:
        self._routing.labels(fmt).inc(n)
        self._routing_msgs.labels(fmt).inc()

    def weight_update(self, source: str, seconds: float) -> None:
        self._weight_update.labels(source).observe(seconds)

    def finished(self, outs: Sequence[RolloutOutput]) -> None:
        """Every finished request, whatever asked for it (Rollout.add_finish_listener)."""
        for out in outs:
            self._finish.labels(out.finish_reason).inc()
            self._prompt_tokens.inc(out.prompt_tokens)
            self._generation_tokens.inc(out.completion_tokens)
            if out.cached_tokens:
                self._cached_tokens.inc(out.cached_tokens)
            self._requests.inc()
            if out.finish_reason == "abort":
                self._aborted.inc()
            self._e2e.observe(out.e2e_latency)
            self._retractions.observe(out.num_retractions)

    def render(self) -> bytes:
        """The Prometheus text exposition; reads the engine (blocking: call it off the event loop).

        NOTE: always the classic text format, also when a scraper asks for OpenMetrics (Prometheus
        does): prometheus_client's OpenMetrics writer turns the `:` of sample names into `_`
        (`sglang_num_running_reqs`), which SGLang's dashboards would not find."""
        return generate_latest(self.registry)


def add_metrics_route(app: FastAPI, *, metrics: Metrics, blocking: Callable[..., Awaitable[Any]]) -> None:
    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(await blocking(metrics.render), media_type=TEXT_FORMAT)
