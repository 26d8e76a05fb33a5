"""BatchLog: the periodic lines of a busy server (SGLang's "Prefill batch" and "Decode batch" lines)
and the rates /metrics reports per DP rank (`sglang:gen_throughput`, `sglang:cache_hit_rate`).

A thread wakes every `poll_s`; when the engine has stepped since its previous look it reads the
engine's counters (one stats call) and computes, over the time since that look, each rank's
generation throughput and the prefix-cache hit rate of the prompts it admitted (an idle engine is
not asked: its throughput reads 0, its hit rate keeps the last value). At info level it logs:

  Prefill batch, #new-seq: 8, #new-token: 96, #cached-token: 336, cache hit rate: 77.78%, token usage: 0.01, #running-req: 8, #queue-req: 0
      the prefill batches since the previous look, summed (so at most one line per poll_s);
  Decode batch, #running-req: 8, #token: 610, token usage: 0.02, gen throughput (token/s): 412.35, #queue-req: 0
      once `decode_log_interval` decode steps (SGLang's --decode-log-interval default: 40) ran
      since the previous decode line, with the throughput over that time (a pause of a whole
      poll_s starts the count again).
Counts are summed over the DP ranks; token usage is the used share of all ranks' KV slots.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

from rollout.frontend.engine_client import EngineDeadError

logger = logging.getLogger("rollout.server")
POLL_S = 1.0
DECODE_LOG_INTERVAL = 40


def rank_stats(stats: dict) -> list[dict]:
    """Per DP rank, the engine's stats (Rollout.stats() merges the ranks and keeps each in dp_ranks)."""
    return stats.get("dp_ranks") or [stats]


@dataclass(frozen=True)
class Reading:
    """The engine's counters at one time (monotonic seconds), per rank."""
    at: float
    ranks: list[dict]

    def total(self, key: str) -> int:
        return sum(r[key] for r in self.ranks)

    @property
    def used_tokens(self) -> int:
        """KV slots held by requests and by cached prefixes they lock (SGLang's #token: all but the free
        slots and the prefix cache's evictable ones)."""
        return self.total("kv_used") - self.total("kv_evictable")

    @property
    def decode_steps(self) -> int:
        return max(r["num_decode_forwards"] for r in self.ranks)   # NOTE: DP ranks step together


class BatchLog:
    def __init__(self, engine: Any, *, poll_s: float = POLL_S, decode_log_interval: int = DECODE_LOG_INTERVAL):
        self.engine = engine
        self.poll_s = poll_s
        self.decode_log_interval = decode_log_interval
        self._lock = threading.Lock()
        self._rates: dict[int, tuple[float, float]] = {}   # rank -> (gen throughput, cache hit rate)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._steps = -1
        self._last: Optional[Reading] = None       # the previous look
        self._decode_mark: Optional[Reading] = None  # the previous decode line (or the start of the count)

    def rates(self, rank: int) -> tuple[float, float]:
        """(generation throughput in tokens/s, prefix-cache hit rate) of a DP rank's latest window."""
        with self._lock:
            return self._rates.get(rank, (0.0, 0.0))

    def start(self) -> None:
        """Takes the first look (blocking), then looks every poll_s on a thread of its own."""
        self._steps = self.engine.steps_done
        self._last = self._read()
        self._thread = threading.Thread(target=self._run, name="rollout-batch-log", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.poll_s + 1)

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.poll_s):
                self.poll()
        except EngineDeadError:
            return
        except Exception:  # noqa: BLE001 (the server serves on without these lines)
            logger.exception("the batch log stopped")

    def _read(self) -> Reading:
        return Reading(time.monotonic(), rank_stats(self.engine.stats()))

    def poll(self) -> None:
        """One look at the engine: rates, and the lines that are due."""
        steps = self.engine.steps_done
        if steps == self._steps:
            # NOTE: no step, so no counter moved: the next window starts now, not at the last step
            with self._lock:
                self._rates = {rank: (0.0, hit) for rank, (_, hit) in self._rates.items()}
            if self._last is not None:
                self._last = Reading(time.monotonic(), self._last.ranks)
            self._decode_mark = None
            return
        self._steps = steps
        now = self._read()
        last, self._last = self._last, now
        if last is None:
            return
        self._rate(last, now)
        if now.total("prefill_new_seqs") > last.total("prefill_new_seqs") or \
                now.total("prefill_new_tokens") > last.total("prefill_new_tokens"):
            self._prefill_line(last, now)
        mark = self._decode_mark or last
        if now.decode_steps - mark.decode_steps >= self.decode_log_interval:
            self._decode_line(mark, now)
            mark = now
        self._decode_mark = mark

    def _rate(self, last: Reading, now: Reading) -> None:
        elapsed = max(now.at - last.at, 1e-9)
        rates = {}
        for rank, (a, b) in enumerate(zip(last.ranks, now.ranks)):
            new = b["prefill_new_tokens"] - a["prefill_new_tokens"]
            cached = b["prefill_cached_tokens"] - a["prefill_cached_tokens"]
            hit = cached / (new + cached) if new + cached else self.rates(rank)[1]
            rates[rank] = ((b["generated_tokens"] - a["generated_tokens"]) / elapsed, hit)
        with self._lock:
            self._rates = rates

    @staticmethod
    def _usage(now: Reading) -> str:
        total = now.total("kv_total")
        return f"{now.used_tokens / total if total else 0.0:.2f}"

    def _prefill_line(self, last: Reading, now: Reading) -> None:
        new = now.total("prefill_new_tokens") - last.total("prefill_new_tokens")
        cached = now.total("prefill_cached_tokens") - last.total("prefill_cached_tokens")
        logger.info("Prefill batch, #new-seq: %d, #new-token: %d, #cached-token: %d, cache hit rate: %.2f%%, "
                    "token usage: %s, #running-req: %d, #queue-req: %d",
                    now.total("prefill_new_seqs") - last.total("prefill_new_seqs"), new, cached,
                    100.0 * cached / (new + cached) if new + cached else 0.0, self._usage(now),
                    now.total("running"), now.total("waiting"))

    def _decode_line(self, mark: Reading, now: Reading) -> None:
        throughput = (now.total("generated_tokens") - mark.total("generated_tokens")) / max(now.at - mark.at, 1e-9)
        logger.info("Decode batch, #running-req: %d, #token: %d, token usage: %s, gen throughput (token/s): %.2f, "
                    "#queue-req: %d", now.total("running"), now.used_tokens, self._usage(now), throughput,
                    now.total("waiting"))
