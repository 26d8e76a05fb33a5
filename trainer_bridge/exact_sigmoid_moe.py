"""Exact mode's DeepSeek-V3 / GLM-4.5 MoE: biased sigmoid routing in groups, as the engine routes.

ExactGroupedRouter (for transformers' DeepseekV3TopkRouter / Glm4MoeTopkRouter) computes the
router logits with rollout.exact.linear over fp32 inputs (the engine's BiasedRouter) and the
expert choice with the engine's own rule, rollout.models.moe.routing.grouped_sigmoid_topk in its
exact form (rollout.exact.sigmoid; correction bias for the choice, group limit, stable sort:
lower id wins ties), returning transformers' (logits, weights, ids).

ExactGroupedMoE (for DeepseekV3MoE / Glm4MoeMoE) takes the router's logits and ids and computes
the gate weights of those ids itself, with the engine's op sequence (exact sigmoid of the
logits, gathered at the ids, divided by their sum + 1e-20 when norm_topk_prob, times
routed_scaling_factor): with live ids these are the router's own weights bit for bit, and under
RouterReplay (whose hook replaces the router's ids, and its weights by torch's sigmoid) the
replayed ids get the engine's weights too, so replaying the rollout's routing changes nothing.
Then the routed experts (rollout.exact.fused_experts, k slots summed in order) plus the shared
experts (exact SiLU MLP), in the engine's order.

MiniMax-M2 is the same rule with one group and no shared experts: ExactSigmoidRouter (for
transformers' MiniMaxM2TopKRouter, whose forward takes the block's e_score_correction_bias) and
ExactSigmoidMoE (for MiniMaxM2SparseMoeBlock), with the routing fields the engine's ModelSpec
reads from config.json (`exact_routing`: n_group, topk_group, renormalize, scaling factor; set by
make_trainer_exact).
"""
from __future__ import annotations

import torch
from torch import nn

from rollout import exact as exact_ops
from rollout.models.moe.routing import grouped_sigmoid_topk

__all__ = ["ExactGroupedMoE", "ExactGroupedRouter", "ExactSigmoidMoE", "ExactSigmoidRouter", "sigmoid_gate_weights"]


def sigmoid_gate_weights(logits: torch.Tensor, ids: torch.Tensor, renormalize: bool, scaling: float) -> torch.Tensor:
    """logits [N, E], ids [N, K] -> float32 weights [N, K], grouped_sigmoid_topk's steps 1 and 4."""
    weights = exact_ops.sigmoid(logits.float()).gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling


class ExactGroupedRouter(nn.Module):
    def forward(self, hidden_states: torch.Tensor):
        x = hidden_states.reshape(-1, self.hidden_dim)
        logits = exact_ops.linear(x.float(), self.weight.float())                 # [N, E] float32
        weights, ids = grouped_sigmoid_topk(
            logits, self.e_score_correction_bias, self.top_k, n_group=self.num_group, topk_group=self.topk_group,
            renormalize=bool(self.norm_topk_prob), scaling_factor=float(self.routed_scaling_factor), exact=True)
        return logits, weights, ids


class ExactGroupedMoE(nn.Module):
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])                                   # [N, hidden]
        logits, _, ids = self.gate(x)
        gate = self.gate
        weights = sigmoid_gate_weights(logits, ids, bool(gate.norm_topk_prob), float(gate.routed_scaling_factor))
        out = self.experts(x, ids, weights)
        return (out + self.shared_experts(x)).reshape(shape)


class ExactSigmoidRouter(nn.Module):
    exact_routing: tuple    # (n_group, topk_group, renormalize, scaling_factor) of the engine's ModelSpec

    def forward(self, hidden_states: torch.Tensor, e_score_correction_bias: torch.Tensor):
        n_group, topk_group, renormalize, scaling = self.exact_routing
        x = hidden_states.reshape(-1, self.hidden_dim)
        logits = exact_ops.linear(x.float(), self.weight.float())                 # [N, E] float32
        weights, ids = grouped_sigmoid_topk(
            logits, e_score_correction_bias, self.top_k, n_group=n_group, topk_group=topk_group,
            renormalize=renormalize, scaling_factor=scaling, exact=True)
        return logits, weights, ids


class ExactSigmoidMoE(nn.Module):
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])                                   # [N, hidden]
        logits, _, ids = self.gate(x, self.e_score_correction_bias)
        _, _, renormalize, scaling = self.gate.exact_routing
        weights = sigmoid_gate_weights(logits, ids, renormalize, scaling)
        return self.experts(x, ids, weights).reshape(shape)
