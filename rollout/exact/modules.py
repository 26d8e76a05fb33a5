"""Module forms of the batch-invariant ops, for swapping into a model (the engine's or a trainer's)."""
from __future__ import annotations

import torch
from torch import nn

from rollout.exact.matmul import linear


class ExactLinear(nn.Linear):
    """nn.Linear whose product is rollout.exact.linear; same parameters, same state_dict names."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def make_exact(model: nn.Module) -> int:
    """In place: every nn.Linear of model computes with rollout.exact.linear, and every module with
    an `exact` attribute (the engine's norms, MLPs, routers, experts and attention cores) gets
    exact = True. Returns how many modules changed. Parameters are untouched (no copy)."""
    changed = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = ExactLinear
            changed += 1
        elif hasattr(module, "exact") and not isinstance(module, ExactLinear):
            module.exact = True
            changed += 1
    return changed
