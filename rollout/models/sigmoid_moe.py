"""GroupedSigmoidMoE: DeepSeek-V3 / GLM-4.5 MoE block (biased sigmoid routing in groups, shared experts),
with its routing rule (grouped_sigmoid_topk, a capture hook point as softmax_topk in moe.py)."""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from rollout import exact as exact_ops
from rollout.batch.forward_batch import ForwardBatch
from rollout.models.layers import GatedMLP
from rollout.models.moe import SparseMoE
from rollout.models.spec import ModelSpec


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


class BiasedRouter(nn.Module):
    """gate.weight [E, H] and gate.e_score_correction_bias [E], both kept in float32.

    The bias is a load-balancing statistic (updated outside the gradient by the trainer's
    balancing rule): a parameter here only so checkpoints and weight updates reach it by name.
    """

    exact = False   # rollout.exact.linear (deterministic inference)

    def __init__(self, hidden_size: int, num_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32))
        self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts, dtype=torch.float32),
                                                    requires_grad=False)

    def _apply(self, fn, recurse=True):
        # NOTE: model.to(bfloat16) must not round the router: transformers keeps gate.weight and
        # the bias in fp32 (_keep_in_fp32_modules_strict), and routing is computed in fp32.
        super()._apply(fn, recurse)
        for p in self.parameters(recurse=False):
            if p.dtype != torch.float32:
                p.data = p.data.float()
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (exact_ops.linear if self.exact else F.linear)(x.float(), self.weight)  # [N, E] float32


class GroupedSigmoidMoE(SparseMoE):
    def __init__(self, spec: ModelSpec, layer_id: int):
        super().__init__(layer_id=layer_id, hidden_size=spec.hidden_size,
                         intermediate_size=spec.moe_intermediate_size, num_experts=spec.num_experts,
                         top_k=spec.top_k, renormalize=spec.renormalize)
        self.gate = BiasedRouter(spec.hidden_size, spec.num_experts)
        self.n_group, self.topk_group = spec.n_group, spec.topk_group
        self.routed_scaling_factor = spec.routed_scaling_factor
        self.shared_experts = (GatedMLP(spec.hidden_size, spec.shared_experts_intermediate_size)
                               if spec.shared_experts_intermediate_size > 0 else None)

    def route(self, x: torch.Tensor, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        if self._triton_router:
            from rollout.models.topk_triton import grouped_sigmoid_topk_triton  # noqa: PLC0415  (triton only when chosen)

            return grouped_sigmoid_topk_triton(
                self.gate(x), self.top_k, correction_bias=self.gate.e_score_correction_bias, n_group=self.n_group,
                topk_group=self.topk_group, norm_topk_prob=self.renormalize,
                routed_scaling_factor=self.routed_scaling_factor, capture=fb.capture, layer_id=self.layer_id)
        return grouped_sigmoid_topk(self.gate(x), self.gate.e_score_correction_bias, self.top_k,
                                    n_group=self.n_group, topk_group=self.topk_group,
                                    renormalize=self.renormalize, scaling_factor=self.routed_scaling_factor,
                                    capture=fb.capture, layer_id=self.layer_id, exact=self.gate.exact)

    def shared_output(self, x: torch.Tensor) -> torch.Tensor | None:
        return None if self.shared_experts is None else self.shared_experts(x)
