"""RL rollout engine for Mixture-of-Experts models with routed-expert capture."""
from rollout.config import EngineConfig
from rollout.frontend.api import AsyncGeneration, EngineDeadError, Rollout
from rollout.generate_io import RolloutOutput, StreamChunk
from rollout.sampling_params import SamplingParams

__all__ = ["Rollout", "SamplingParams", "EngineConfig", "RolloutOutput", "StreamChunk", "AsyncGeneration",
           "EngineDeadError"]
