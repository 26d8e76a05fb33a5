"""EngineCollector: the metrics read from the engine at scrape time (a prometheus_client collector).

Per DP rank, as SGLang's scheduler reports them (labels model_name, engine_type, tp_rank, pp_rank,
moe_ep_rank, and dp_rank when dp_size > 1): `sglang:num_running_reqs`, `num_queue_reqs`,
`num_used_tokens` and `token_usage` (as SGLang: KV slots neither free nor evictable prefix cache),
`max_total_num_tokens`, `gen_throughput` and `cache_hit_rate` (over BatchLog's latest window),
`num_retracted_requests_total`, `realtime_tokens_total{mode}`.
Summed over the ranks: `sglang:time_to_first_token_seconds` and `sglang:inter_token_latency_seconds`
(rollout/core/token_latency.py), and `rollout_spec_accept_length` (tokens per request per speculative
verify step; per rank its mean is SGLang's gauge `sglang:spec_accept_length`). And the project's own `rollout_*` counters and gauges.
"""
from __future__ import annotations

from typing import Any, Iterator, Optional

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from rollout.frontend.engine_client import EngineDeadError
from rollout.ipc.control_values import ACCEPT_BUCKETS, ITL_BUCKETS, TTFT_BUCKETS
from rollout.server.batch_log import BatchLog, rank_stats
from rollout.server.http_io import IgnoredFields

# (SGLang gauge, its help, its value from a rank's stats) per rank
SGLANG_GAUGES = (("num_running_reqs", "The number of running requests.", lambda s: s["running"]),
                 ("num_queue_reqs", "The number of requests in the waiting queue.", lambda s: s["waiting"]),
                 ("num_used_tokens", "The number of used tokens.", lambda s: s["kv_used"] - s["kv_evictable"]),
                 ("token_usage", "The token usage.",
                  lambda s: (s["kv_used"] - s["kv_evictable"]) / s["kv_total"] if s["kv_total"] else 0.0),
                 ("max_total_num_tokens", "Maximum total number of tokens in the KV cache pool.",
                  lambda s: s["kv_total"]))
# (load key, rollout gauge, its help) per rank
ROLLOUT_GAUGES = (("num_running_reqs", "num_running_reqs", "requests holding KV"),
                  ("num_waiting_reqs", "num_queue_reqs", "requests waiting in the queue"),
                  ("num_used_tokens", "kv_used_tokens", "KV slots in use (requests + prefix cache)"),
                  ("num_cached_tokens", "kv_cached_tokens", "KV slots held by the prefix cache"),
                  ("max_total_num_tokens", "kv_total_tokens", "KV slots in the pool"),
                  ("token_usage", "kv_usage", "fraction of KV slots in use"))
ENGINE_COUNTERS = (("engine_requests_finished", "requests finished in the engine (all APIs)", "finished_requests"),
                   ("engine_requests_aborted", "requests aborted in the engine", "aborted_requests"),
                   ("engine_nonfinite_logits_aborts",
                    "requests aborted because their next token had no finite distribution (NaN/inf logits)",
                    "nonfinite_logits_aborts"),
                   ("prompt_tokens", "prompt tokens received", "prompt_tokens"),
                   ("generation_tokens", "tokens generated", "generated_tokens"),
                   ("retractions", "requests retracted (preempted)", "num_retractions"),
                   ("weight_updates", "successful weight updates", "weight_updates"))


def _histogram(name: str, help_: str, labels: dict, bounds: tuple, ranks: list[dict], key: str) -> Metric:
    counts = [0] * (len(bounds) + 1)
    total = 0.0
    for stats in ranks:
        rank_counts, rank_sum = stats.get(key, ([0] * len(counts), 0.0))
        counts = [a + b for a, b in zip(counts, rank_counts)]
        total += rank_sum
    family = HistogramMetricFamily(name, help_, labels=list(labels))
    cumulative, buckets = 0, []
    for bound, count in zip([*map(floatToGoString, bounds), "+Inf"], counts):
        cumulative += count
        buckets.append((bound, cumulative))
    family.add_metric(list(labels.values()), buckets, sum_value=total)
    return family


