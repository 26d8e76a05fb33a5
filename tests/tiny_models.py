"""Tiny random HF MoE checkpoints (built from configs, never downloaded) for tests."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")   # softmax routers (tests/test_models.py)
GROUPED_ARCHS = ("deepseek_v3", "glm4_moe")               # sigmoid + correction bias (tests/test_deepseek_glm.py)
NEW_ARCHS = ("gpt_oss", "minimax_m2")                     # tests/test_gpt_oss_minimax.py

_COMMON = dict(vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
               pad_token_id=0, tie_word_embeddings=False)
_PER_ARCH = {
    # head_dim 32 != hidden/heads on purpose (real Qwen3-MoE does this too)
    "qwen3_moe": dict(head_dim=32, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                      num_experts_per_tok=2, norm_topk_prob=True),
    # layer 0 dense via mlp_only_layers; shared expert with sigmoid gate
    "qwen2_moe": dict(intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                      num_experts=8, num_experts_per_tok=2, mlp_only_layers=[0], norm_topk_prob=False),
    "mixtral": dict(intermediate_size=32, num_local_experts=8, num_experts_per_tok=2),
    "olmoe": dict(intermediate_size=32, num_experts=8, num_experts_per_tok=2, clip_qkv=2.5,
                  norm_topk_prob=False),
    # MLA (q_lora, YaRN with mscale), 16 experts in 4 groups of which 2 are eligible, layer 0 dense
    "deepseek_v3": dict(intermediate_size=96, moe_intermediate_size=32, n_routed_experts=16, num_experts_per_tok=4,
                        n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1,
                        routed_scaling_factor=2.5, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16,
                        qk_rope_head_dim=8, v_head_dim=16, num_key_value_heads=4,
                        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                                      "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}),
    # GQA with partial rotary, per-head q/k norm, q/k/v bias, 16 experts in 4 groups (2 eligible)
    "glm4_moe": dict(head_dim=32, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=16,
                     num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1,
                     routed_scaling_factor=1.5, partial_rotary_factor=0.5, use_qk_norm=True, attention_bias=True),
    # sinks, sliding window 8 on even layers, q/k/v/o biases, YaRN (truncate false), biased router
    # (top-k then softmax), experts with biases and the clamped SwiGLU; sizes multiples of 32 (MXFP4)
    "gpt_oss": dict(head_dim=16, intermediate_size=64, num_local_experts=8, num_experts_per_tok=2, sliding_window=8,
                    max_position_embeddings=256, attention_bias=True, swiglu_limit=7.0,
                    rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                     "truncate": False, "original_max_position_embeddings": 64,
                                     "rope_theta": 150000.0}),
    # q/k norm over the whole projection, partial rotary (the released configs' rotary_dim), sigmoid
    # routing with a correction bias and no groups
    "minimax_m2": dict(head_dim=16, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, rotary_dim=8),
}


def tiny_config(arch: str, **overrides):
    from transformers import (DeepseekV3Config, Glm4MoeConfig, GptOssConfig, MiniMaxM2Config, MixtralConfig,
                              OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig)

    classes = {"qwen3_moe": Qwen3MoeConfig, "qwen2_moe": Qwen2MoeConfig,
               "mixtral": MixtralConfig, "olmoe": OlmoeConfig,
               "deepseek_v3": DeepseekV3Config, "glm4_moe": Glm4MoeConfig,
               "gpt_oss": GptOssConfig, "minimax_m2": MiniMaxM2Config}
    if arch not in classes:
        raise ValueError(f"unknown tiny arch {arch!r}; choose from {ARCHS + GROUPED_ARCHS + NEW_ARCHS}")
    return classes[arch](**{**_COMMON, **_PER_ARCH[arch], **overrides})


def make_tiny_checkpoint(arch: str, path: str | Path, seed: int = 0, std: float = 0.15,
                         max_shard_size: str | None = None, bias_std: float = 0.1, dtype: str = "float32",
                         **overrides) -> Path:
    """Save a tiny random `arch` model with save_pretrained (safetensors) + generation_config.

    Every parameter is redrawn (norm weights around 1, biases small) so that routing, norms and
    biases are all exercised; config fields can be overridden, e.g. tie_word_embeddings=True.
    """
    from transformers import AutoModelForCausalLM, GenerationConfig

    path = Path(path)
    cfg = tiny_config(arch, **overrides)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith(".bias"):
                p.copy_(0.1 * noise)
            else:
                p.copy_(std * noise)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):   # nonzero: it changes some tokens' choice
                b.copy_(bias_std * torch.randn(b.shape, generator=gen))
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=[2, 3], pad_token_id=0)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    if dtype != "float32":    # the same draw, rounded (a BF16 release of the same weights)
        model = model.to(getattr(torch, dtype))
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    return path


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """tiny_checkpoint(arch, **overrides) -> path; each distinct checkpoint is built once per session."""
    cache: dict[str, Path] = {}

    def get(arch: str, **overrides) -> Path:
        key = f"{arch}:{sorted(overrides.items())!r}"
        if key not in cache:
            cache[key] = make_tiny_checkpoint(arch, tmp_path_factory.mktemp(f"tiny_{arch}"), **overrides)
        return cache[key]

    return get


def truncated_checkpoint(src: str | Path, dst: str | Path, num_layers: int) -> Path:
    """src's first num_layers decoder layers with its embeddings, final norm and head: a smaller
    draft of the same family whose guesses agree with src's often (self-speculative drafts)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    model.model.layers = model.model.layers[:num_layers]
    model.config.num_hidden_layers = num_layers
    model.save_pretrained(dst, safe_serialization=True)
    return Path(dst)


