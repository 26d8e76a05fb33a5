"""Routing rules: router logits -> (top-k weights, top-k expert ids).

Each rule is one function and the single hook point for routed-expert capture: it records the
expert ids it picked, in logical expert numbering, before anything else touches them.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from rollout.exact import sigmoid as exact_sigmoid


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


def grouped_sigmoid_topk(router_logits: torch.Tensor, correction_bias: torch.Tensor, top_k: int, *,
                         n_group: int, topk_group: int, renormalize: bool, scaling_factor: float,
                         capture: Optional[Any] = None, layer_id: int | None = None,
                         exact: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 / GLM-4.5 rule ("noaux_tc"): sigmoid scores, biased choice inside the best groups.

    router_logits [N, E] (any float dtype), correction_bias [E] -> topk_weights float32 [N, K],
    topk_ids int64 [N, K] (ids by descending biased score).

    1. scores = sigmoid(logits) in fp32; choice = scores + correction_bias.
    2. With n_group > 1: experts form n_group contiguous groups of E / n_group; a group's score is
       the sum of its two best choice values; only the topk_group best groups stay eligible.
    3. ids = the top_k eligible experts by choice value.
    4. weights = the *unbiased* scores at those ids, divided by their sum (+ 1e-20) when
       renormalize (norm_topk_prob), times scaling_factor (routed_scaling_factor).
    Ties (groups and experts): the lower id wins, as in softmax_topk. exact: the sigmoid of
    rollout.exact (deterministic inference; torch's differs in the last bits by tensor size).
    """
    n, e = router_logits.shape
    if not 0 < top_k <= e:
        raise ValueError(f"top_k must be in [1, num_experts={e}], got {top_k}")
    if n_group < 1 or e % n_group or not 0 < topk_group <= n_group:
        raise ValueError(f"n_group={n_group} must divide num_experts={e} and topk_group={topk_group} "
                         f"must be in [1, n_group]")
    scores = (exact_sigmoid if exact else torch.sigmoid)(router_logits.float())                             # [N, E]
    choice = scores + correction_bias.float()                                 # [N, E]
    if topk_group < n_group:
        per_group = e // n_group
        group_scores = choice.view(n, n_group, per_group).topk(min(2, per_group), dim=-1).values.sum(-1)  # [N, G]
        best = torch.sort(group_scores, dim=-1, descending=True, stable=True).indices[:, :topk_group]
        keep = torch.zeros(n, n_group, dtype=torch.bool, device=choice.device).scatter_(1, best, True)
        choice = choice.masked_fill(~keep.repeat_interleave(per_group, dim=1), float("-inf"))
    # NOTE: ties as in softmax_topk: a stable descending sort, lower id first among equal values
    topk_ids = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :top_k]  # [N, K]
    topk_weights = scores.gather(1, topk_ids)
    if renormalize:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    topk_weights = topk_weights * scaling_factor
    if capture is not None:
        capture.record(layer_id, topk_ids)
    return topk_weights, topk_ids
