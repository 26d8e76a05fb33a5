"""Model layer: an architecture is one file of arch/ (its config mapping) composing the shared
blocks of attention/, moe/ and layers.py over ForwardBatch; kernels/ holds the Triton kernels,
registry.py the architecture table, loader.py the checkpoint reader (docs/architecture.md,
"Adding an architecture")."""
from rollout.models.loader import load_checkpoint, load_state_dict_from_tensors
from rollout.models.moe.routing import grouped_sigmoid_topk, softmax_topk, topk_softmax
from rollout.models.registry import (ModelInfo, load_model, model_class, model_info,
                                     supported_architectures)

__all__ = ["ModelInfo", "load_model", "model_class", "model_info", "supported_architectures",
           "load_checkpoint", "load_state_dict_from_tensors", "softmax_topk", "grouped_sigmoid_topk",
           "topk_softmax"]