def with_mtp_layer(src: str | Path, dst: str | Path, seed: int = 1, echo: bool = False) -> Path:
    """A copy of src (DeepSeek-V3 / GLM-4.5) with one multi-token-prediction layer, laid out as the
    released checkpoints lay it out: model.layers.{N}.{enorm, hnorm, eh_proj, shared_head.norm,
    shared_head.head, embed_tokens} and a decoder layer of transformers' own class (N =
    num_hidden_layers), in a file of its own, and num_nextn_predict_layers 1 in config.json.
    echo: an MTP layer whose output is the embedding of its input token (attention and MLP outputs
    zero, eh_proj passes enorm(embed(t_{i+1})) through): on a target whose layers add little to the
    embeddings (damped_checkpoint) it predicts what the target predicts after t_{i+1}, so drafts hold."""
    import json
    import shutil

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    src, dst = Path(src), Path(dst)
    shutil.copytree(src, dst)
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    cfg = model.config
    n, h = cfg.num_hidden_layers, cfg.hidden_size
    layer = type(model.model.layers[-1])(cfg, n)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.2 * noise if "norm" in name else 0.1 * noise if name.endswith(".bias") else 0.15 * noise)
            if echo and ("o_proj" in name or "down_proj" in name):
                p.zero_()
        for name, b in layer.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))
    tensors = {f"model.layers.{n}.{k}": v.contiguous() for k, v in layer.state_dict().items()}
    eh = torch.cat((torch.eye(h), torch.zeros(h, h)), dim=1) if echo else 0.15 * torch.randn(h, 2 * h, generator=gen)
    norms = (lambda: torch.ones(h)) if echo else (lambda: 1.0 + 0.2 * torch.randn(h, generator=gen))
    head_norm = model.model.norm.weight.detach().clone() if echo else norms()
    tensors.update({f"model.layers.{n}.enorm.weight": norms(), f"model.layers.{n}.hnorm.weight": norms(),
                    f"model.layers.{n}.eh_proj.weight": eh, f"model.layers.{n}.shared_head.norm.weight": head_norm,
                    f"model.layers.{n}.shared_head.head.weight": model.lm_head.weight.detach().clone(),
                    f"model.layers.{n}.embed_tokens.weight": model.model.embed_tokens.weight.detach().clone()})
    save_file(tensors, str(dst / "mtp.safetensors"))
    raw = json.loads((dst / "config.json").read_text())
    raw["num_nextn_predict_layers"] = 1
    (dst / "config.json").write_text(json.dumps(raw, indent=2))
    return dst


