"""Qwen2-MoE: q/k/v bias, shared expert with a sigmoid gate, dense layers by rule."""
from __future__ import annotations

from rollout.models.causal_lm import MoeCausalLM
from rollout.models.spec import ModelSpec, common_fields, require, routing_fields


class Qwen2MoeForCausalLM(MoeCausalLM):
    @classmethod
    def spec_from_config(cls, cfg: dict, generation_config: dict | None = None) -> ModelSpec:
        common = common_fields(cfg, generation_config, default_eps=1e-6, default_max_pos=32768)
        n_layers = common["num_hidden_layers"]
        use_sw = bool(cfg.get("use_sliding_window", False))
        window = cfg.get("sliding_window") if use_sw else None
        # HF's default layer_types: sliding on even layers below max_window_layers, if enabled
        layer_types = cfg.get("layer_types") or [
            "sliding_attention" if (i + 1) % 2 and i < cfg.get("max_window_layers", 28) and use_sw
            else "full_attention" for i in range(n_layers)]
        windows = tuple(window if t == "sliding_attention" and window else None for t in layer_types)
        return ModelSpec(
            **common,
            qkv_bias=bool(cfg.get("qkv_bias", True)),
            o_bias=False,
            sliding_windows=windows if any(windows) else (),
            intermediate_size=int(cfg.get("intermediate_size") or 0),
            moe_intermediate_size=int(require(cfg, "moe_intermediate_size")),
            shared_expert_intermediate_size=int(require(cfg, "shared_expert_intermediate_size")),
            renormalize=bool(cfg.get("norm_topk_prob", False)),
            **routing_fields(cfg),
        )
