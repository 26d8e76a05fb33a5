"""MiniMax-M2: GQA with RMSNorm over the whole q and k projections (before the head split),
partial rotary (the checkpoint's `rotary_dim`), every layer MoE with sigmoid routing and an
`e_score_correction_bias` for the choice only (no groups, the k weights renormalised).

Checkpoints name the MoE block `block_sparse_moe` with per-expert w1 / w3 / w2 (as Mixtral) and
keep the correction bias on the block; transformers' in-memory names (`mlp.*`, fused experts)
load too.
"""
from __future__ import annotations

from rollout.models.arch.mixtral import MixtralForCausalLM
from rollout.models.causal_lm import MoeCausalLM
from rollout.models.rope_scaling import rope_parameters
from rollout.models.spec import ModelSpec, common_fields, require, routing_fields


class MiniMaxM2ForCausalLM(MoeCausalLM):
    hf_renames = MixtralForCausalLM.hf_renames + (
        (r"\.mlp\.e_score_correction_bias$", ".mlp.gate.e_score_correction_bias"),
    )

    @classmethod
    def spec_from_config(cls, cfg: dict, generation_config: dict | None = None) -> ModelSpec:
        common = common_fields(cfg, generation_config, default_theta=5e6, default_eps=1e-6,
                               default_max_pos=196608)
        scoring = cfg.get("scoring_func", "sigmoid")
        if scoring != "sigmoid":
            raise ValueError(f"scoring_func {scoring!r} is not supported for MiniMax-M2 (only 'sigmoid')")
        if cfg.get("use_routing_bias") is False:
            raise ValueError("use_routing_bias false is not supported for MiniMax-M2 (its router has a correction bias)")
        theta, partial, _ = rope_parameters(cfg, default_theta=5e6)
        if cfg.get("rotary_dim") and not (cfg.get("rope_parameters") or {}).get("partial_rotary_factor"):
            partial = int(cfg["rotary_dim"]) / common["head_dim"]     # NOTE: released configs' legacy key
        common.update(rope_theta=theta)
        return ModelSpec(
            **common,
            qk_norm="full",
            partial_rotary_factor=partial,
            moe_intermediate_size=int(require(cfg, "intermediate_size")),
            renormalize=True,
            scoring="sigmoid",
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0) or 1.0),
            **routing_fields(cfg),
        )
