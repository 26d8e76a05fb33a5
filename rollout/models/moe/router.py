"""Router modules: the gate linear whose logits a RoutingRule turns into (weights, ids).

Parameter names follow the HF checkpoints (`mlp.gate.weight`, DeepSeek's
`mlp.gate.e_score_correction_bias`); an architecture whose checkpoint names differ renames them
on load (its `hf_renames`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rollout import exact as exact_ops


class Router(nn.Module):
    """gate.weight [E, H] (+ gate.bias [E], gpt-oss) in the model's dtype."""

    exact = False   # rollout.exact.linear (deterministic inference)

    def __init__(self, hidden_size: int, num_experts: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.bias = nn.Parameter(torch.empty(num_experts)) if bias else None
        self.e_score_correction_bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (exact_ops.linear if self.exact else F.linear)(x, self.weight, self.bias)  # [N, E]


class BiasedRouter(nn.Module):
    """gate.weight [E, H] and gate.e_score_correction_bias [E], both kept in float32.

    The bias is a load-balancing statistic (updated outside the gradient by the trainer's
    balancing rule): a parameter here only so checkpoints and weight updates reach it by name.
    """

    exact = False   # rollout.exact.linear (deterministic inference)

    def __init__(self, hidden_size: int, num_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32))
        self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts, dtype=torch.float32),
                                                    requires_grad=False)

    def _apply(self, fn, recurse=True):
        # NOTE: model.to(bfloat16) must not round the router: transformers keeps gate.weight and
        # the bias in fp32 (_keep_in_fp32_modules_strict), and routing is computed in fp32.
        super()._apply(fn, recurse)
        for p in self.parameters(recurse=False):
            if p.dtype != torch.float32:
                p.data = p.data.float()
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (exact_ops.linear if self.exact else F.linear)(x.float(), self.weight)  # [N, E] float32
