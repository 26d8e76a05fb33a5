"""Tiny gpt-oss checkpoints for tests: a float one (save_pretrained) and its MXFP4 form, the way
openai/gpt-oss-* ship (expert weights as `_blocks`/`_scales` uint8, everything else unquantized)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from rollout.models.quant.mxfp4 import MXFP4_SUFFIXES, quantize_mxfp4

# as in openai/gpt-oss-20b's config.json
GPT_OSS_MODULES_TO_NOT_CONVERT = ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                  "model.embed_tokens", "lm_head"]
_EXPERT_WEIGHTS = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")

# hidden/intermediate multiples of 32 (MXFP4 groups run along both), 4 experts, top-2, 2 layers
# (sliding then full attention)
TINY_GPT_OSS = dict(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                    num_experts_per_tok=2, max_position_embeddings=512, sliding_window=8,
                    bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)


def make_float_gpt_oss_checkpoint(path: str | Path, seed: int = 0, std: float = 0.15, **overrides) -> Path:
    """A tiny random GptOssForCausalLM in float32 saved with save_pretrained (+ generation_config);
    every parameter redrawn (norms around 1, biases and sinks small) so all of them matter."""
    from transformers import AutoModelForCausalLM, GenerationConfig, GptOssConfig

    path = Path(path)
    model = AutoModelForCausalLM.from_config(GptOssConfig(**{**TINY_GPT_OSS, **overrides}), dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith(("bias", "sinks")):
                p.copy_(0.1 * noise)
            else:
                p.copy_(std * noise)
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=[2, 3], pad_token_id=0)
    model.save_pretrained(path, safe_serialization=True)
    return path


def _quantized_tensors(name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
    if not name.endswith(_EXPERT_WEIGHTS):
        return {name: t}
    # in memory [E, in, out]; the checkpoint quantizes [E, out, in] along `in`
    blocks, scales = quantize_mxfp4(t.transpose(1, 2))        # [E, out, in/32, 16], [E, out, in/32]
    return {name + MXFP4_SUFFIXES[0]: blocks, name + MXFP4_SUFFIXES[1]: scales}


def make_mxfp4_checkpoint(src: str | Path, dst: str | Path) -> Path:
    """Write the float gpt-oss checkpoint `src` to `dst` in gpt-oss's shipped MXFP4 form.

    Expert `gate_up_proj` [E, H, 2I] / `down_proj` [E, I, H] become `*_blocks` [E, out, in/32, 16]
    and `*_scales` [E, out, in/32] (uint8); every other tensor, shard file name and non-weight file
    is kept; config.json gains gpt-oss's `quantization_config`.
    """
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    shards = sorted(src.glob("*.safetensors"))
    if not shards:
        raise ValueError(f"no *.safetensors in {src}")
    weight_map: dict[str, str] = {}
    for shard in shards:
        out: dict[str, torch.Tensor] = {}
        with safe_open(str(shard), framework="pt") as f:
            metadata = f.metadata()
            for name in f.keys():
                out.update(_quantized_tensors(name, f.get_tensor(name)))
        save_file({k: v.contiguous() for k, v in out.items()}, str(dst / shard.name), metadata=metadata)
        weight_map.update({k: shard.name for k in out})
    for item in src.iterdir():
        if item.suffix == ".safetensors" or item.name in ("config.json", "model.safetensors.index.json"):
            continue
        if item.is_file():
            shutil.copy2(item, dst / item.name)
    index = src / "model.safetensors.index.json"
    if index.exists():
        idx = json.loads(index.read_text())
        idx["weight_map"] = dict(sorted(weight_map.items()))
        (dst / index.name).write_text(json.dumps(idx, indent=2))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4",
                                  "modules_to_not_convert": list(GPT_OSS_MODULES_TO_NOT_CONVERT)}
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst
