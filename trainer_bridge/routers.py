"""The MoE routers ``RouterReplay`` works on: finding them in a model (transformers 5.x routers by
class name, DeepSpeed ``TopKGate``), each one's per-context state (``Router``), and the gate rule
that recomputes a transformers router's weights at replayed ids: softmax (Qwen, Mixtral, OLMoE)
or sigmoid times ``routed_scaling_factor`` (DeepSeek-V3, GLM-4.5). DeepSpeed gates are replayed
by ``trainer_bridge.ds_gating``; the context itself is ``trainer_bridge.router_replay``."""
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
}
# routers whose weights are sigmoid scores times routed_scaling_factor (grouped, bias-chosen ids)
_SIGMOID_ROUTERS = ("DeepseekV3TopkRouter", "Glm4MoeTopkRouter")
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
    scaling: Optional[float] = None  # sigmoid routers: routed_scaling_factor; None: softmax rule
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
                          scaling: float) -> torch.Tensor:
    """[tokens, top_k] DeepSeek-V3 / GLM-4.5 gate weights of the replayed ids: unbiased sigmoid
    scores (fp32), optionally normalised, times routed_scaling_factor; transformers' op sequence."""
    weights = logits.float().sigmoid().gather(1, ids)
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True) + 1e-20
    return weights * scaling


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
            routers.append(Router(m, name, layer, "hf", renormalize=_HF_ROUTERS[kind](m),
                                   top_k=int(m.top_k), num_experts=int(m.num_experts),
                                   scaling=float(m.routed_scaling_factor) if kind in _SIGMOID_ROUTERS else None))
    ks = {r.top_k for r in routers}
    es = {r.num_experts for r in routers}
    if len(ks) != 1 or len(es) != 1:
        raise ValueError(f"RouterReplay: routers disagree on top_k {sorted(ks)} / num_experts {sorted(es)}")
    routers.sort(key=lambda r: r.layer)
    return routers, num_layers
