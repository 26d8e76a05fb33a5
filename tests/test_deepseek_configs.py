"""DeepSeek-V3 / Kimi-K2 / GLM-4.5 configs: published config.json fields, presets and --show sizes."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from rollout.batch.kv_pool import KVPool
from rollout.models import load_model


# ---- config parsing ----------------------------------------------------------------------------

_DS_V3 = dict(architectures=["DeepseekV3ForCausalLM"], vocab_size=129280, hidden_size=7168, intermediate_size=18432,
              moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128,
              n_shared_experts=1, n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536,
              qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, topk_method="noaux_tc", n_group=8,
              topk_group=4, num_experts_per_tok=8, moe_layer_freq=1, first_k_dense_replace=3, norm_topk_prob=True,
              scoring_func="sigmoid", hidden_act="silu", max_position_embeddings=163840, rms_norm_eps=1e-6,
              tie_word_embeddings=False, rope_theta=10000, num_nextn_predict_layers=1, eos_token_id=1,
              rope_scaling={"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                            "original_max_position_embeddings": 4096, "type": "yarn"})


def test_published_config_shapes():
    """DeepSeek-V3's, Kimi-K2's and GLM-4.5-Air's config.json fields (old-style rope_scaling,
    top-level partial_rotary_factor) parse to the shapes the presets size."""
    from rollout.models import model_class

    ds = model_class("DeepseekV3ForCausalLM").spec_from_config(_DS_V3)
    assert ds.info.kv_latent_dim == 576 and ds.info.moe_layer_ids == tuple(range(3, 61))
    assert (ds.n_group, ds.topk_group, ds.routed_scaling_factor, ds.shared_experts_intermediate_size) == (8, 4, 2.5, 2048)
    assert ds.skipped_checkpoint_layers == (61,) and ds.rotary_dim == 64 and ds.mla.q_lora_rank == 1536
    mscale = 0.1 * math.log(40) + 1
    assert ds.rope_scaling.attention_factor == 1.0
    assert ds.mla.softmax_scale == pytest.approx(192 ** -0.5 * mscale ** 2)
    kimi = model_class("DeepseekV3ForCausalLM").spec_from_config(
        dict(_DS_V3, n_routed_experts=384, n_group=1, topk_group=1, first_k_dense_replace=1, num_attention_heads=64,
             num_key_value_heads=64, routed_scaling_factor=2.827, rope_scaling={
                 "type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 1.0,
                 "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}, max_position_embeddings=131072))
    assert kimi.num_experts == 384 and kimi.info.moe_layer_ids == tuple(range(1, 61))
    glm = model_class("Glm4MoeForCausalLM").spec_from_config(dict(
        architectures=["Glm4MoeForCausalLM"], vocab_size=151552, hidden_size=4096, intermediate_size=10944,
        moe_intermediate_size=1408, num_hidden_layers=46, num_attention_heads=96, num_key_value_heads=8, head_dim=128,
        partial_rotary_factor=0.5, rope_theta=1000000, attention_bias=True, use_qk_norm=False, n_routed_experts=128,
        n_shared_experts=1, num_experts_per_tok=8, n_group=1, topk_group=1, first_k_dense_replace=1,
        norm_topk_prob=True, routed_scaling_factor=1.0, num_nextn_predict_layers=1, max_position_embeddings=131072,
        rms_norm_eps=1e-5, hidden_act="silu", tie_word_embeddings=False, eos_token_id=[151329, 151336, 151338]))
    assert glm.rotary_dim == 64 and glm.qk_norm == "none" and glm.qkv_bias and not glm.o_bias
    assert glm.info.kv_latent_dim == 0 and glm.info.moe_layer_ids == tuple(range(1, 46))
    assert glm.skipped_checkpoint_layers == (46,)
    for bad, match in (({"scoring_func": "softmax"}, "scoring_func 'softmax'"),
                       ({"topk_method": "greedy"}, "topk_method 'greedy'"),
                       ({"n_group": 3}, "n_group=3 must divide n_routed_experts=256"),
                       ({"topk_group": 1, "num_experts_per_tok": 40}, "num_experts_per_tok=40 must be <= topk_group"),
                       ({"rope_scaling": {"type": "dynamic", "factor": 2}}, "rope type 'dynamic'")):
        with pytest.raises(ValueError, match=match):
            model_class("DeepseekV3ForCausalLM").spec_from_config(dict(_DS_V3, **bad))


# ---- presets -----------------------------------------------------------------------------------

def test_presets_size_mla_kv_and_wide_expert_ids(tiny_checkpoint):
    """--show sizes: MLA KV per token from kv_lora_rank + qk_rope_head_dim (preset or config.json,
    the same bytes the engine's pool allocates), int16 host store past 255 experts (Kimi-K2)."""
    from rollout.config.config_file import ModelShape, implied_sizes, load_engine_config_file

    root = Path(__file__).resolve().parent.parent / "configs" / "engine"
    ds, kimi, glm = (implied_sizes(load_engine_config_file(str(root / f"{n}.yaml")))
                     for n in ("deepseek-v3", "kimi-k2", "glm-4.5-air"))
    assert ds["kv_layout"] == kimi["kv_layout"] == "mla" and glm["kv_layout"] == "gqa"
    assert ds["kv_bytes_per_token"] == kimi["kv_bytes_per_token"] == (512 + 64) * 61 * 2
    assert glm["kv_bytes_per_token"] == 2 * 8 * 128 * 46 * 2
    assert (ds["num_moe_layers"], kimi["num_moe_layers"], glm["num_moe_layers"]) == (58, 60, 45)
    assert kimi["host_store_dtype"] == "int16" and kimi["host_store_bytes_per_slot"] == 61 * 8 * 2
    assert glm["host_store_dtype"] == "uint8" and glm["host_store_bytes_per_slot"] == 46 * 8
    assert kimi["capture_buffer_rows"] == 32 * 4096 and kimi["capture_buffer_fits_cap"]
    path = tiny_checkpoint("deepseek_v3")
    shape = ModelShape.from_dict(json.loads((path / "config.json").read_text()), "config.json")
    model, _ = load_model(path, torch.float32)
    info = model.info
    assert shape.num_hidden_layers * shape.kv_values_per_token_layer * 4 == KVPool.bytes_per_slot(
        num_layers=info.num_hidden_layers, num_kv_heads=info.num_kv_heads, head_dim=info.head_dim,
        dtype=torch.float32, latent_dim=info.kv_latent_dim)

