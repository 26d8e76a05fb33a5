"""RL rollout engine for Mixture-of-Experts models with routed-expert capture.

The public names are imported on first use (PEP 562), so that a light part of the package
(`rollout-serve --help`, its flag checks, `python -m rollout.config`) starts without torch."""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Rollout": "rollout.frontend.api", "AsyncGeneration": "rollout.frontend.api",
    "EngineDeadError": "rollout.frontend.api", "SamplingParams": "rollout.sampling_params",
    "EngineConfig": "rollout.config", "RolloutOutput": "rollout.generate_io", "StreamChunk": "rollout.generate_io",
}
__all__ = ["Rollout", "SamplingParams", "EngineConfig", "RolloutOutput", "StreamChunk", "AsyncGeneration",
           "EngineDeadError"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'rollout' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
