"""Engine config files: YAML presets (configs/engine/*.yaml) -> EngineConfig, and the sizes they imply.

A file has two top-level sections (anything else is rejected, naming the key):

    engine:        # EngineConfig fields, by name (rollout/config/engine_config.py); omitted fields keep their defaults
      model_path: ../tiny-moe          # relative paths are resolved against the YAML file's directory
      dp_size: 1
      ...
    model_shape:   # optional: the model's shape, used by `--show` instead of <model_path>/config.json
      num_hidden_layers: 48            # (so a preset can be sized on a machine without the checkpoint)
      ...

`python -m rollout.config --show configs/engine/<name>.yaml` (rollout/config/__main__.py) prints the
capture device-buffer rows and bytes, the host store bytes per KV slot and in total that the config implies.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any, Optional

import yaml

from capture.buffer_sizing import capture_buffer_rows
from capture.routing_shape import expert_count, moe_layer_ids
from rollout.config.engine_cli import engine_flags
from rollout.config.engine_config import DEFAULT_KV_CACHE_BYTES, EngineConfig

TOP_LEVEL_KEYS = ("engine", "model_shape")
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_PATH_FIELDS = ("model_path", "tokenizer_path", "profile_graph_capture_dir")


class ConfigFileError(ValueError):
    """A config file problem; the message names the file and the key."""


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """What sizing needs from a model: layers, experts, top-k, which layers are MoE, KV per token.

    KV per token: MLA models (kv_lora_rank set) cache kv_lora_rank + qk_rope_head_dim values per
    layer; the others 2 x num_key_value_heads x head_dim; kv_bytes_per_token overrides both."""

    num_hidden_layers: int
    num_experts: int
    num_experts_per_tok: int
    moe_layer_ids: tuple[int, ...]
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    kv_bytes_per_token: Optional[int] = None   # overrides the KV size computed from the fields
    kv_lora_rank: Optional[int] = None         # MLA (DeepSeek-V3 family)
    qk_rope_head_dim: Optional[int] = None

    FIELDS = ("num_hidden_layers", "num_experts", "num_experts_per_tok", "num_key_value_heads", "head_dim",
              "max_position_embeddings", "first_k_dense_replace", "mlp_only_layers", "decoder_sparse_step",
              "moe_layer_ids", "kv_bytes_per_token", "kv_lora_rank", "qk_rope_head_dim")

    @property
    def kv_values_per_token_layer(self) -> int:
        if self.kv_lora_rank is not None:
            return self.kv_lora_rank + (self.qk_rope_head_dim or 0)
        return 2 * self.num_key_value_heads * self.head_dim

    @classmethod
    def from_dict(cls, d: dict, where: str) -> "ModelShape":
        """d: a `model_shape` section or an HF config.json (Qwen/Mixtral/OLMoE/DeepSeek key names)."""
        def get(*names: str, default: Any = None, required: bool = True) -> Any:
            for n in names:
                if d.get(n) is not None:
                    return d[n]
            if required and default is None:
                raise ConfigFileError(f"{where}: missing key {names[0]!r}")
            return default

        layers = get("num_hidden_layers")
        try:
            experts = expert_count(d)
        except ValueError as exc:
            raise ConfigFileError(f"{where}: {exc}") from None
        heads = get("num_attention_heads", required=False)
        mla = d.get("kv_lora_rank") is not None
        head_dim = get("head_dim", required=False) or (
            get("hidden_size") // heads if heads else None) or (
            d["kv_lora_rank"] + (d.get("qk_rope_head_dim") or 0) if mla else None)
        if head_dim is None:
            raise ConfigFileError(f"{where}: missing key 'head_dim'")
        if d.get("moe_layer_ids") is not None:
            moe = tuple(d["moe_layer_ids"])
        else:
            try:
                moe = moe_layer_ids(d, layers, experts) if isinstance(layers, int) and isinstance(experts, int) else ()
            except ValueError as exc:
                raise ConfigFileError(f"{where}: {exc}") from None
        shape = cls(num_hidden_layers=layers, num_experts=experts, num_experts_per_tok=get("num_experts_per_tok"),
                    moe_layer_ids=moe, num_key_value_heads=get("num_key_value_heads", "num_attention_heads",
                                                                default=1 if mla else None),
                    head_dim=head_dim, max_position_embeddings=get("max_position_embeddings", default=2048),
                    kv_bytes_per_token=d.get("kv_bytes_per_token"), kv_lora_rank=d.get("kv_lora_rank"),
                    qk_rope_head_dim=d.get("qk_rope_head_dim") if d.get("kv_lora_rank") is not None else None)
        for f in dataclasses.fields(shape):
            value = getattr(shape, f.name)
            if f.name == "moe_layer_ids":
                if any(isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < layers for v in value):
                    raise ConfigFileError(f"{where}: moe_layer_ids must be layer indices in [0, {layers}), "
                                          f"got {list(value)}")
            elif value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigFileError(f"{where}: {f.name} must be an integer >= 1, got {value!r}")
        return shape


@dataclass(frozen=True)
class EngineConfigFile:
    path: str
    config: EngineConfig
    model_shape: Optional[ModelShape]   # the file's model_shape section, if any


def _fail(path: str, key: str, msg: str) -> ConfigFileError:
    return ConfigFileError(f"{path}: {key}: {msg}")


def load_engine_config_file(path: str, overrides: Optional[dict] = None) -> EngineConfigFile:
    """Reads and validates a YAML engine config; overrides (EngineConfig field -> value) win."""
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except OSError as exc:
        raise ConfigFileError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigFileError(f"{path}: not valid YAML: {exc}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigFileError(f"{path}: the top level must be a mapping with keys {list(TOP_LEVEL_KEYS)}, "
                              f"got {type(data).__name__}")
    for key in data:
        if key not in TOP_LEVEL_KEYS:
            raise _fail(path, str(key), f"unknown top-level key (allowed: {', '.join(TOP_LEVEL_KEYS)})")
    engine = data.get("engine") or {}
    if not isinstance(engine, dict):
        raise _fail(path, "engine", f"must be a mapping of EngineConfig fields, got {type(engine).__name__}")
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    engine = dict(engine)
    engine.update(overrides or {})
    for key in engine:
        if key not in fields:
            raise _fail(path, f"engine.{key}", f"unknown key (EngineConfig fields: {', '.join(sorted(fields))})")
    base = os.path.dirname(os.path.abspath(path))
    for key in _PATH_FIELDS:
        value = engine.get(key)
        if isinstance(value, str) and value and not os.path.isabs(value):
            engine[key] = os.path.normpath(os.path.join(base, os.path.expanduser(value)))
    try:
        config = EngineConfig(**engine)
    except (ValueError, TypeError) as exc:
        msg = str(exc)
        key = next((k for k in sorted(engine, key=len, reverse=True) if msg.startswith(k)), None)
        raise ConfigFileError(f"{path}: engine.{key}: {msg}" if key else f"{path}: engine: {msg}") from None
    shape_section = data.get("model_shape")
    shape = None
    if shape_section is not None:
        if not isinstance(shape_section, dict):
            raise _fail(path, "model_shape", "must be a mapping")
        for key in shape_section:
            if key not in ModelShape.FIELDS:
                raise _fail(path, f"model_shape.{key}", f"unknown key (allowed: {', '.join(ModelShape.FIELDS)})")
        shape = ModelShape.from_dict(shape_section, f"{path}: model_shape")
    return EngineConfigFile(path=path, config=config, model_shape=shape)


def load_engine_config(path: str, **overrides: Any) -> EngineConfig:
    return load_engine_config_file(path, overrides).config


def model_shape_for(cf: EngineConfigFile) -> ModelShape:
    if cf.model_shape is not None:
        return cf.model_shape
    hf = os.path.join(cf.config.model_path, "config.json")
    if not os.path.exists(hf):
        raise ConfigFileError(f"{cf.path}: model_shape: no model_shape section and no {hf} to read the "
                              f"model's shape from")
    with open(hf) as f:
        return ModelShape.from_dict(json.load(f), hf)


def implied_sizes(cf: EngineConfigFile) -> dict[str, Any]:
    """The capture and host-store sizes a config implies, per DP rank and in total (invariant 1's
    capture_buffer_rows on the same ForwardShapeLimits EngineCore builds)."""
    cfg, shape = cf.config, model_shape_for(cf)
    context = cfg.context_length or shape.max_position_embeddings
    limits = cfg.shape_limits(context)
    rows = capture_buffer_rows(limits)
    from capture.codec import narrowest_dtype
    import torch
    store_dtype = narrowest_dtype(shape.num_experts)
    store_item = torch.empty((), dtype=store_dtype).element_size()
    kv_dtype = "float32" if cfg.dtype == "auto" else cfg.dtype
    kv_per_token = shape.kv_bytes_per_token or (
        shape.num_hidden_layers * shape.kv_values_per_token_layer * _DTYPE_BYTES[kv_dtype])
    if cfg.max_total_tokens is None and cfg.mem_fraction_static is not None:
        raise ConfigFileError(f"{cf.path}: engine.mem_fraction_static: the KV cache it gives depends on the memory "
                              f"free when the engine starts; give engine.max_total_tokens to size it here")
    kv_slots = cfg.max_total_tokens or max(2, (cfg.kv_cache_bytes or DEFAULT_KV_CACHE_BYTES) // kv_per_token)
    per_slot = shape.num_hidden_layers * shape.num_experts_per_tok * store_item
    device_bytes = rows * shape.num_hidden_layers * shape.num_experts_per_tok * 4
    host_bytes = (kv_slots + 1) * per_slot   # EngineCore allocates one spare slot
    return {
        "config": cf.path, "model_path": cfg.model_path, "dp_size": cfg.dp_size,
        "enable_return_routed_experts": cfg.enable_return_routed_experts,
        "num_hidden_layers": shape.num_hidden_layers, "num_moe_layers": len(shape.moe_layer_ids),
        "num_experts": shape.num_experts, "top_k": shape.num_experts_per_tok,
        "max_tokens_per_rank": limits.max_tokens_per_rank,
        "capture_buffer_rows": rows,
        "capture_buffer_bytes_per_rank": device_bytes,
        "capture_buffer_fits_cap": cfg.max_capture_buffer_rows is None or rows <= cfg.max_capture_buffer_rows,
        "host_store_dtype": str(store_dtype).removeprefix("torch."),
        "host_store_bytes_per_slot": per_slot,
        "kv_layout": "mla" if shape.kv_lora_rank is not None else "gqa",
        "kv_bytes_per_token": kv_per_token,
        "kv_slots_per_rank": kv_slots,
        "host_store_bytes_per_rank": host_bytes,
        "host_store_bytes_total": host_bytes * cfg.dp_size,
        "capture_buffer_bytes_total": device_bytes * cfg.dp_size,
    }


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def format_sizes(s: dict[str, Any]) -> str:
    lines = [
        f"config                     {s['config']}",
        f"model                      {s['model_path']}  ({s['num_hidden_layers']} layers, {s['num_moe_layers']} MoE, "
        f"{s['num_experts']} experts, top-{s['top_k']})",
        f"dp_size                    {s['dp_size']}   (routed-expert capture "
        f"{'on' if s['enable_return_routed_experts'] else 'off: the sizes below apply when it is turned on'})",
        f"max tokens per rank        {s['max_tokens_per_rank']}",
        f"capture buffer rows        {s['capture_buffer_rows']}   (dp_size x max tokens per rank)"
        + ("" if s["capture_buffer_fits_cap"] else "   EXCEEDS max_capture_buffer_rows"),
        f"capture buffer bytes       {s['capture_buffer_bytes_per_rank']} ({_human(s['capture_buffer_bytes_per_rank'])}) "
        f"per rank, int32; {_human(s['capture_buffer_bytes_total'])} over {s['dp_size']} rank(s)",
        f"host store bytes per slot  {s['host_store_bytes_per_slot']}   ({s['host_store_dtype']})",
        f"KV bytes per token         {s['kv_bytes_per_token']}   ({s['kv_layout']}, all layers)",
        f"host store KV slots        {s['kv_slots_per_rank']} per rank",
        f"host store bytes           {s['host_store_bytes_per_rank']} ({_human(s['host_store_bytes_per_rank'])}) "
        f"per rank; {s['host_store_bytes_total']} ({_human(s['host_store_bytes_total'])}) total",
    ]
    return "\n".join(lines)


def serve_flags(cfg: EngineConfig) -> list[str]:
    """The `rollout-serve` flags that reproduce cfg (every field that differs from the default)."""
    try:
        return engine_flags(cfg)
    except ValueError as exc:
        raise ConfigFileError(f"engine.{exc}") from None
