"""GroupedSigmoidMoE: DeepSeek-V3 / GLM-4.5 MoE block (biased sigmoid routing in groups, shared experts)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rollout import exact as exact_ops
from rollout.batch.forward_batch import ForwardBatch
from rollout.models.layers import GatedMLP
from rollout.models.moe import SparseMoE
from rollout.models.spec import ModelSpec
from rollout.models.topk import grouped_sigmoid_topk


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
