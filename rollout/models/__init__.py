"""Model layer: own implementations of Qwen3-MoE, Qwen2-MoE, Mixtral and OLMoE over ForwardBatch."""
from rollout.models.loader import load_checkpoint, load_state_dict_from_tensors
from rollout.models.registry import (ModelInfo, load_model, model_class, model_info,
                                     supported_architectures)
from rollout.models.topk import softmax_topk

__all__ = ["ModelInfo", "load_model", "model_class", "model_info", "supported_architectures",
           "load_checkpoint", "load_state_dict_from_tensors", "softmax_topk"]
