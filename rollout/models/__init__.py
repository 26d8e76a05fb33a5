"""Model layer: own implementations of Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, DeepSeek-V3 (MLA) and
GLM-4.5 MoE over ForwardBatch."""
from rollout.models.loader import load_checkpoint, load_state_dict_from_tensors
from rollout.models.registry import (ModelInfo, load_model, model_class, model_info,
                                     supported_architectures)
from rollout.models.moe import softmax_topk
from rollout.models.sigmoid_moe import grouped_sigmoid_topk

__all__ = ["ModelInfo", "load_model", "model_class", "model_info", "supported_architectures",
           "load_checkpoint", "load_state_dict_from_tensors", "softmax_topk", "grouped_sigmoid_topk"]
