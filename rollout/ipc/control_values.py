"""The values the engine's control calls accept, in one place for the front end's checks (HTTP
and Python) and the engine that acts on them: pause modes, memory tags, weight-update dtypes,
load formats and group backends, the latency histograms' buckets, and the message a request gets
when a DP peer rank failed."""
from __future__ import annotations

from typing import Any

import torch

PAUSE_MODES = ("abort", "retract", "in_place")
MEMORY_TAGS = ("weights", "kv_cache")
WEIGHT_DTYPES = {"float32": torch.float32, "float": torch.float32, "float16": torch.float16, "half": torch.float16,
                 "bfloat16": torch.bfloat16, "float64": torch.float64, "double": torch.float64}
LOAD_FORMATS = (None, "flattened_bucket")
GROUP_BACKENDS = ("gloo", "nccl")
PEER_FAILED = "a DP peer rank failed"   # the abort message of requests on the ranks that survive a peer's failure
# the latency histograms' bounds in seconds (the engine counts, /metrics reports): SGLang's, so its
# dashboards' quantiles read the same
TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 20.0, 40.0, 60.0, 80.0, 100.0, 200.0,
                400.0)
ITL_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060, 0.080, 0.100,
               0.200, 0.400, 0.600, 0.800, 1.0, 2.0, 4.0, 6.0, 8.0)
# speculative decoding: tokens a request emits per verify step (1 = no draft kept), a histogram's bounds
ACCEPT_BUCKETS = (1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 10.0, 12.0, 16.0, 24.0, 32.0, 48.0, 64.0)


def parse_tags(tags: Any) -> tuple[str, ...]:
    """SGLang's `tags`: None (all) or a list of "weights" / "kv_cache" (also "cuda_graph": nothing here)."""
    if tags is None:
        return MEMORY_TAGS
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise ValueError(f"tags must be null or a list of {list(MEMORY_TAGS)}, got {tags!r}"[:300])
    bad = [t for t in tags if t not in MEMORY_TAGS + ("cuda_graph",)]
    if bad:
        raise ValueError(f"tags must be among {list(MEMORY_TAGS)}, got {bad}"[:300])
    return tuple(t for t in MEMORY_TAGS if t in tags)