class EngineCollector(Collector):
    def __init__(self, engine: Any, labels: dict[str, str], ignored: Optional[IgnoredFields], batch_log: BatchLog):
        self.engine = engine
        self.labels = labels         # model_name, engine_type
        self.ignored = ignored
        self.batch_log = batch_log

    def rank_labels(self, rank: int) -> dict[str, str]:
        """SGLang's scheduler labels of a DP rank (attention DP with expert parallelism, tp = pp = 1)."""
        out = {**self.labels, "tp_rank": "0", "pp_rank": "0", "moe_ep_rank": str(rank)}
        if self.engine.config.dp_size > 1:
            out["dp_rank"] = str(rank)
        return out

    def collect(self) -> Iterator[Metric]:
        engine = self.engine
        try:
            stats = engine.stats()
            loads = engine.loads()
        except EngineDeadError:
            return
        yield from self._sglang(rank_stats(stats))
        yield from self._rollout(stats, loads)

    def _sglang(self, ranks: list[dict]) -> Iterator[Metric]:
        names = list(self.rank_labels(0))
        for name, help_, value in SGLANG_GAUGES:
            family = GaugeMetricFamily(f"sglang:{name}", help_, labels=names)
            for rank, stats in enumerate(ranks):
                family.add_metric(list(self.rank_labels(rank).values()), value(stats))
            yield family
        rates = [self.batch_log.rates(rank) for rank in range(len(ranks))]
        for i, (name, help_) in enumerate((("gen_throughput", "The generation throughput (token/s)."),
                                           ("cache_hit_rate", "The prefix cache hit rate."))):
            family = GaugeMetricFamily(f"sglang:{name}", help_, labels=names)
            for rank, rate in enumerate(rates):
                family.add_metric(list(self.rank_labels(rank).values()), rate[i])
            yield family
        family = CounterMetricFamily("sglang:num_retracted_requests", "Total number of retracted requests.",
                                     labels=names)
        for rank, stats in enumerate(ranks):
            family.add_metric(list(self.rank_labels(rank).values()), stats["num_retractions"])
        yield family
        family = CounterMetricFamily(
            "sglang:realtime_tokens", "Total number of tokens processed. mode: prefill_compute, prefill_cache, "
            "decode.", labels=[*names, "mode"])
        for rank, stats in enumerate(ranks):
            values = list(self.rank_labels(rank).values())
            for mode, key in (("prefill_compute", "prefill_new_tokens"), ("prefill_cache", "prefill_cached_tokens"),
                              ("decode", "generated_tokens")):
                family.add_metric([*values, mode], stats[key])
        yield family
        yield _histogram("sglang:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                         self.labels, TTFT_BUCKETS, ranks, "time_to_first_token")
        yield _histogram("sglang:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                         self.labels, ITL_BUCKETS, ranks, "inter_token_latency")
        yield _histogram("rollout_spec_accept_length", "Histogram of tokens a request emits per speculative "
                         "verify step (1: no draft kept).", self.labels, ACCEPT_BUCKETS, ranks, "spec_accept_length")
        family = GaugeMetricFamily("sglang:spec_accept_length", "The average speculative acceptance length.",
                                   labels=names)
        for rank, stats in enumerate(ranks):
            counts, total = stats.get("spec_accept_length", ([0], 0.0))
            family.add_metric(list(self.rank_labels(rank).values()), total / sum(counts) if sum(counts) else 0.0)
        yield family

    def _rollout(self, stats: dict, loads: list[dict]) -> Iterator[Metric]:
        for name, help_, key in ENGINE_COUNTERS:
            yield CounterMetricFamily(f"rollout_{name}", help_, value=stats.get(key, 0))
        family = CounterMetricFamily("rollout_forwards", "model forwards by kind", labels=["kind"])
        family.add_metric(["prefill"], stats["num_prefill_forwards"])
        family.add_metric(["decode"], stats["num_decode_forwards"])
        yield family
        for key, name, help_ in ROLLOUT_GAUGES:
            family = GaugeMetricFamily(f"rollout_{name}", help_, labels=["dp_rank"])
            for ld in loads:
                family.add_metric([str(ld["dp_rank"])], ld[key])
            yield family
        yield GaugeMetricFamily("rollout_paused", "1 while generation is paused",
                                value=int(self.engine.paused_mode is not None))
        if self.ignored is not None:
            family = CounterMetricFamily("rollout_ignored_fields",
                                         "unknown request fields accepted and ignored, by endpoint and name",
                                         labels=["endpoint", "field"])
            for endpoint, field, count in self.ignored.samples():
                family.add_metric([endpoint, field], count)
            yield family
        if stats.get("capture_buffer_bytes"):   # (summed over DP ranks)
            yield GaugeMetricFamily("rollout_capture_host_store_bytes", "routed-expert host store size",
                                    value=stats["capture_store_bytes"])
            yield GaugeMetricFamily("rollout_capture_device_buffer_bytes", "routed-expert device buffer size",
                                    value=stats["capture_buffer_bytes"])
