"""Qwen3-MoE: per-head q/k RMSNorm, softmax top-k (norm_topk_prob), dense layers by rule."""
from __future__ import annotations

from rollout.models.causal_lm import MoeCausalLM
from rollout.models.spec import ModelSpec, common_fields, require, routing_fields


class Qwen3MoeForCausalLM(MoeCausalLM):
    @classmethod
    def spec_from_config(cls, cfg: dict, generation_config: dict | None = None) -> ModelSpec:
        common = common_fields(cfg, generation_config, default_eps=1e-6, default_max_pos=32768)
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", False) else None
        return ModelSpec(
            **common,
            qkv_bias=bool(cfg.get("attention_bias", False)),
            o_bias=bool(cfg.get("attention_bias", False)),
            qk_norm="head",
            sliding_windows=(window,) * common["num_hidden_layers"] if window else (),
            intermediate_size=int(cfg.get("intermediate_size") or 0),
            moe_intermediate_size=int(require(cfg, "moe_intermediate_size")),
            renormalize=bool(cfg.get("norm_topk_prob", False)),
            **routing_fields(cfg),
        )
