"""GLM-4.5 / 4.6 MoE: GQA with partial rotary, optional per-head q/k norm, q/k/v bias, dense
first layers and the DeepSeek-V3 routing family (sigmoid + correction bias, shared experts)."""
from __future__ import annotations

from rollout.models.causal_lm import MoeCausalLM
from rollout.models.arch.deepseek_v3 import grouped_routing_fields
from rollout.models.rope_scaling import rope_parameters
from rollout.models.spec import ModelSpec, common_fields


class Glm4MoeForCausalLM(MoeCausalLM):
    @classmethod
    def spec_from_config(cls, cfg: dict, generation_config: dict | None = None) -> ModelSpec:
        common = common_fields(cfg, generation_config, default_eps=1e-5, default_max_pos=131072)
        _, partial, _ = rope_parameters(cfg)
        return ModelSpec(
            **common,
            qkv_bias=bool(cfg.get("attention_bias", False)),
            o_bias=False,
            qk_norm="head" if cfg.get("use_qk_norm", False) else "none",
            partial_rotary_factor=partial,
            **grouped_routing_fields(cfg, common["num_hidden_layers"], default_scaling=1.0),
        )
