"""Mixtral: every layer MoE, softmax top-k always renormalised; block_sparse_moe / w1,w2,w3 names."""
from __future__ import annotations

from rollout.models.causal_lm import MoeCausalLM
from rollout.models.spec import ModelSpec, common_fields, require, routing_fields


class MixtralForCausalLM(MoeCausalLM):
    hf_renames = (
        (r"\.block_sparse_moe\.", ".mlp."),
        (r"(\.mlp\.experts\.\d+)\.w1\.", r"\1.gate_proj."),
        (r"(\.mlp\.experts\.\d+)\.w3\.", r"\1.up_proj."),
        (r"(\.mlp\.experts\.\d+)\.w2\.", r"\1.down_proj."),
    )

    @classmethod
    def spec_from_config(cls, cfg: dict, generation_config: dict | None = None) -> ModelSpec:
        common = common_fields(cfg, generation_config, default_theta=1e6, default_eps=1e-5,
                               default_max_pos=4096 * 32)
        window = cfg.get("sliding_window")
        n_layers = common["num_hidden_layers"]
        return ModelSpec(
            **common,
            sliding_windows=(int(window),) * n_layers if window else (),
            moe_intermediate_size=int(require(cfg, "intermediate_size")),
            renormalize=True,
            **routing_fields(cfg),
        )