def damped_checkpoint(src: str | Path, dst: str | Path, factor: float) -> Path:
    """A copy of src whose attention and MLP outputs (o_proj, down_proj weights) are scaled by
    factor: its hidden states stay close to the token embeddings (its routers still route them)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    for f in Path(dst).glob("*.safetensors"):
        tensors = load_file(str(f))
        save_file({k: v * factor if ("o_proj" in k or "down_proj" in k) else v for k, v in tensors.items()},
                  str(f), metadata={"format": "pt"})
    return Path(dst)


def random_prompts(seed: int, lengths, vocab: int = 256) -> list[list[int]]:
    """Seeded random prompts (ids 3.. vocab-1, clear of the tiny models' special ids) of the given lengths."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


# NOTE: engine settings (JSON) every make_engine adds under a test's own: `bash scripts/test.sh
# --overlap` runs the engine, capture, DP and deterministic test files with the overlap schedule and
# torch.compile on
SUITE_ENGINE_KW = "ROLLOUT_TEST_ENGINE_KW"


def _with_suite_kw(kw: dict) -> dict:
    """kw under the suite's settings. The suite's enable_torch_compile applies where the test's
    engine can compile (refused by name otherwise): not with deterministic inference, or with
    decode buckets of the test's own that are all above torch_compile_max_bs."""
    import json
    import os

    suite = json.loads(os.environ.get(SUITE_ENGINE_KW, "{}"))
    if suite.get("enable_torch_compile") and "enable_torch_compile" not in kw:
        max_bs = kw.get("torch_compile_max_bs", suite.get("torch_compile_max_bs", 32))
        own = kw.get("decode_graph_batch_sizes")
        if kw.get("enable_deterministic_inference") or (own and min(own) > max_bs):
            suite = {k: v for k, v in suite.items() if k not in ("enable_torch_compile", "torch_compile_max_bs")}
    return {**suite, **kw}


def make_engine(path, *, capture: bool = True, **kw):
    """A Rollout on a tiny checkpoint in fp32 with the embedded tokenizer (tiny checkpoints have none)."""
    from rollout import Rollout
    from rollout.config import DEFAULT_MODEL_PATH

    kw = _with_suite_kw(kw)
    kw.setdefault("dtype", "float32")
    kw.setdefault("tokenizer_path", DEFAULT_MODEL_PATH)
    if capture:
        kw["enable_return_routed_experts"] = True
    return Rollout(str(path), **kw)


def prefill_decode_logits(model, seq: list[int]) -> torch.Tensor:
    """All logits of seq run as two prefill chunks then three paged decode steps over a KV pool."""
    from attention_cases import slot_table
    from rollout.batch.forward_batch import ForwardBatch
    from rollout.batch.kv_pool import KVPool

    info = model.info
    device = model.model.embed_tokens.weight.device
    pool = KVPool(num_slots=96, num_layers=info.num_hidden_layers, num_kv_heads=info.num_kv_heads,
                  head_dim=info.head_dim, dtype=torch.float32, latent_dim=info.kv_latent_dim, device=device)
    slots = pool.alloc(len(seq))
    n = len(seq)
    cuts = (0, 9, n - 3, n - 2, n - 1, n)
    got = []
    for lo, hi in zip(cuts, cuts[1:]):
        fb = ForwardBatch.build(input_ids=seq[lo:hi], out_cache_loc=slots[lo:hi].to(device), prefix_lens=[lo],
                                extend_lens=[hi - lo], kv_indices=slot_table([slots[:hi]]).to(device), kv_pool=pool,
                                device=device)
        got.append(model(fb, return_all_logits=True))
    return torch.cat(got)
