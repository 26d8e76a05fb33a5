"""RoPE parameters from an HF config: theta, partial rotary factor and YaRN scaling (DeepSeek-V3)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True, kw_only=True)
class YarnScaling:
    """YaRN ("NTK-by-parts") frequency interpolation, with DeepSeek's mscale terms."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor_override: float | None = None
    truncate: bool = True

    def __post_init__(self):
        if self.factor <= 0 or self.original_max_position_embeddings <= 0:
            raise ValueError(f"rope_scaling: factor ({self.factor}) and original_max_position_embeddings "
                             f"({self.original_max_position_embeddings}) must be > 0")

    @property
    def attention_factor(self) -> float:
        """Multiplies cos and sin (1.0 for DeepSeek-V3, whose mscale == mscale_all_dim)."""
        if self.attention_factor_override is not None:
            return self.attention_factor_override
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)

    @property
    def softmax_scale_factor(self) -> float:
        """DeepSeek-V3 multiplies its softmax scale by mscale(factor, mscale_all_dim)^2."""
        m = yarn_mscale(self.factor, self.mscale_all_dim) if self.mscale_all_dim else 1.0
        return m * m

    def inv_freq(self, dim: int, theta: float, device: torch.device | None = None) -> torch.Tensor:
        """[dim / 2] float32 inverse frequencies: interpolated below, extrapolated above the ramp."""
        def correction_dim(rotations: float) -> float:
            return dim * math.log(self.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
        pos_freqs = theta ** (torch.arange(0, dim, 2, device=device).float() / dim)
        extrapolation = 1 - ramp
        return (1.0 / (self.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def rope_parameters(cfg: dict, default_theta: float = 10000.0) -> tuple[float, float, YarnScaling | None]:
    """(rope_theta, partial_rotary_factor, YaRN scaling or None) from HF 5.x `rope_parameters` or
    the older top-level rope_theta / partial_rotary_factor / rope_scaling."""
    params = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    rope_type = params.get("rope_type") or params.get("type") or "default"
    theta = float(params.get("rope_theta", cfg.get("rope_theta", default_theta)))
    partial = float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    if not 0 < partial <= 1:
        raise ValueError(f"partial_rotary_factor must be in (0, 1], got {partial}")
    if rope_type == "default":
        return theta, partial, None
    if rope_type != "yarn":
        raise ValueError(f"rope type {rope_type!r} is not supported (only 'default' and 'yarn')")
    original = params.get("original_max_position_embeddings") or cfg.get("max_position_embeddings")
    factor = params.get("factor")
    if factor is None:
        factor = cfg["max_position_embeddings"] / original
    return theta, partial, YarnScaling(
        factor=float(factor), original_max_position_embeddings=int(original),
        beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
        mscale=params.get("mscale"), mscale_all_dim=params.get("mscale_all_dim"),
        attention_factor_override=params.get("attention_factor"), truncate=bool(params.get("truncate", True)))
