"""Exact mode: a transformers MoE model whose forward computes the engine's deterministic-mode numbers.

``make_trainer_exact(model)`` swaps, in place, the classes of a transformers 5.x softmax-routed MoE
model's modules (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE) for subclasses whose forward calls the
batch-invariant ops of ``rollout.exact``, in the order the engine's models call them
(rollout/models/*, deterministic inference): every ``nn.Linear`` (projections, dense MLPs,
routers' siblings, lm_head) through ``rollout.exact.linear``; RMSNorm through ``rms_norm``; RoPE
cos/sin from the engine's formula; attention through ``rollout.exact.attention`` per packed sample
(keys counted from the sample's first token, so the key tiles line up with the engine's); the
router's fp32 softmax and top-k by a stable descending sort (lower id wins ties); experts through
``fused_experts`` (k slots summed in order); Qwen2-MoE's shared-expert gate through ``sigmoid``;
SiLU through ``silu``. Parameters, their names and the state_dict are untouched, so DeepSpeed,
weight sync and ``RouterReplay`` (its hooks sit on the routers, which keep their classes' MRO and
their ``(logits, weights, ids)`` output) work as before. Every op is differentiable: the backward
is autograd's through the same ops.
"""
from __future__ import annotations

import torch
from torch import nn

from rollout import exact as exact_ops

__all__ = ["EXACT_ATTENTION", "make_trainer_exact", "packed_segments"]

EXACT_ATTENTION = "rollout_exact"
_SUPPORTED = ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM", "OlmoeForCausalLM")


def packed_segments(position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """position_ids [N] of packed samples (each restarting at 0) -> (segment of each token [N],
    offset of each token in its segment [N], longest segment). A segment starts where the position
    does not continue the previous one; it must start at 0 (its first key is key 0)."""
    n = position_ids.shape[0]
    starts = torch.ones(n, dtype=torch.bool, device=position_ids.device)
    starts[1:] = position_ids[1:] != position_ids[:-1] + 1
    if bool((position_ids[starts] != 0).any()):
        raise ValueError("exact attention: every packed sample must start at position 0 "
                         f"(position_ids of segment starts: {position_ids[starts].tolist()[:8]})")
    seg = torch.cumsum(starts.long(), 0) - 1                                       # [N]
    offset = position_ids.long()
    return seg, offset, int(offset.max()) + 1


def exact_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask=None, scaling: float | None = None, dropout: float = 0.0,
                            sliding_window: int | None = None, position_ids: torch.Tensor | None = None,
                            **kwargs):
    """transformers attention interface: query [1, H, N, D], key/value [1, kvH, N, D] of one packed
    row -> ([1, N, H, D], None), each sample attending causally to its own tokens only."""
    if position_ids is None or query.shape[0] != 1:
        raise ValueError("exact attention needs one packed row [1, N] and its position_ids (PackedBatch.model_inputs)")
    if dropout:
        raise ValueError(f"exact attention has no dropout (attention_dropout must be 0, got {dropout})")
    _, h, n, d = query.shape
    kvh, dv = key.shape[1], value.shape[-1]
    seg, off, longest = packed_segments(position_ids.reshape(-1))
    segments = int(seg[-1]) + 1
    grid = seg * longest + off                                                     # [N] row in the grid
    dev = query.device

    def to_grid(x: torch.Tensor, heads: int, width: int) -> torch.Tensor:          # [1, heads, N, w] -> [S, heads, T, w]
        flat = x[0].transpose(0, 1)                                                # [N, heads, w]
        g = flat.new_zeros(segments * longest, heads, width).index_copy(0, grid, flat)
        return g.view(segments, longest, heads, width).transpose(1, 2)

    q = to_grid(query, h, d)
    # NOTE: GQA as the engine: each kv head repeated for its query heads (repeat_interleave on heads)
    k = to_grid(key, kvh, d).repeat_interleave(h // kvh, dim=1)
    v = to_grid(value, kvh, dv).repeat_interleave(h // kvh, dim=1)
    lengths = torch.bincount(seg, minlength=segments)                              # [S]
    pos = torch.arange(longest, device=dev)
    mask = (pos[None, :, None] >= pos[None, None, :]) & (pos[None, None, :] < lengths[:, None, None])  # [S, T, T]
    if sliding_window:                                                             # NOTE: 0 / None: no window
        mask &= pos[None, None, :] > pos[None, :, None] - sliding_window
    scale = module.scaling if scaling is None else scaling
    out = exact_ops.attention(q, k, v, mask[:, None], scale)                       # [S, H, T, Dv]
    out = out.transpose(1, 2).reshape(segments * longest, h, dv).index_select(0, grid)  # [N, H, Dv]
    return out[None], None


# ---- the modules' exact forms ------------------------------------------------------------------
class _ExactRMSNorm(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return exact_ops.rms_norm(x, self.weight, self.variance_epsilon)


class _ExactRotary(nn.Module):
    """cos/sin as rollout.models.layers.RotaryEmbedding computes them (default RoPE)."""

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor):
        d = self.inv_freq.shape[0] * 2
        theta = float(self.config.rope_parameters["rope_theta"])
        inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float, device=x.device) / d))
        freqs = position_ids[..., None].float() * inv_freq                         # [B, T, d/2]
        emb = torch.cat((freqs, freqs), dim=-1)                                    # [B, T, d]
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


