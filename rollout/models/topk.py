"""Routing rules: router logits -> (top-k weights, top-k expert ids).

Each rule is one function and the single hook point for routed-expert capture: it records the
expert ids it picked, in logical expert numbering, before anything else touches them.
"""
from __future__ import annotations

from typing import Any, Optional

import torch


def softmax_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool, *,
                 capture: Optional[Any] = None,
                 layer_id: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax (fp32) -> top-k -> optional renormalisation over the chosen k.

    router_logits [N, E] (any float dtype) -> topk_weights float32 [N, K], topk_ids int64 [N, K].
    Same rule as HF's Qwen2/Qwen3-MoE, Mixtral (renormalize=True) and OLMoE routers.
    """
    if not 0 < top_k <= router_logits.shape[-1]:
        raise ValueError(f"top_k must be in [1, num_experts={router_logits.shape[-1]}], got {top_k}")
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)        # [N, E]
    # NOTE: ties. torch.topk's choice among exactly equal probabilities is unspecified (on CPU it
    # does not prefer the lower id). A stable descending sort makes the rule explicit: among equal
    # probabilities the lower expert id wins, on every device and batch composition.
    topk_weights, topk_ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    topk_weights, topk_ids = topk_weights[:, :top_k], topk_ids[:, :top_k]    # [N, K]
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    if capture is not None:
        capture.record(layer_id, topk_ids)
    return topk_weights, topk_ids
