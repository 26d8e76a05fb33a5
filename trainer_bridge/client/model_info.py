"""``ModelInfo``: the routing shape of the model the servers serve (from ``/model_info`` or a
HF ``config.json``)."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Mapping, Optional


@dataclass(frozen=True, kw_only=True)
class ModelInfo:
    num_layers: int
    num_experts: int
    top_k: int
    moe_layers: tuple[int, ...]
    vocab_size: int
    weight_version: str = ""
    architecture: str = ""

    @classmethod
    def from_json(cls, d: Mapping, config_path: Optional[str] = None) -> "ModelInfo":
        """From ``/model_info``. A server that does not report the routing shape (real SGLang) is
        read through the model's ``config.json``: ``config_path`` or, when that is None, the
        ``model_path`` the server reports (the trainer usually holds the same checkpoint)."""
        if "num_hidden_layers" not in d:
            return cls.from_config(config_path or str(d.get("model_path") or ""),
                                   weight_version=str(d.get("weight_version", "")))
        return cls(num_layers=int(d["num_hidden_layers"]), num_experts=int(d["num_experts"]),
                   top_k=int(d["num_experts_per_tok"]), moe_layers=tuple(d.get("moe_layer_ids") or ()),
                   vocab_size=int(d["vocab_size"]), weight_version=str(d.get("weight_version", "")),
                   architecture=str(d.get("architecture", "")))

    @classmethod
    def from_config(cls, path: str, weight_version: str = "") -> "ModelInfo":
        """The routing shape from a HF ``config.json`` (a file or its directory)."""
        file = os.path.join(path, "config.json") if os.path.isdir(path) else path
        try:
            with open(file) as f:
                cfg = json.load(f)
        except (OSError, ValueError) as exc:
            raise KeyError(f"the server reports no routing shape and {file!r} is not readable ({exc}); pass "
                           f"RolloutClient(model_config=...)") from None
        cfg = cfg.get("text_config", cfg)
        layers = int(cfg["num_hidden_layers"])
        experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts"))
        only = set(cfg.get("mlp_only_layers") or ())
        step = int(cfg.get("decoder_sparse_step") or 1)
        first_dense = int(cfg.get("first_k_dense_replace") or 0)
        moe = tuple(i for i in range(layers) if i not in only and (i + 1) % step == 0 and i >= first_dense)
        arch = (cfg.get("architectures") or [""])[0]
        return cls(num_layers=layers, num_experts=experts, top_k=int(cfg["num_experts_per_tok"]), moe_layers=moe,
                   vocab_size=int(cfg["vocab_size"]), weight_version=weight_version, architecture=str(arch))

    def same_model(self, other: "ModelInfo") -> bool:
        keys = ("num_layers", "num_experts", "top_k", "moe_layers", "vocab_size", "architecture")
        return all(getattr(self, k) == getattr(other, k) for k in keys)
