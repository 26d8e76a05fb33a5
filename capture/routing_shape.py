"""RoutingShape: which layers of a model route tokens to experts, how many experts and how many
per token, read from an HF config.json. The one place that knows the config keys of every
supported family; the engine's model specs, the config file's sizing and the trainer's client
all read it (the routing rows' shape is [tokens, num_hidden_layers, top_k], -1 on dense layers).

Keys, by family:
- expert count: `num_experts` (Qwen2/Qwen3-MoE, OLMoE), `num_local_experts` (Mixtral, gpt-oss,
  MiniMax-M2; HF 5.x also writes Qwen3-MoE's count so), `n_routed_experts` (DeepSeek-V3, GLM-4.5);
- dense layers: `mlp_only_layers` and `decoder_sparse_step` (Qwen), `first_k_dense_replace`
  (DeepSeek-V3, GLM-4.5); every other layer is MoE (a model with 0 experts has none);
- a multimodal config's `text_config` holds the decoder's keys.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


@dataclass(frozen=True, kw_only=True)
class RoutingShape:
    num_hidden_layers: int
    num_experts: int
    top_k: int
    moe_layer_ids: tuple[int, ...]   # layers with a router; the others are dense


def text_config(cfg: Mapping) -> Mapping:
    """The decoder's config: cfg itself, or its `text_config` (multimodal checkpoints)."""
    inner = cfg.get("text_config")
    return inner if isinstance(inner, Mapping) else cfg


def _int(cfg: Mapping, key: str, low: int, default: int | None = None) -> int:
    value = cfg.get(key, default)
    if value is None:
        raise ValueError(f"config.json is missing required field {key!r}")
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"config.json field {key!r} must be an integer >= {low}, got {value!r}")
    return value


def expert_count(cfg: Mapping) -> int:
    """The routed experts per MoE layer, from whichever of EXPERT_COUNT_KEYS the config has."""
    cfg = text_config(cfg)
    found = {k: cfg[k] for k in EXPERT_COUNT_KEYS if cfg.get(k) is not None}
    if not found:
        raise ValueError(f"missing key 'num_experts' (or {' / '.join(repr(k) for k in EXPERT_COUNT_KEYS[1:])})")
    if len(set(found.values())) > 1:
        raise ValueError(f"config.json gives different expert counts: {found}")
    return _int(found, next(iter(found)), 0)


def moe_layer_ids(cfg: Mapping, num_layers: int, num_experts: int) -> tuple[int, ...]:
    """MoE unless in mlp_only_layers, off the decoder_sparse_step grid or below first_k_dense_replace."""
    cfg = text_config(cfg)
    if num_experts == 0:
        return ()
    if int(cfg.get("moe_layer_freq", 1) or 1) != 1:
        raise ValueError(f"moe_layer_freq {cfg['moe_layer_freq']} is not supported (only 1)")
    dense = set(cfg.get("mlp_only_layers") or ())
    step = int(cfg.get("decoder_sparse_step", 1) or 1)
    first_dense = int(cfg.get("first_k_dense_replace", 0) or 0)
    return tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0 and i >= first_dense)


def routing_shape(cfg: Mapping) -> RoutingShape:
    """The routing shape of an HF config.json (as a dict); ValueError naming a missing or bad key."""
    cfg = text_config(cfg)
    layers = _int(cfg, "num_hidden_layers", 1)
    experts = expert_count(cfg)
    top_k = _int(cfg, "num_experts_per_tok", 1)
    if experts and top_k > experts:
        raise ValueError(f"num_experts_per_tok={top_k} must be in [1, num_experts={experts}]")
    return RoutingShape(num_hidden_layers=layers, num_experts=experts, top_k=top_k,
                        moe_layer_ids=moe_layer_ids(cfg, layers, experts))
