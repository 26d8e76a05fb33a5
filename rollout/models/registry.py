"""Architecture registry: config.json's architectures[0] -> model class; ModelInfo; load_model."""
from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from rollout.config.backends import QUANTIZATIONS
from rollout.config.model_dir import check_model_dir
from rollout.models.quant.method import check_quantization_config

# architectures[0] -> "module:Class" (imported lazily: the model modules import ModelInfo from here)
_ARCHITECTURES = {
    "Qwen3MoeForCausalLM": "rollout.models.arch.qwen3_moe:Qwen3MoeForCausalLM",
    "Qwen2MoeForCausalLM": "rollout.models.arch.qwen2_moe:Qwen2MoeForCausalLM",
    "MixtralForCausalLM": "rollout.models.arch.mixtral:MixtralForCausalLM",
    "OlmoeForCausalLM": "rollout.models.arch.olmoe:OlmoeForCausalLM",
    "DeepseekV3ForCausalLM": "rollout.models.arch.deepseek_v3:DeepseekV3ForCausalLM",
    "Glm4MoeForCausalLM": "rollout.models.arch.glm4_moe:Glm4MoeForCausalLM",
    "GptOssForCausalLM": "rollout.models.arch.gpt_oss:GptOssForCausalLM",
    "MiniMaxM2ForCausalLM": "rollout.models.arch.minimax_m2:MiniMaxM2ForCausalLM",
}


@dataclass(frozen=True, kw_only=True)
class ModelInfo:
    """What the rest of the engine needs to know about a model, read from its config."""

    architecture: str
    num_hidden_layers: int
    num_experts: int
    top_k: int
    moe_layer_ids: tuple[int, ...]   # layers with a router; the others are dense
    vocab_size: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]   # config.json's, then generation_config.json's extra ones
    kv_latent_dim: int = 0           # MLA: values per token and layer in the KV pool (0: GQA K/V)

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layer_ids)

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None


def supported_architectures() -> tuple[str, ...]:
    return tuple(_ARCHITECTURES)


def model_class(architecture: str) -> type:
    if architecture not in _ARCHITECTURES:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: "
                         f"{', '.join(_ARCHITECTURES)}")
    module, name = _ARCHITECTURES[architecture].split(":")
    return getattr(importlib.import_module(module), name)


def read_config(model_path: str | Path) -> tuple[dict, dict | None]:
    """(config.json, generation_config.json or None) of a checkpoint directory."""
    check_model_dir(str(model_path))
    path = Path(model_path)
    cfg_file = path / "config.json"
    cfg = json.loads(cfg_file.read_text())
    gen_file = path / "generation_config.json"
    gen = json.loads(gen_file.read_text()) if gen_file.is_file() else None
    return cfg, gen


def architecture_of(cfg: dict) -> str:
    archs = cfg.get("architectures") or []
    if not archs:
        raise ValueError(f"config.json has no 'architectures'; supported: {', '.join(_ARCHITECTURES)}")
    return archs[0]


def model_spec(cfg: dict, generation_config: dict | None):
    """The ModelSpec of a config.json: its architecture and weight format are supported, or ValueError."""

    cls = model_class(architecture_of(cfg))
    method = check_quantization_config(cfg)
    if method is not None and method.name not in cls.quantized_formats:
        raise ValueError(f"quantization_config.quant_method {method.name!r} is not supported for {cls.__name__} "
                         f"(its quantized formats: {', '.join(cls.quantized_formats) or 'none'})")
    return cls.spec_from_config(cfg, generation_config)


def model_info(model_path: str | Path):
    """ModelInfo from the config files alone (no weights read)."""
    return model_spec(*read_config(model_path)).info


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: torch.dtype | str, cfg: dict) -> torch.dtype:
    """torch dtype, its name, or "auto" (the checkpoint's dtype / torch_dtype, else float32)."""
    if dtype == "auto":
        dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    if isinstance(dtype, str):
        dtype = _DTYPES.get(dtype.removeprefix("torch."), dtype)
    if dtype not in _DTYPES.values():
        raise ValueError(f"dtype must be one of {', '.join(_DTYPES)} or 'auto', got {dtype!r}")
    return dtype


def quantize_skeleton(model, model_path: str | Path, cfg: dict, quantization: str | None) -> None:
    """Holds the unloaded (meta) model's weights in FP8 where the engine does: an FP8 checkpoint's
    modules with scales, or with quantization="fp8" every linear and expert weight of a float one."""
    from rollout.models.loader import checkpoint_names, fp8_modules  # noqa: PLC0415
    from rollout.models.quant import fp8  # noqa: PLC0415

    scheme = fp8.scheme_from_config(cfg)
    if scheme is not None:                           # an FP8 checkpoint: FP8 where it holds scales
        model.quantize_fp8(scheme, fp8_modules(model, checkpoint_names(model_path)))
    elif quantization == "fp8":
        model.quantize_fp8(fp8.ONLINE)


def load_model(model_path: str | Path, dtype: torch.dtype | str = "auto",
               device: str | torch.device = "cpu", expert_shard: tuple[int, int] | None = None,
               quantization: str | None = None, mtp: bool = False):
    """Build the model for model_path's architecture and load its safetensors weights.

    expert_shard: (rank, size) to hold and load only that rank's experts (expert parallel).
    quantization: "fp8" quantizes a float checkpoint's linear and expert weights as they load
    (quant/fp8.py); an FP8 checkpoint is held in FP8 without it. mtp: also load the checkpoint's
    first multi-token-prediction layer, as model.mtp (NEXTN drafts; models/mtp.py).
    Returns (model in eval mode, config.json as a dict).
    """
    from rollout.models.loader import load_checkpoint  # noqa: PLC0415
    from rollout.models.quant import fp8  # noqa: PLC0415

    if quantization not in (None, *QUANTIZATIONS):
        raise ValueError(f"quantization must be one of {QUANTIZATIONS} or None, got {quantization!r}")
    cfg, gen = read_config(model_path)
    dtype = resolve_dtype(dtype, cfg)
    cls = model_class(architecture_of(cfg))
    spec = model_spec(cfg, gen)
    scheme = fp8.scheme_from_config(cfg)
    if quantization == "fp8" and scheme is None and cfg.get("quantization_config") is not None:
        raise ValueError(f"quantization='fp8' needs a float checkpoint; {model_path} is already quantized "
                         f"({cfg['quantization_config'].get('quant_method')!r})")
    # NOTE: parameters are created on the meta device (no random init) and then materialised;
    # load_checkpoint overwrites every one of them or raises.
    with torch.device("meta"):
        model = cls(spec)
        if mtp:
            from rollout.models.loader import checkpoint_names  # noqa: PLC0415
            from rollout.models.mtp import attach_mtp  # noqa: PLC0415

            attach_mtp(model, cfg, checkpoint_names(model_path), str(model_path))
        model = model.to(dtype)
        quantize_skeleton(model, model_path, cfg, quantization)
        if expert_shard is not None:
            model.shard_experts(*expert_shard)
    model = model.to_empty(device=torch.device(device))
    load_checkpoint(model, model_path)
    model.requires_grad_(False).eval()
    return model, cfg
