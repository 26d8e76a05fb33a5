"""DeepSeek-V3 family (DeepSeek-V3/R1, Kimi-K2, Moonlight): MLA, YaRN RoPE, first_k_dense_replace
dense layers, biased sigmoid routing in groups (noaux_tc) and ungated shared experts."""
from __future__ import annotations

from rollout.models.causal_lm import MoeCausalLM
from rollout.models.rope_scaling import rope_parameters
from rollout.models.spec import MLASpec, ModelSpec, common_fields, require, routing_fields


def grouped_routing_fields(cfg: dict, num_layers: int, default_scaling: float) -> dict:
    """The MoE fields DeepSeek-V3 and GLM-4.5 read the same way (sigmoid scores, groups, shared
    experts, dense first layers, multi-token-prediction layers the checkpoint may carry); missing
    fields take transformers' defaults."""
    scoring = cfg.get("scoring_func", "sigmoid")
    if scoring != "sigmoid":
        raise ValueError(f"scoring_func {scoring!r} is not supported (only 'sigmoid')")
    method = cfg.get("topk_method", "noaux_tc")
    if method != "noaux_tc":
        raise ValueError(f"topk_method {method!r} is not supported (only 'noaux_tc')")
    moe_size = int(require(cfg, "moe_intermediate_size"))
    nextn = int(cfg.get("num_nextn_predict_layers", 0) or 0)
    return dict(
        intermediate_size=int(cfg.get("intermediate_size") or 0),
        moe_intermediate_size=moe_size,
        shared_experts_intermediate_size=moe_size * int(cfg.get("n_shared_experts", 1) or 0),
        renormalize=bool(cfg.get("norm_topk_prob", True)),
        **routing_fields(cfg),
        scoring="sigmoid",
        n_group=int(cfg.get("n_group", 1) or 1),
        topk_group=int(cfg.get("topk_group", 1) or 1),
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", default_scaling)),
        skipped_checkpoint_layers=tuple(range(num_layers, num_layers + nextn)),
    )


class DeepseekV3ForCausalLM(MoeCausalLM):
    @classmethod
    def spec_from_config(cls, cfg: dict, generation_config: dict | None = None) -> ModelSpec:
        common = common_fields(cfg, generation_config, default_eps=1e-6, default_max_pos=4096,
                               scaled_rope_ok=True)
        theta, _, scaling = rope_parameters(cfg)
        nope, rope = int(require(cfg, "qk_nope_head_dim")), int(require(cfg, "qk_rope_head_dim"))
        scale = (nope + rope) ** -0.5 * (scaling.softmax_scale_factor if scaling is not None else 1.0)
        q_lora = cfg.get("q_lora_rank")
        mla = MLASpec(q_lora_rank=int(q_lora) if q_lora else None, kv_lora_rank=int(require(cfg, "kv_lora_rank")),
                      qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=int(require(cfg, "v_head_dim")),
                      rope_interleave=bool(cfg.get("rope_interleave", True)), softmax_scale=scale)
        heads = common["num_attention_heads"]
        common.update(num_kv_heads=heads, head_dim=nope + rope, rope_theta=theta)
        bias = bool(cfg.get("attention_bias", False))
        return ModelSpec(**common, o_bias=bias, rope_scaling=scaling, mla=mla,
                         **grouped_routing_fields(cfg, common["num_hidden_layers"], default_scaling=2.5))