class _ExactRouter(nn.Module):
    """rollout.models.moe.softmax_topk over rollout.exact.linear logits; transformers' output."""

    def forward(self, hidden_states: torch.Tensor):
        logits = exact_ops.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)   # [N, E]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
        weights, ids = weights[:, :self.top_k], ids[:, :self.top_k]                # [N, K]
        if getattr(self, "norm_topk_prob", True):                                  # NOTE: Mixtral always
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights.to(logits.dtype), ids


class _ExactExperts(nn.Module):
    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        return exact_ops.fused_experts(hidden_states, self.gate_up_proj, self.down_proj,
                                       top_k_weights.float(), top_k_index)


class _ExactMLP(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(exact_ops.silu(self.gate_proj(x)) * self.up_proj(x))


class _ExactSharedExpertBlock(nn.Module):
    """Qwen2-MoE: routed experts + sigmoid(shared_expert_gate(x)) * shared_expert(x), as the engine."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        b, t, hidden = hidden_states.shape
        x = hidden_states.view(-1, hidden)
        _, weights, ids = self.gate(x)
        out = self.experts(x, ids, weights)
        shared = exact_ops.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return (out + shared).reshape(b, t, hidden)


def _kind(module: nn.Module) -> type | None:
    name = type(module).__name__
    if name.endswith("RMSNorm"):
        return _ExactRMSNorm
    if name.endswith("RotaryEmbedding"):
        return _ExactRotary
    if name.endswith("TopKRouter"):
        return _ExactRouter
    if name.endswith("Experts") and hasattr(module, "gate_up_proj"):
        return _ExactExperts
    if name.endswith("MLP") and hasattr(module, "gate_proj"):
        return _ExactMLP
    if name.endswith("SparseMoeBlock") and hasattr(module, "shared_expert_gate"):
        return _ExactSharedExpertBlock
    return None


def make_trainer_exact(model: nn.Module) -> int:
    """In place: model (a transformers softmax-routed MoE causal LM) computes as the engine's
    deterministic mode. Returns how many modules changed. ValueError for an unsupported model."""
    from transformers import AttentionInterface

    arch = type(model).__name__
    if arch not in _SUPPORTED:
        raise ValueError(f"exact mode supports {list(_SUPPORTED)}, not {arch}")
    cfg = model.config
    rope = getattr(cfg, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"exact mode needs default RoPE, the model has rope_type {rope.get('rope_type')!r}")
    if float(getattr(cfg, "attention_dropout", 0.0) or 0.0):
        raise ValueError(f"exact mode needs attention_dropout 0, got {cfg.attention_dropout}")
    # NOTE: idempotent registration of a named function in transformers' attention registry
    AttentionInterface.register(EXACT_ATTENTION, exact_attention_forward)
    cfg._attn_implementation = EXACT_ATTENTION
    changed = exact_ops.make_exact(model)                                          # every nn.Linear
    made: dict[type, type] = {}
    for module in model.modules():
        kind = _kind(module)
        if kind is not None and not isinstance(module, kind):
            base = type(module)
            if base not in made:
                made[base] = type(f"Exact{base.__name__}", (kind, base), {})
            module.__class__ = made[base]
            changed += 1
    return changed
