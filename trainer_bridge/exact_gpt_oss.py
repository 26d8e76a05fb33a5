"""Exact mode's gpt-oss MoE and RoPE: computed as the engine's deterministic mode computes them.

ExactTopKSoftmaxRouter (for transformers' GptOssTopKRouter): logits = rollout.exact.linear(x, W,
b) (the router's bias included), then the engine's rule, rollout.models.moe.routing.topk_softmax
in its exact form: ids = the k largest logits by a stable descending sort (lower id wins ties),
weights = rollout.exact.softmax over those k logits. Returns transformers' (logits, weights, ids).

ExactGptOssMLP (for GptOssMLP) takes the router's logits and ids and computes the weights of those
ids itself with the engine's op sequence (the ids' fp32 logits gathered, exact softmax): with live
ids these are the router's own weights bit for bit, and under RouterReplay (whose hook replaces the
ids, and the weights by torch's softmax) the replayed ids get the engine's weights too, so
replaying the rollout's routing changes nothing. Returns transformers' (hidden, weights).

ExactBiasedExperts (for GptOssExperts): rollout.exact.fused_experts with the expert biases and
the clamped SwiGLU (swiglu_limit, swiglu_alpha). transformers stores gate_up_proj as [E, H, 2I]
with gate and up columns interleaved (gate = [..., ::2], up = [..., 1::2]) and down_proj as
[E, I, H] (x @ W); fused_experts takes w13 [E, 2I, H] (gate rows, then up rows), b13 [E, 2I] in
the same order, w2 [E, H, I]. Those are built from the parameters in every forward (strided
slices, concatenation, transposed contiguous copies: differentiable, so the gradients land in
transformers' parameters), in the engine's contiguous layout.

ExactHalfRotary (for GptOssRotaryEmbedding): the engine's RotaryEmbedding cos/sin (YaRN inv_freq
and attention factor from the engine's ModelSpec), first half of the rotary dims: transformers'
gpt-oss rotates the halves with [..., d/2] cos/sin as x1 * cos - x2 * sin, x2 * cos + x1 * sin,
which are the engine's x * cos + rotate_half(x) * sin bit for bit (a + (-b) == a - b in IEEE).
"""
from __future__ import annotations

import torch
from torch import nn

from rollout import exact as exact_ops
from rollout.models.moe.routing import topk_softmax

__all__ = ["ExactBiasedExperts", "ExactGptOssMLP", "ExactHalfRotary", "ExactTopKSoftmaxRouter",
           "engine_expert_weights", "topk_softmax_weights"]


def topk_softmax_weights(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """logits [N, E], ids [N, K] -> float32 weights [N, K]: topk_softmax's weights of these ids
    (exact softmax over their fp32 logits, in the ids' order)."""
    return exact_ops.softmax(logits.float().gather(1, ids))


def engine_expert_weights(experts: nn.Module) -> tuple[torch.Tensor, ...]:
    """transformers' GptOssExperts parameters -> (w13 [E, 2I, H], b13 [E, 2I], w2 [E, H, I], b2 [E, H])
    in the engine's layout, gate rows then up rows; differentiable views/copies of the parameters."""
    gate_up, bias = experts.gate_up_proj, experts.gate_up_proj_bias            # [E, H, 2I], [E, 2I]
    w13 = torch.cat((gate_up[..., 0::2], gate_up[..., 1::2]), dim=-1).transpose(1, 2).contiguous()
    b13 = torch.cat((bias[..., 0::2], bias[..., 1::2]), dim=-1)
    w2 = experts.down_proj.transpose(1, 2).contiguous()                        # [E, I, H] -> [E, H, I]
    return w13, b13, w2, experts.down_proj_bias


class ExactTopKSoftmaxRouter(nn.Module):
    def forward(self, hidden_states: torch.Tensor):
        x = hidden_states.reshape(-1, self.hidden_dim)
        logits = exact_ops.linear(x, self.weight, self.bias)                       # [N, E]
        weights, ids = topk_softmax(logits, self.top_k, exact=True)               # [N, K] float32, int64
        return logits, weights.to(logits.dtype), ids


class ExactGptOssMLP(nn.Module):
    def forward(self, hidden_states: torch.Tensor):
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])                                   # [N, hidden]
        logits, _, ids = self.router(x)
        weights = topk_softmax_weights(logits, ids)
        return self.experts(x, ids, weights).reshape(shape), weights


class ExactBiasedExperts(nn.Module):
    def forward(self, hidden_states: torch.Tensor, router_indices: torch.Tensor, routing_weights: torch.Tensor):
        w13, b13, w2, b2 = engine_expert_weights(self)
        return exact_ops.fused_experts(hidden_states, w13, w2, routing_weights.float(), router_indices,
                                       b13=b13, b2=b2, swiglu_limit=float(self.limit),
                                       swiglu_alpha=float(self.alpha))


class ExactHalfRotary(nn.Module):
    exact_rope: tuple   # (rotary_dim, rope_theta, YarnScaling or None), set by make_trainer_exact

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor):
        from rollout.models.layers import RotaryEmbedding

        cos, sin = RotaryEmbedding(*self.exact_rope).cos_sin(position_ids.reshape(-1), x.dtype)   # [N, 1, d]
        half = cos.shape[-1] // 2
        return cos[..., :half].reshape(*position_ids.shape, half), sin[..., :half].reshape(*position_ids.shape, half)
