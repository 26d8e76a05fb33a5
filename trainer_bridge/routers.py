"""The MoE routers ``RouterReplay`` works on: finding them in a model (transformers 5.x routers by
class name, DeepSpeed ``TopKGate``), each one's per-context state (``Router``), and the gate rule
that recomputes a transformers router's weights at replayed ids: softmax (Qwen, Mixtral, OLMoE),
sigmoid times ``routed_scaling_factor`` (DeepSeek-V3, GLM-4.5, MiniMax-M2) or softmax over the k
ids' logits (gpt-oss). DeepSpeed gates are replayed by ``trainer_bridge.ds_gating``; the context
itself is ``trainer_bridge.router_replay``."""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

_HF_ROUTERS = {
    "Qwen3MoeTopKRouter": lambda m: bool(m.norm_topk_prob),
    "Qwen2MoeTopKRouter": lambda m: bool(m.norm_topk_prob),
    "OlmoeTopKRouter": lambda m: bool(m.norm_topk_prob),
    "MixtralTopKRouter": lambda m: True,
    "DeepseekV3TopkRouter": lambda m: bool(m.norm_topk_prob),
    "Glm4MoeTopkRouter": lambda m: bool(m.norm_topk_prob),
    "MiniMaxM2TopKRouter": lambda m: True,
    "GptOssTopKRouter": lambda m: True,   # NOTE: its softmax spans the k ids only: always sums to 1
}
# each router's weight rule (default "softmax"): "sigmoid" = sigmoid scores at the ids, normalised,
# times routed_scaling_factor (bias-chosen ids, grouped or not); "topk_softmax" = softmax over the
# k ids' logits. RULE_EPS: what the sigmoid rule adds to the sum it divides by (transformers' own)
_RULES = {"DeepseekV3TopkRouter": "sigmoid", "Glm4MoeTopkRouter": "sigmoid", "MiniMaxM2TopKRouter": "sigmoid",
          "GptOssTopKRouter": "topk_softmax"}
_RULE_EPS = {"DeepseekV3TopkRouter": 1e-20, "Glm4MoeTopkRouter": 1e-20, "MiniMaxM2TopKRouter": 0.0}
_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


@dataclass(eq=False)
class Router:
    """One router (or DeepSpeed gate) and its per-context state."""
    module: nn.Module
    name: str
    layer: int
    kind: str  # "hf" | "deepspeed"
    renormalize: bool
    top_k: int
    num_experts: int
    rule: str = "softmax"  # "softmax" | "sigmoid" | "topk_softmax" (see _RULES)
    scaling: float = 1.0  # sigmoid rule: routed_scaling_factor
    eps: float = 0.0  # sigmoid rule: added to the sum of the k scores before dividing
    handle: object = None
    ids: Optional[torch.Tensor] = None  # [num_tokens, top_k] int64, replayed ids of this layer
    live: Optional[torch.Tensor] = None  # [tokens, top_k] live top-k of the last forward call
    logits: Optional[torch.Tensor] = None  # [tokens, num_experts] of the last forward call
    forward_calls: int = 0
    grad_forward_calls: int = 0
    recompute_calls: int = 0
    saved_forward: object = field(default=None)

    def replay_ids(self, n: int, device: torch.device) -> torch.Tensor:
        if self.ids.shape[0] != n:
            raise ValueError(
                f"router {self.name!r} (layer {self.layer}) saw {n} token rows but routed_experts has "
                f"{self.ids.shape[0]}: routing must be [B*T, num_layers, top_k] (or [B, T, ...]) for "
                "input_ids [B, T], packed with the same index map as the tokens")
        if self.ids.device != device:
            self.ids = self.ids.to(device)
        return self.ids


def gate_weights(logits: torch.Tensor, ids: torch.Tensor, renormalize: bool) -> torch.Tensor:
    """[tokens, top_k] gate weights of the replayed ids from the router's own logits (fp32).

    Same op sequence as transformers' routers (softmax in fp32, top values, in-place
    renormalisation), so replaying the live ids reproduces them bit for bit.
    """
    probs = torch.nn.functional.softmax(logits, dtype=torch.float, dim=-1)
    weights = probs.gather(1, ids)
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights


