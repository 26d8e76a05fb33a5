"""Routing rules: router logits -> (topk_weights, topk_ids). Every MoE layer routes through one
`RoutingRule`, the single hook point of routed-expert capture: the rule records the expert ids it
picked, in logical expert numbering, before anything else touches them.

- "softmax": softmax over all experts, top-k, optional renormalisation (Qwen2/Qwen3-MoE,
  Mixtral, OLMoE);
- "sigmoid": sigmoid scores, biased choice inside the best groups (DeepSeek-V3, GLM-4.5; with
  one group: MiniMax-M2);
- "topk_softmax": top-k of the logits, softmax over those k (gpt-oss).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from rollout import exact as exact_ops

SCORINGS = ("softmax", "sigmoid", "topk_softmax")


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
    scores = (exact_ops.sigmoid if exact else torch.sigmoid)(router_logits.float())                             # [N, E]
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


def topk_softmax(router_logits: torch.Tensor, top_k: int, *, capture: Optional[Any] = None,
                 layer_id: int | None = None, exact: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss rule: ids = the top_k largest logits (ties: lower id first), weights = softmax over
    those k logits in fp32. router_logits [N, E] -> topk_weights float32 [N, K], topk_ids int64 [N, K]."""
    if not 0 < top_k <= router_logits.shape[-1]:
        raise ValueError(f"top_k must be in [1, num_experts={router_logits.shape[-1]}], got {top_k}")
    values, topk_ids = torch.sort(router_logits.float(), dim=-1, descending=True, stable=True)
    values, topk_ids = values[:, :top_k], topk_ids[:, :top_k]                # [N, K]
    topk_weights = exact_ops.softmax(values) if exact else torch.softmax(values, dim=-1)
    if capture is not None:
        capture.record(layer_id, topk_ids)
    return topk_weights, topk_ids


@dataclass(frozen=True, kw_only=True)
class RoutingRule:
    """One layer's routing: which rule and its parameters (from the model's spec)."""

    scoring: str
    top_k: int
    renormalize: bool = False
    n_group: int = 1
    topk_group: int = 1
    scaling_factor: float = 1.0

    def __post_init__(self):
        if self.scoring not in SCORINGS:
            raise ValueError(f"scoring must be one of {SCORINGS}, got {self.scoring!r}")

    def __call__(self, router_logits: torch.Tensor, *, correction_bias: torch.Tensor | None = None,
                 capture: Optional[Any] = None, layer_id: int | None = None, exact: bool = False,
                 triton: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """router_logits [N, E] -> topk_weights float32 [N, K], topk_ids int64 [N, K] (captured).
        triton: the router kernels of kernels/topk.py (not in deterministic inference, whose
        routing stays the torch rule's: a row's scores and top-k are its own)."""
        if triton and not exact:
            from rollout.models.kernels import topk as topk_kernels  # noqa: PLC0415  (triton only when chosen)

            if self.scoring == "softmax":
                return topk_kernels.softmax_topk_triton(router_logits, self.top_k, self.renormalize,
                                                        capture=capture, layer_id=layer_id)
            if self.scoring == "sigmoid":
                return topk_kernels.grouped_sigmoid_topk_triton(
                    router_logits, self.top_k, correction_bias=correction_bias, n_group=self.n_group,
                    topk_group=self.topk_group, norm_topk_prob=self.renormalize,
                    routed_scaling_factor=self.scaling_factor, capture=capture, layer_id=layer_id)
            return topk_kernels.topk_softmax_triton(router_logits, self.top_k, capture=capture, layer_id=layer_id)
        if self.scoring == "softmax":
            return softmax_topk(router_logits, self.top_k, self.renormalize, capture=capture, layer_id=layer_id)
        if self.scoring == "sigmoid":
            return grouped_sigmoid_topk(router_logits, correction_bias, self.top_k, n_group=self.n_group,
                                        topk_group=self.topk_group, renormalize=self.renormalize,
                                        scaling_factor=self.scaling_factor, capture=capture, layer_id=layer_id,
                                        exact=exact)
        return topk_softmax(router_logits, self.top_k, capture=capture, layer_id=layer_id, exact=exact)
