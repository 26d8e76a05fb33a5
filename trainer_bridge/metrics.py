"""Per-step metrics of train/rollout agreement. Every function returns a Python float.

Token metrics compare the trainer's log-probs of the sampled tokens with the rollout engine's,
over the tokens where ``mask`` is nonzero (response tokens with loss mask 1).
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

__all__ = ["routing_mismatch_rate", "logprob_abs_diff", "logprob_max_abs_diff", "k3_kl", "ratio_outside", "reward_mean",
           "response_length_mean", "step_metrics"]


def _mean(x: torch.Tensor, mask: Optional[torch.Tensor]) -> float:
    x = x.detach().float()
    if mask is None:
        return float(x.mean()) if x.numel() else 0.0
    m = mask.detach().to(x.device).float().expand_as(x)
    n = float(m.sum())
    return float((x * m).sum()) / n if n > 0 else 0.0


def routing_mismatch_rate(live: torch.Tensor, replayed: torch.Tensor, mask: Optional[torch.Tensor] = None) -> float:
    """Share of (token, MoE layer) rows whose live top-k *set* differs from the replayed one.

    ``live``/``replayed``: ``[N, num_layers, top_k]`` (or ``[B, T, ...]``); rows where ``replayed``
    is all -1 (dense layers) are not counted; ``mask`` ``[N]`` selects the token rows to count
    (e.g. ``PackedBatch.routing_mask`` to skip padding and last tokens).
    """
    live = torch.as_tensor(live)
    replayed = torch.as_tensor(replayed).to(live.device)
    if live.shape != replayed.shape:
        raise ValueError(f"routing_mismatch_rate: shapes differ {list(live.shape)} vs {list(replayed.shape)}")
    live = live.reshape(-1, *live.shape[-2:]).long()
    replayed = replayed.reshape(-1, *replayed.shape[-2:]).long()
    differ = (torch.sort(live, -1).values != torch.sort(replayed, -1).values).any(-1)  # [N, L]
    counted = ~(replayed == -1).all(-1)
    if mask is not None:
        counted = counted & mask.reshape(-1, 1).to(counted.device).bool()
    n = int(counted.sum())
    return float((differ & counted).sum()) / n if n else 0.0


def logprob_abs_diff(train_logprobs, rollout_logprobs, mask=None) -> float:
    """Mean ``|logp_train - logp_rollout|``."""
    return _mean((train_logprobs - rollout_logprobs).abs(), mask)


def logprob_max_abs_diff(train_logprobs, rollout_logprobs, mask=None) -> float:
    """Max ``|logp_train - logp_rollout|`` over the masked tokens (0.0 if none), unrounded."""
    d = (torch.as_tensor(train_logprobs).detach().float() - torch.as_tensor(rollout_logprobs).float()).abs()
    if mask is not None:
        d = d[torch.as_tensor(mask).to(d.device).expand_as(d) != 0]
    return float(d.max()) if d.numel() else 0.0


def k3_kl(train_logprobs, rollout_logprobs, mask=None) -> float:
    """k3 estimate of KL(rollout || train) on rollout-sampled tokens: mean ``r - 1 - log r``,
    ``r = p_train / p_rollout``."""
    d = (train_logprobs - rollout_logprobs).float()
    return _mean(torch.exp(d) - d - 1.0, mask)


def ratio_outside(train_logprobs, rollout_logprobs, mask=None, tau: float = 2.0) -> float:
    """F(tau): share of tokens whose ``p_train / p_rollout`` is above ``tau`` or below ``1 / tau``."""
    if tau <= 1:
        raise ValueError(f"tau must be > 1, got {tau}")
    d = (train_logprobs - rollout_logprobs).float()
    return _mean((d.abs() > math.log(tau)).float(), mask)


def reward_mean(samples_or_rewards) -> float:
    vals = [s.reward if hasattr(s, "reward") else s for s in samples_or_rewards]
    vals = [float(v) for v in vals if v is not None]
    return sum(vals) / len(vals) if vals else 0.0


def response_length_mean(samples: Sequence) -> float:
    lens = [s.response_length if hasattr(s, "response_length") else int(s) for s in samples]
    return sum(lens) / len(lens) if lens else 0.0


def step_metrics(*, train_logprobs=None, rollout_logprobs=None, loss_mask=None, samples=None,
                 live_experts=None, replayed_experts=None, routing_mask=None, tau: float = 2.0) -> dict:
    """The per-step metric dict (keys present only for the inputs given)."""
    out = {}
    if train_logprobs is not None and rollout_logprobs is not None:
        out["train_rollout_logprob_abs_diff"] = logprob_abs_diff(train_logprobs, rollout_logprobs, loss_mask)
        out["train_rollout_logprob_max_abs_diff"] = logprob_max_abs_diff(train_logprobs, rollout_logprobs, loss_mask)
        out["k3_kl"] = k3_kl(train_logprobs, rollout_logprobs, loss_mask)
        out[f"f_tau{tau:g}"] = ratio_outside(train_logprobs, rollout_logprobs, loss_mask, tau)
    if live_experts is not None and replayed_experts is not None:
        out["routing_mismatch_rate"] = routing_mismatch_rate(live_experts, replayed_experts, routing_mask)
    if samples is not None:
        out["reward_mean"] = reward_mean(samples)
        out["response_length_mean"] = response_length_mean(samples)
    return out
