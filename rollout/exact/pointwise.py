"""Batch-invariant pointwise and row-wise ops.

NOTE: torch's CPU kernels for sigmoid, silu and rsqrt give different last bits in their vector
body and their scalar tail, and which elements fall in the tail depends on the tensor's size and
on how it is split among threads, so a token's result would depend on the batch. The forms here
use only exp, sqrt and IEEE arithmetic, whose vector and scalar paths agree; the row reductions
(sum, amax, softmax, log_softmax over the last dim) reduce each row in an order fixed by its
length alone (both checked in tests/test_exact_ops.py).
"""
from __future__ import annotations

import torch


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return 1.0 / (1.0 + torch.exp(-x))


def silu(x: torch.Tensor) -> torch.Tensor:
    return x / (1.0 + torch.exp(-x))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, normalised in fp32 and scaled in x's dtype (as layers.RMSNorm)."""
    xf = x.float()
    xf = xf / torch.sqrt((xf * xf).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def softmax(x: torch.Tensor) -> torch.Tensor:
    """softmax over the last dim in fp32."""
    return torch.softmax(x, dim=-1, dtype=torch.float32)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """log_softmax over the last dim in fp32."""
    return torch.log_softmax(x.float(), dim=-1)
