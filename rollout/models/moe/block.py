"""SparseMoE: one MoE layer = a router, its RoutingRule, the routed experts and the optional
shared experts (Qwen2-MoE's sigmoid-gated `shared_expert`, DeepSeek-V3's ungated `shared_experts`).

The parts vary by data from the model's spec, never by subclass: the rule (softmax top-k,
grouped / plain sigmoid with a correction bias, top-k then softmax), the router (biased or not,
fp32 for sigmoid routing), the experts' MLP (SwiGLU or clamped SwiGLU, biases or not).
"""
from __future__ import annotations

import torch
from torch import nn

from rollout import exact as exact_ops
from rollout.batch.forward_batch import ForwardBatch
from rollout.config import MOE_BACKENDS
from rollout.models.layers import GatedMLP
from rollout.models.moe.experts import FusedExperts
from rollout.models.moe.router import BiasedRouter, Router
from rollout.models.moe.routing import RoutingRule
from rollout.models.spec import ModelSpec


class SparseMoE(nn.Module):
    def __init__(self, spec: ModelSpec, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.rule = RoutingRule(scoring=spec.scoring, top_k=spec.top_k, renormalize=spec.renormalize,
                                n_group=spec.n_group, topk_group=spec.topk_group,
                                scaling_factor=spec.routed_scaling_factor)
        self.moe_backend = "torch"     # "triton": router and experts run the Triton kernels (set_moe_backend)
        self.gate = (BiasedRouter(spec.hidden_size, spec.num_experts) if spec.scoring == "sigmoid"
                     else Router(spec.hidden_size, spec.num_experts, bias=spec.router_bias))
        self.experts = FusedExperts(spec.hidden_size, spec.moe_intermediate_size, spec.num_experts,
                                    bias=spec.expert_bias, swiglu_limit=spec.swiglu_limit,
                                    swiglu_alpha=spec.swiglu_alpha)
        self.shared_expert = self.shared_expert_gate = self.shared_experts = None
        if spec.shared_expert_intermediate_size > 0:           # Qwen2-MoE: gated by sigmoid(shared_expert_gate(x))
            self.shared_expert = GatedMLP(spec.hidden_size, spec.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(spec.hidden_size, 1, bias=False)
        if spec.shared_experts_intermediate_size > 0:          # DeepSeek-V3 / GLM-4.5: ungated
            self.shared_experts = GatedMLP(spec.hidden_size, spec.shared_experts_intermediate_size)

    @property
    def top_k(self) -> int:
        return self.rule.top_k

    def forward(self, x: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """x [N, H] -> [N, H]."""
        ep = fb.ep_group
        if ep is None:
            topk_weights, topk_ids = self.route(x, fb)
            out = self.experts(x, topk_weights, topk_ids, graph_safe=fb.graph_safe, impl=self._experts_impl)
        else:
            # DP attention: route every rank's tokens (gathered by the executing runner's layout, so
            # the capture buffer rows sit where the capturer slices them), compute this rank's
            # experts, and sum over ranks back into this rank's own rows.
            assert (self.experts.expert_lo, self.experts.expert_hi) == ep.expert_range(self.experts.num_experts), \
                "DP attention needs the model loaded with this rank's expert shard (load_model(expert_shard=...))"
            x_all = ep.gather(x, fb.layout)                                # [layout.total_rows, H]
            topk_weights, topk_ids = self.route(x_all, fb)
            if self.experts.exact:
                # NOTE: the ranks' terms are added per slot (one nonzero term each), then the slots
                # in order: the same bits as one rank holding every expert
                terms = self.experts.exact_terms(x_all, topk_weights, topk_ids,
                                                 triton=self.moe_backend == "triton")  # [rows, K, H]
                rows, k, hidden = terms.shape
                own = ep.reduce_own(terms.view(rows, k * hidden), fb.layout)     # [N, K*H]
                out = exact_ops.sum_slots(own.view(-1, k, hidden))               # [N, H]
            else:
                partial = self.experts(x_all, topk_weights, topk_ids, graph_safe=fb.graph_safe,
                                       impl=self._experts_impl)            # own experts
                out = ep.reduce_own(partial, fb.layout)                    # [N, H]
        shared = self.shared_output(x)
        return out if shared is None else out + shared

    @property
    def _experts_impl(self) -> str | None:
        if self.moe_backend != "triton":
            return None
        return "exact_triton" if self.experts.exact else "triton"

    def route(self, x: torch.Tensor, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """x [rows, H] -> topk_weights float32 [rows, K], topk_ids int64 [rows, K] (captured)."""
        return self.rule(self.gate(x), correction_bias=self.gate.e_score_correction_bias, capture=fb.capture,
                         layer_id=self.layer_id, exact=self.gate.exact,
                         triton=self.moe_backend == "triton")

    def shared_output(self, x: torch.Tensor) -> torch.Tensor | None:
        """The shared experts' part of the output [N, H] (this rank's own rows), or None."""
        if self.shared_experts is not None:
            return self.shared_experts(x)
        if self.shared_expert is None:
            return None
        sigmoid = exact_ops.sigmoid if self.experts.exact else torch.sigmoid
        return sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


def set_moe_backend(model: nn.Module, backend: str) -> int:
    """Makes every MoE layer of model (modules with a moe_backend) use backend ("torch" | "triton");
    returns how many layers it set."""
    if backend not in MOE_BACKENDS:
        raise ValueError(f"moe_backend must be one of {MOE_BACKENDS}, got {backend!r}")
    layers = [m for m in model.modules() if hasattr(m, "moe_backend")]
    for m in layers:
        m.moe_backend = backend
    return len(layers)
