"""SchedulePolicy: the order in which a prefill step looks at the waiting requests (SGLang's
--schedule-policy). The queue itself stays in arrival order (retracted requests at its front);
a policy only orders the scheduler's pass over it.

- fcfs: queue order, read lazily (the queue may hold many thousands).
- lpm: longest cached prefix first (the prefix cache's match of each prompt), ties in queue order;
  with more than LPM_MAX_WAITING waiting it is fcfs, as in SGLang (matching every prompt each
  step would cost more than it saves), and without a prefix cache (nothing to match).
- lof: longest output first (max_new_tokens), ties in queue order.
- random: a shuffle per step, from a generator seeded by the engine's seed (runs repeat).
"""
from __future__ import annotations

import random
from typing import Iterable

from rollout.config.engine_config import SCHEDULE_POLICIES, UNSUPPORTED_SCHEDULE_POLICIES as UNSUPPORTED
from rollout.core.radix_cache import RadixCache
from rollout.core.request import Req, WaitQueue
from rollout.value_range import check_choice

LPM_MAX_WAITING = 128


class SchedulePolicy:
    def __init__(self, name: str = "fcfs", *, seed: int = 0):
        self.name = check_choice("schedule_policy", name, SCHEDULE_POLICIES, why=UNSUPPORTED)
        self._rng = random.Random(seed) if name == "random" else None

    @property
    def in_queue_order(self) -> bool:
        """Whether order() is the queue's own order (a request past a limit ends the pass)."""
        return self.name == "fcfs"

    def order(self, waiting: WaitQueue, cache: RadixCache) -> Iterable[Req]:
        """The waiting requests in the order this step admits them."""
        if self.name == "fcfs" or (self.name == "lpm" and (len(waiting) > LPM_MAX_WAITING or not cache.enabled)):
            return waiting
        reqs = list(waiting)
        if self.name == "lpm":
            hits = {r.uid: cache.match_len(r.cache_key(r.seq_len - 1)) for r in reqs}
            reqs.sort(key=lambda r: -hits[r.uid])
        elif self.name == "lof":
            reqs.sort(key=lambda r: -r.params.max_new_tokens)
        else:
            self._rng.shuffle(reqs)
        return reqs
