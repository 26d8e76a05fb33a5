"""TokenLatency: one engine rank's histograms of time to first token and inter-token latency.

Time to first token runs from the request's arrival at the front end (ReqSpec.arrival_time) to the
step that sampled its first token; inter-token latency is the time between two consecutive tokens
of one request, one observation per token after the first (a non-streamed request's tokens never
reach the front end one by one, so the engine, which samples them, measures both). The buckets are
SGLang's (python/sglang/srt/metrics/collector.py, TokenizerMetricsCollector), so its dashboards'
quantiles read the same; /metrics sums the ranks' counts (rollout/server/engine_collector.py).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from rollout.ipc.control_values import ITL_BUCKETS, TTFT_BUCKETS


class Bucketed:
    """Counts per bucket (Prometheus `le`: value <= bound; the last bucket is +Inf) and their sum.

    NOTE: values wait in a list and are counted FLUSH_AT at a time (or when reported): counting
    costs tens of microseconds however few they are, too much for every step."""

    FLUSH_AT = 4096

    def __init__(self, bounds: Sequence[float]):
        self.bounds = np.asarray(bounds, dtype=np.float64)
        self.counts = np.zeros(len(bounds) + 1, dtype=np.int64)
        self.total = 0.0
        self._pending: list[float] = []

    def add(self, values: Sequence[float]) -> None:
        self._pending.extend(values)
        if len(self._pending) >= self.FLUSH_AT:
            self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        v = np.asarray(self._pending, dtype=np.float64)
        self._pending = []
        self.counts += np.bincount(np.searchsorted(self.bounds, v, side="left"), minlength=len(self.counts))
        self.total += float(v.sum())

    def report(self) -> list:
        """[per-bucket counts (not cumulative), sum]: msgpack-able."""
        self._flush()
        return [self.counts.tolist(), self.total]


class TokenLatency:
    def __init__(self) -> None:
        self.ttft = Bucketed(TTFT_BUCKETS)
        self.itl = Bucketed(ITL_BUCKETS)

    def observe(self, first_token_latencies: list[float], token_gaps: list[float]) -> None:
        """One step's observations (seconds): each request's first token, each later token's gap."""
        if first_token_latencies:
            self.ttft.add(first_token_latencies)
        if token_gaps:
            self.itl.add(token_gaps)

    def report(self) -> dict:
        return {"time_to_first_token": self.ttft.report(), "inter_token_latency": self.itl.report()}
