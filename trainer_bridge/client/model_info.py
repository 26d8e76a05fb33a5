"""``ModelInfo``: the routing shape of the model the servers serve (from ``/model_info`` or a
HF ``config.json``)."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Mapping, Optional

from capture.routing_shape import routing_shape, text_config


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
        shape = routing_shape(cfg)
        cfg = text_config(cfg)
        arch = (cfg.get("architectures") or [""])[0]
        return cls(num_layers=shape.num_hidden_layers, num_experts=shape.num_experts, top_k=shape.top_k,
                   moe_layers=shape.moe_layer_ids, vocab_size=int(cfg["vocab_size"]), weight_version=weight_version,
                   architecture=str(arch))

    def same_model(self, other: "ModelInfo") -> bool:
        keys = ("num_layers", "num_experts", "top_k", "moe_layers", "vocab_size", "architecture")
        return all(getattr(self, k) == getattr(other, k) for k in keys)
