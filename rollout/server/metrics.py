"""Metrics: the server's Prometheus counters (engine gauges are read at scrape time) and /metrics."""
from __future__ import annotations

import threading
from collections import Counter
from typing import Any, Awaitable, Callable, Sequence

from fastapi import FastAPI
from starlette.responses import Response

from rollout.frontend.api import Rollout
from rollout.generate_io import RolloutOutput
from rollout.server.http_io import IgnoredFields


class Metrics:
    """Server-side counters; engine gauges are read at scrape time."""

    def __init__(self, known_paths: set[str], ignored: IgnoredFields):
        self._lock = threading.Lock()
        self.known_paths = known_paths
        self.ignored = ignored
        self.http: Counter = Counter()
        self.finish: Counter = Counter()
        self.routing: Counter = Counter()
        self.routing_msgs: Counter = Counter()
        self.output_tokens = 0

    def request(self, path: str, status: int) -> None:
        with self._lock:
            self.http[(path if path in self.known_paths else "other", status)] += 1

    def routing_bytes(self, fmt: str, n: int) -> None:
        with self._lock:
            self.routing[fmt] += n
            self.routing_msgs[fmt] += 1

    def finished(self, outs: Sequence[RolloutOutput]) -> None:
        with self._lock:
            for out in outs:
                self.finish[out.finish_reason] += 1
                self.output_tokens += out.completion_tokens

    def render(self, stats: dict, loads: list[dict], engine: Rollout) -> str:
        lines: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
            lines.append(f"# HELP rollout_{name} {help_}")
            lines.append(f"# TYPE rollout_{name} {kind}")
            for labels, value in samples:
                lines.append(f"rollout_{name}{labels} {value}")

        with self._lock:
            http = sorted(self.http.items())
            finish = sorted(self.finish.items())
            routing = sorted(self.routing.items())
            msgs = sorted(self.routing_msgs.items())
        metric("http_requests_total", "counter", "HTTP requests by path and status",
               [(f'{{path="{p}",status="{s}"}}', v) for (p, s), v in http])
        metric("requests_finished_total", "counter", "generation requests finished, by finish reason",
               [(f'{{reason="{r}"}}', v) for r, v in finish])
        metric("engine_requests_finished_total", "counter", "requests finished in the engine (all APIs)",
               [("", stats["finished_requests"])])
        metric("engine_requests_aborted_total", "counter", "requests aborted in the engine",
               [("", stats["aborted_requests"])])
        metric("engine_nonfinite_logits_aborts_total", "counter",
               "requests aborted because their next token had no finite distribution (NaN/inf logits)",
               [("", stats.get("nonfinite_logits_aborts", 0))])
        metric("prompt_tokens_total", "counter", "prompt tokens received", [("", stats["prompt_tokens"])])
        metric("generation_tokens_total", "counter", "tokens generated", [("", stats["generated_tokens"])])
        metric("forwards_total", "counter", "model forwards by kind",
               [('{kind="prefill"}', stats["num_prefill_forwards"]), ('{kind="decode"}', stats["num_decode_forwards"])])
        metric("retractions_total", "counter", "requests retracted (preempted)", [("", stats["num_retractions"])])
        metric("weight_updates_total", "counter", "successful weight updates", [("", stats.get("weight_updates", 0))])
        for key, name, help_ in (("num_running_reqs", "num_running_reqs", "requests holding KV"),
                                 ("num_waiting_reqs", "num_queue_reqs", "requests waiting in the queue"),
                                 ("num_used_tokens", "kv_used_tokens", "KV slots in use (requests + prefix cache)"),
                                 ("num_cached_tokens", "kv_cached_tokens", "KV slots held by the prefix cache"),
                                 ("max_total_num_tokens", "kv_total_tokens", "KV slots in the pool"),
                                 ("token_usage", "kv_usage", "fraction of KV slots in use")):
            metric(name, "gauge", help_, [(f'{{dp_rank="{ld["dp_rank"]}"}}', ld[key]) for ld in loads])
        metric("paused", "gauge", "1 while generation is paused", [("", int(engine.paused_mode is not None))])
        metric("routed_experts_bytes_total", "counter", "routed-expert bytes sent (base64), by wire format",
               [(f'{{format="{f}"}}', v) for f, v in routing])
        metric("routed_experts_messages_total", "counter", "responses/chunks carrying routed experts, by format",
               [(f'{{format="{f}"}}', v) for f, v in msgs])
        metric("ignored_fields_total", "counter", "unknown request fields accepted and ignored, by endpoint and name",
               [(f'{{endpoint="{e}",field="{n}"}}', v) for e, n, v in self.ignored.samples()])
        if stats.get("capture_buffer_bytes"):   # (summed over DP ranks)
            metric("capture_host_store_bytes", "gauge", "routed-expert host store size",
                   [("", stats["capture_store_bytes"])])
            metric("capture_device_buffer_bytes", "gauge", "routed-expert device buffer size",
                   [("", stats["capture_buffer_bytes"])])
        return "\n".join(lines) + "\n"


def add_metrics_route(app: FastAPI, *, engine: Rollout, metrics: Metrics,
                      blocking: Callable[..., Awaitable[Any]]) -> None:
    @app.get("/metrics")
    async def prometheus() -> Response:
        stats = await blocking(engine.stats)
        loads = await blocking(engine.loads)
        return Response(metrics.render(stats, loads, engine), media_type="text/plain; version=0.0.4")
