"""OLMoE: q/k RMSNorm over the whole projection, optional clip_qkv, no renorm unless norm_topk_prob."""
from __future__ import annotations

from rollout.models.causal_lm import MoeCausalLM
from rollout.models.spec import ModelSpec, common_fields, require, routing_fields


class OlmoeForCausalLM(MoeCausalLM):
    @classmethod
    def spec_from_config(cls, cfg: dict, generation_config: dict | None = None) -> ModelSpec:
        common = common_fields(cfg, generation_config, default_eps=1e-5, default_max_pos=4096)
        clip = cfg.get("clip_qkv")
        return ModelSpec(
            **common,
            qkv_bias=bool(cfg.get("attention_bias", False)),
            o_bias=bool(cfg.get("attention_bias", False)),
            qk_norm="full",
            clip_qkv=float(clip) if clip is not None else None,
            moe_intermediate_size=int(require(cfg, "intermediate_size")),
            renormalize=bool(cfg.get("norm_topk_prob", False)),
            **routing_fields(cfg),
        )