def sigmoid_gate_weights(logits: torch.Tensor, ids: torch.Tensor, renormalize: bool,
                          scaling: float, eps: float = 1e-20) -> torch.Tensor:
    """[tokens, top_k] DeepSeek-V3 / GLM-4.5 / MiniMax-M2 gate weights of the replayed ids:
    unbiased sigmoid scores (fp32), optionally divided by their sum (+ eps: 1e-20 for DeepSeek-V3
    and GLM-4.5, 0 for MiniMax-M2), times routed_scaling_factor (1 for MiniMax-M2, which has none);
    transformers' op sequence."""
    weights = logits.float().sigmoid().gather(1, ids)
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True) + eps
    return weights * scaling


def topk_softmax_gate_weights(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """[tokens, top_k] gpt-oss gate weights of the replayed ids: softmax over those k ids' logits,
    in the logits' dtype (transformers' GptOssTopKRouter: softmax over its top-k logits), so every
    replayed expert's router row (and bias) gets gradient."""
    return torch.nn.functional.softmax(logits.gather(1, ids), dim=1, dtype=logits.dtype)


def replay_gate_weights(r: "Router", logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """[tokens, top_k] weights of ids [tokens, top_k] from logits [tokens, E] by r's rule."""
    if r.rule == "sigmoid":
        return sigmoid_gate_weights(logits, ids, r.renormalize, r.scaling, r.eps)
    if r.rule == "topk_softmax":
        return topk_softmax_gate_weights(logits, ids)
    return gate_weights(logits, ids, r.renormalize)


def _find_config(model: nn.Module):
    for m in (model, getattr(model, "module", None)):
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "num_hidden_layers"):
            return cfg
    return None


def discover_routers(model: nn.Module) -> tuple[list[Router], int]:
    found: list[tuple[str, nn.Module, str]] = []
    ds_gate = None
    if "deepspeed.moe.sharded_moe" in sys.modules:  # NOTE: never import deepspeed just to look
        ds_gate = sys.modules["deepspeed.moe.sharded_moe"].TopKGate
    for name, m in model.named_modules():
        mro = {c.__name__ for c in type(m).__mro__}
        hf = next((c for c in _HF_ROUTERS if c in mro), None)
        if hf is not None:
            found.append((name, m, hf))
        elif ds_gate is not None and isinstance(m, ds_gate):
            found.append((name, m, "deepspeed"))
    if not found:
        raise ValueError(f"RouterReplay: no supported MoE router in {type(model).__name__} (supported: "
                         f"transformers 5.x {sorted(_HF_ROUTERS)} and deepspeed TopKGate)")
    matches = [_LAYER_RE.findall(name) for name, _, _ in found]
    cfg = _find_config(model)
    if all(matches) and len({int(mt[-1]) for mt in matches}) == len(found):
        layers = [int(mt[-1]) for mt in matches]
        num_layers = max(max(layers) + 1, int(cfg.num_hidden_layers) if cfg is not None else 0)
    else:  # modules not under `layers.N`: number the routers in module order
        layers = list(range(len(found)))
        num_layers = len(found)
    routers = []
    for (name, m, kind), layer in zip(found, layers):
        if kind == "deepspeed":
            routers.append(Router(m, name, layer, "deepspeed", renormalize=m.k > 1, top_k=int(m.k),
                                   num_experts=int(m.wg.weight.shape[0])))
        else:
            rule = _RULES.get(kind, "softmax")
            routers.append(Router(m, name, layer, "hf", renormalize=_HF_ROUTERS[kind](m),
                                   top_k=int(m.top_k), num_experts=int(m.num_experts), rule=rule,
                                   scaling=float(getattr(m, "routed_scaling_factor", 1.0)) if rule == "sigmoid" else 1.0,
                                   eps=_RULE_EPS.get(kind, 0.0)))
    ks = {r.top_k for r in routers}
    es = {r.num_experts for r in routers}
    if len(ks) != 1 or len(es) != 1:
        raise ValueError(f"RouterReplay: routers disagree on top_k {sorted(ks)} / num_experts {sorted(es)}")
    routers.sort(key=lambda r: r.layer)
    return routers, num_layers
