"""gpt-oss (gpt-oss-20b, gpt-oss-120b): GQA with q/k/v/o biases and learned per-head attention
sinks, sliding-window and full-attention layers alternating (`layer_types`), YaRN RoPE, a biased
router whose top-k logits are softmaxed over the k, experts with biases and a clamped SwiGLU.

Checkpoints: the MXFP4 release (experts as `*_blocks` / `*_scales`, dequantized on load by the
loader) and BF16 ones. Their names differ from the shared blocks' in three places, mapped here:
`mlp.router` is the block's `gate`, the experts' tensors are transformers' fused layout
(gate_up_proj [E, H, 2I] with gate / up interleaved, down_proj [E, I, H], and their biases),
and `self_attn.sinks` sits on the attention core.
"""
from __future__ import annotations

from rollout.models.causal_lm import MoeCausalLM
from rollout.models.rope_scaling import rope_parameters
from rollout.models.spec import ModelSpec, common_fields, require, routing_fields

LAYER_TYPES = ("sliding_attention", "full_attention")


class GptOssForCausalLM(MoeCausalLM):
    quantized_formats = ("mxfp4",)
    hf_renames = (
        (r"\.mlp\.router\.", ".mlp.gate."),
        (r"\.mlp\.experts\.gate_up_proj$", ".mlp.experts.w13"),
        (r"\.mlp\.experts\.down_proj$", ".mlp.experts.w2"),
        (r"\.mlp\.experts\.gate_up_proj_bias$", ".mlp.experts.b13"),
        (r"\.mlp\.experts\.down_proj_bias$", ".mlp.experts.b2"),
        (r"\.self_attn\.sinks$", ".self_attn.attn.sinks"),
    )
    hf_transforms = (
        (r"\.mlp\.experts\.gate_up_proj$", "gate_up_interleaved"),
        (r"\.mlp\.experts\.down_proj$", "transpose"),
        (r"\.mlp\.experts\.gate_up_proj_bias$", "interleaved"),
    )

    @classmethod
    def spec_from_config(cls, cfg: dict, generation_config: dict | None = None) -> ModelSpec:
        common = common_fields(cfg, generation_config, default_theta=150000.0, default_eps=1e-5,
                               default_max_pos=131072, scaled_rope_ok=True)
        theta, partial, scaling = rope_parameters(cfg, default_theta=150000.0)
        n_layers = common["num_hidden_layers"]
        layer_types = cfg.get("layer_types") or [LAYER_TYPES[i % 2] for i in range(n_layers)]
        if len(layer_types) != n_layers or set(layer_types) - set(LAYER_TYPES):
            raise ValueError(f"layer_types must list one of {LAYER_TYPES} per layer ({n_layers}), got {layer_types}")
        window = cfg.get("sliding_window")
        if "sliding_attention" in layer_types and not window:
            raise ValueError("layer_types has sliding_attention layers but sliding_window is not set")
        bias = bool(cfg.get("attention_bias", True))
        common.update(rope_theta=theta)
        return ModelSpec(
            **common,
            qkv_bias=bias,
            o_bias=bias,
            attention_sinks=True,
            sliding_windows=tuple(int(window) if t == "sliding_attention" else None for t in layer_types),
            partial_rotary_factor=partial,
            rope_scaling=scaling,
            moe_intermediate_size=int(require(cfg, "intermediate_size")),
            renormalize=False,
            scoring="topk_softmax",
            router_bias=True,
            expert_bias=True,
            swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
            swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
            **routing_fields(cfg),
        )
