"""Exact mode: a transformers MoE model whose forward computes the engine's deterministic-mode numbers.

``make_trainer_exact(model)`` swaps, in place, the classes of a transformers 5.x MoE model's
modules (EXACT_ARCHITECTURES: Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, DeepSeek-V3, GLM-4.5, gpt-oss,
MiniMax-M2) for subclasses whose forward calls the batch-invariant ops of ``rollout.exact``, in
the order the engine's models call them (rollout/models/*, deterministic inference): every
``nn.Linear`` (projections, dense MLPs, routers' siblings, lm_head) through
``rollout.exact.linear``; RMSNorm through ``rms_norm``; RoPE cos/sin from the engine's formula
(DeepSeek-V3 / GLM-4.5 / gpt-oss / MiniMax-M2: the engine's RotaryEmbedding from its own
ModelSpec: YaRN, partial rotary); attention through ``rollout.exact.attention`` per packed sample
(keys counted from the sample's first token, so the key tiles line up with the engine's; gpt-oss's
sinks and sliding windows; DeepSeek-V3's MLA in the engine's absorbed form, exact_mla.py); the
softmax routers' fp32 softmax and top-k by a stable descending sort (lower id wins ties), the
sigmoid routers by the engine's grouped_sigmoid_topk (exact_sigmoid_moe.py), gpt-oss's biased
router by its topk_softmax (exact_gpt_oss.py); experts through ``fused_experts`` (k slots summed
in order; gpt-oss's with biases and the clamped SwiGLU); Qwen2-MoE's shared-expert gate through
``sigmoid``; SiLU through ``silu``. Parameters, their names and the state_dict are
untouched, so DeepSpeed, weight sync and ``RouterReplay`` (its hooks sit on the routers, which
keep their classes' MRO and their ``(logits, weights, ids)`` output) work as before. Every op is
differentiable: the backward is autograd's through the same ops. ``check_exact_support`` is the
refusal TrainConfig runs on the checkpoint's config.json before any server starts.
"""
from __future__ import annotations

import torch
from torch import nn

from rollout import exact as exact_ops

from .exact_gpt_oss import ExactBiasedExperts, ExactGptOssMLP, ExactHalfRotary, ExactTopKSoftmaxRouter
from .exact_grid import PackedGrid, packed_segments
from .exact_mla import ExactMLAAttention
from .exact_sigmoid_moe import ExactGroupedMoE, ExactGroupedRouter, ExactSigmoidMoE, ExactSigmoidRouter

__all__ = ["EXACT_ARCHITECTURES", "EXACT_ATTENTION", "check_exact_support", "exact_attention_forward",
           "make_trainer_exact", "packed_segments"]

EXACT_ATTENTION = "rollout_exact"
_SOFTMAX = ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM", "OlmoeForCausalLM")
_GROUPED = ("DeepseekV3ForCausalLM", "Glm4MoeForCausalLM")      # sigmoid routing in groups (+ MLA)
_BIASED = ("GptOssForCausalLM", "MiniMaxM2ForCausalLM")          # biased top-k-softmax / one-group sigmoid
EXACT_ARCHITECTURES = _SOFTMAX + _GROUPED + _BIASED


