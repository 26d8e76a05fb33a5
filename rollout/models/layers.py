"""The token-wise layers the decoders are built from: RMSNorm, rotary embedding, gated MLP."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rollout import exact as exact_ops


class RMSNorm(nn.Module):
    """RMSNorm over the last dim; normalises in fp32, scales in the input dtype (as HF does)."""

    exact = False   # rollout.exact.rms_norm (deterministic inference)

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.exact:
            return exact_ops.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32:   # NOTE: the same ops without two conversions that change nothing
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """NeoX (rotate-half) RoPE over the first head_dim dims, optionally YaRN-scaled
    (rope_scaling.YarnScaling). No persistent state, so it survives meta-device init."""

    def __init__(self, head_dim: int, theta: float, scaling=None):
        super().__init__()
        assert head_dim % 2 == 0, head_dim
        self.head_dim = head_dim
        self.theta = theta
        self.scaling = scaling

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [N] -> cos, sin [N, 1, head_dim] in dtype (fp32 math, like HF)."""
        c, s = self._half_cos_sin(positions)
        return torch.cat((c, c), dim=-1)[:, None, :].to(dtype), torch.cat((s, s), dim=-1)[:, None, :].to(dtype)

    def rotation(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin as apply takes them: cos_sin's, with sin's first half negated (rotate-half's
        sign, folded in once per step rather than in every apply)."""
        c, s = self._half_cos_sin(positions)
        return torch.cat((c, c), dim=-1)[:, None, :].to(dtype), torch.cat((-s, s), dim=-1)[:, None, :].to(dtype)

    def _half_cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [N, head_dim / 2] (fp32; YaRN's attention factor applied)."""
        d = self.head_dim
        if self.scaling is None:
            inv_freq = 1.0 / (self.theta ** (torch.arange(0, d, 2, dtype=torch.float, device=positions.device) / d))
        else:
            inv_freq = self.scaling.inv_freq(d, self.theta, positions.device)
        freqs = positions[:, None].float() * inv_freq[None, :]           # [N, d/2]
        c, s = freqs.cos(), freqs.sin()
        if self.scaling is None:
            return c, s
        factor = self.scaling.attention_factor
        return c * factor, s * factor

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [N, heads, head_dim]; only the first cos.shape[-1] dims rotate (partial rotary). cos and
        sin from rotation(): x * cos + (x's halves swapped) * sin is HF's x * cos + rotate_half(x) *
        sin with cos_sin's values, bit for bit (negating is exact, and so is a product's sign)."""
        rot = cos.shape[-1]
        if rot < x.shape[-1]:
            return torch.cat((RotaryEmbedding.apply(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
        return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); HF parameter names so checkpoints map one to one."""

    exact = False   # rollout.exact.silu (deterministic inference)

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = exact_ops.silu if self.exact else F.silu
        return self.down_proj(act(self.gate_proj(x)) * self.up_proj(x))
