"""FP8 checkpoints made from a float one, as FP8 releases ship them (for tests): block scales
(`quant_method: "fp8"`, `weight_scale_inv`, DeepSeek-V3 / Qwen3-FP8) or per-channel scales
(compressed-tensors `float-quantized`, `weight_scale`, RedHat's releases). The quantizer here is
written out from the format's definition, apart from the engine's (rollout/models/quant/fp8.py)."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8_MAX = 448.0
# never quantized: embeddings, lm_head, norms (1-D), routers, Qwen2's [1, H] shared-expert gate
KEEP = (".gate.weight", "embed_tokens.weight", "lm_head.weight", "shared_expert_gate.weight")


def block_quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    out, inp = w.shape
    b0, b1 = block
    q = torch.empty(out, inp, dtype=torch.float8_e4m3fn)
    scale = torch.empty(math.ceil(out / b0), math.ceil(inp / b1), dtype=torch.float32)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            tile = w[i * b0:(i + 1) * b0, j * b1:(j + 1) * b1].float()
            s = tile.abs().max() / FP8_MAX
            s = s if s > 0 else torch.tensor(1.0)
            scale[i, j] = s
            q[i * b0:(i + 1) * b0, j * b1:(j + 1) * b1] = (tile / s).to(torch.float8_e4m3fn)
    return q, scale


def channel_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = w.float().abs().amax(dim=1, keepdim=True) / FP8_MAX
    s = torch.where(s > 0, s, torch.ones_like(s))
    return (w.float() / s).to(torch.float8_e4m3fn), s


def quantized(name: str, t: torch.Tensor) -> bool:
    return t.dim() == 2 and name.endswith(".weight") and not name.endswith(KEEP)


def make_fp8_checkpoint(src: Path, dst: Path, *, block: tuple[int, int] | None = (16, 16)) -> Path:
    """block: weight_block_size (quant_method "fp8"); None: compressed-tensors per-channel scales."""
    dst = Path(dst)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    tensors = {}
    for f in sorted(Path(src).glob("*.safetensors")):
        for name, t in load_file(str(f)).items():
            if not quantized(name, t):
                tensors[name] = t
                continue
            q, s = block_quantize(t, block) if block else channel_quantize(t)
            tensors[name] = q
            tensors[name + ("_scale_inv" if block else "_scale")] = s
    save_file(tensors, str(dst / "model.safetensors"))
    cfg = json.loads((dst / "config.json").read_text())
    if block:
        cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": list(block)}
    else:
        cfg["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"],
                                          "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                                                      "dynamic": False, "symmetric": True},
                                          "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                                                "dynamic": True, "symmetric": True}}},
            "ignore": ["lm_head", "re:.*mlp.gate$"]}
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def dequantized_state(path: Path) -> dict[str, torch.Tensor]:
    """The FP8 checkpoint's tensors with every FP8 weight turned back into fp32 by its scale."""
    raw = load_file(str(Path(path) / "model.safetensors"))
    qc = json.loads((Path(path) / "config.json").read_text())["quantization_config"]
    out = {}
    for name, t in raw.items():
        if name.endswith(("_scale_inv", "_scale")):
            continue
        if t.dtype == torch.float8_e4m3fn:
            if name + "_scale_inv" in raw:
                s = raw[name + "_scale_inv"]
                b0, b1 = qc["weight_block_size"]      # NOTE: the last block of a row / column may be partial
                s = s.repeat_interleave(b0, 0)[:t.shape[0]].repeat_interleave(b1, 1)[:, :t.shape[1]]
            else:
                s = raw[name + "_scale"]
            t = t.float() * s
        out[name] = t
    return out