def exact_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask=None, scaling: float | None = None, dropout: float = 0.0,
                            sliding_window: int | None = None, position_ids: torch.Tensor | None = None,
                            **kwargs):
    """transformers attention interface: query [1, H, N, D], key/value [1, kvH, N, D] of one packed
    row -> ([1, N, H, D], None), each sample attending causally to its own tokens only (within the
    layer's sliding window when it has one); gpt-oss passes its per-head sink logits as `s_aux` [H]."""
    grid = PackedGrid.from_position_ids(position_ids, query.shape[0])
    if dropout:
        raise ValueError(f"exact attention has no dropout (attention_dropout must be 0, got {dropout})")
    h, kvh = query.shape[1], key.shape[1]
    q = grid.to_grid(query[0].transpose(0, 1)).transpose(1, 2)                     # [S, H, T, D]
    # NOTE: GQA as the engine: each kv head repeated for its query heads (repeat_interleave on heads)
    k = grid.to_grid(key[0].transpose(0, 1)).transpose(1, 2).repeat_interleave(h // kvh, dim=1)
    v = grid.to_grid(value[0].transpose(0, 1)).transpose(1, 2).repeat_interleave(h // kvh, dim=1)
    scale = module.scaling if scaling is None else scaling
    sinks = kwargs.get("s_aux")
    out = exact_ops.attention(q, k, v, grid.causal_mask(sliding_window)[:, None], scale,   # [S, H, T, Dv]
                              sinks=None if sinks is None else sinks.view(1, h, 1))
    return grid.from_grid(out.transpose(1, 2))[None], None                          # [1, N, H, Dv]


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
    """rollout.models.moe.routing.softmax_topk over rollout.exact.linear logits; transformers' output."""

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


class _EngineRotary(nn.Module):
    """cos/sin by the engine's own rollout.models.layers.RotaryEmbedding (DeepSeek-V3's YaRN,
    GLM-4.5's partial rotary), from the engine's ModelSpec (`exact_rope`, set by make_trainer_exact)."""

    exact_rope: tuple   # (rotary_dim, rope_theta, YarnScaling or None)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor):
        from rollout.models.layers import RotaryEmbedding

        cos, sin = RotaryEmbedding(*self.exact_rope).cos_sin(position_ids.reshape(-1), x.dtype)   # [N, 1, d]
        return cos.view(*position_ids.shape, -1), sin.view(*position_ids.shape, -1)


# modules of one architecture whose exact form is their own (matched by class name, before the suffixes)
_BY_CLASS = {"GptOssTopKRouter": ExactTopKSoftmaxRouter, "GptOssMLP": ExactGptOssMLP,
             "GptOssExperts": ExactBiasedExperts, "GptOssRotaryEmbedding": ExactHalfRotary,
             "MiniMaxM2TopKRouter": ExactSigmoidRouter, "MiniMaxM2SparseMoeBlock": ExactSigmoidMoE}


def _kind(module: nn.Module, engine_rope: bool) -> type | None:
    name = type(module).__name__
    for base in type(module).__mro__:
        if base.__name__ in _BY_CLASS:
            return _BY_CLASS[base.__name__]
    if name.endswith("RMSNorm"):
        return _ExactRMSNorm
    if name.endswith("RotaryEmbedding"):
        return _EngineRotary if engine_rope else _ExactRotary
    if name.endswith("TopKRouter"):
        return _ExactRouter
    if name.endswith("TopkRouter") and hasattr(module, "e_score_correction_bias"):
        return ExactGroupedRouter
    if name.endswith("Experts") and hasattr(module, "gate_up_proj"):
        return _ExactExperts
    if name.endswith("MLP") and hasattr(module, "gate_proj"):
        return _ExactMLP
    if name.endswith("SparseMoeBlock") and hasattr(module, "shared_expert_gate"):
        return _ExactSharedExpertBlock
    if name.endswith("MoE") and hasattr(module, "shared_experts") and hasattr(module, "gate"):
        return ExactGroupedMoE
    if name.endswith("Attention") and hasattr(module, "kv_b_proj"):
        return ExactMLAAttention
    return None


def check_exact_support(arch: str, cfg: dict):
    """ValueError (naming exact mode, the architecture and the supported list) unless exact mode
    can compute the engine's numbers for a checkpoint of `arch` with config.json `cfg`.
    -> the engine's ModelSpec for the grouped-routing and biased-router archs (their RoPE, MLA
    scale, routing fields), else None."""
    if arch not in EXACT_ARCHITECTURES:
        raise ValueError(f"exact mode supports {list(EXACT_ARCHITECTURES)}, not {arch}")
    if float(cfg.get("attention_dropout", 0.0) or 0.0):
        raise ValueError(f"exact mode needs attention_dropout 0 ({arch} has {cfg['attention_dropout']})")
    if float(cfg.get("router_jitter_noise", 0.0) or 0.0):
        raise ValueError(f"exact mode needs router_jitter_noise 0 ({arch} has {cfg['router_jitter_noise']}): "
                         "the engine routes without noise")
    if arch in _SOFTMAX:
        rope = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
        rope_type = rope.get("rope_type") or rope.get("type") or "default"
        if rope_type != "default":
            raise ValueError(f"exact mode needs default RoPE for {arch}, the model has rope_type {rope_type!r}")
        return None
    from rollout.models.registry import model_class

    try:
        return model_class(arch).spec_from_config(cfg)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"exact mode: the engine cannot serve this {arch} checkpoint ({exc})") from None


def make_trainer_exact(model: nn.Module) -> int:
    """In place: model (a transformers MoE causal LM of EXACT_ARCHITECTURES) computes as the
    engine's deterministic mode. Returns how many modules changed. ValueError for an unsupported model."""
    from transformers import AttentionInterface

    arch = type(model).__name__
    if arch not in EXACT_ARCHITECTURES:
        raise ValueError(f"exact mode supports {list(EXACT_ARCHITECTURES)}, not {arch}")
    spec = check_exact_support(arch, model.config.to_dict())
    # NOTE: idempotent registration of a named function in transformers' attention registry
    AttentionInterface.register(EXACT_ATTENTION, exact_attention_forward)
    model.config._attn_implementation = EXACT_ATTENTION
    changed = exact_ops.make_exact(model)                                          # every nn.Linear
    made: dict[type, type] = {}
    for module in model.modules():
        kind = _kind(module, engine_rope=spec is not None)
        if kind is not None and not isinstance(module, kind):
            base = type(module)
            if base not in made:
                made[base] = type(f"Exact{base.__name__}", (kind, base), {})
            module.__class__ = made[base]
            changed += 1
        if kind in (_EngineRotary, ExactHalfRotary):
            module.exact_rope = (spec.rotary_dim, spec.rope_theta, spec.rope_scaling)
        elif kind is ExactSigmoidRouter:
            module.exact_routing = (spec.n_group, spec.topk_group, spec.renormalize, spec.routed_scaling_factor)
        elif kind is ExactMLAAttention:
            module.exact_softmax_scale = float(spec.mla.softmax_scale)
            module.exact_rope_interleave = bool(spec.mla.rope_interleave)
    return changed
