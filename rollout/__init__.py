"""RL rollout engine for Mixture-of-Experts models with routed-expert capture."""
from rollout.config import EngineConfig
from rollout.frontend.api import AsyncGeneration, EngineDeadError, Rollout
from rollout.output import RolloutOutput
from rollout.sampling_params import SamplingParams
from rollout.stream_chunk import StreamChunk

__all__ = ["Rollout", "SamplingParams", "EngineConfig", "RolloutOutput", "StreamChunk", "AsyncGeneration",
           "EngineDeadError"]
