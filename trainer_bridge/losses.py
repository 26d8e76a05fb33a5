"""RL losses under router replay: GRPO advantages, PPO-clip with rollout importance ratios, k3 KL,
entropy, and the router alignment loss.

Per-token tensors are aligned like ``PackedBatch`` (``[1, N]`` or any shape, with a ``loss_mask``
of the same shape); log-probs are fp32 log-probabilities of the target tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence, Union

import torch

from rollout.value_range import check_choice, check_range

__all__ = ["masked_mean", "token_logprobs", "token_entropy", "grpo_advantages", "kl_k3", "policy_loss",
           "router_alignment_loss", "LossConfig", "rl_loss"]

LOSS_AGGS = ("token-mean", "seq-mean-token-mean")


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over entries where ``mask`` is nonzero (weighted by ``mask``); 0 if none."""
    mask = mask.to(x.dtype)
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def token_logprobs(logits: torch.Tensor, target_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(target) per position in fp32; ``logits`` ``[..., V]``, ``target_ids`` ``[...]``.

    ``temperature`` divides the logits first, matching rollout log-probs of the temperature-scaled
    distribution (the engine's default).
    """
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, target_ids.unsqueeze(-1)).squeeze(-1)


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of the next-token distribution per position, fp32, ``[...]``."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def grpo_advantages(rewards, group_ids: Sequence, *, eps: float = 1e-6, std_normalize: bool = True) -> torch.Tensor:
    """Group-normalised advantages ``(r - mean_g) / (std_g + eps)``, ``[num_samples]`` fp32.

    ``std_g`` is the unbiased (n-1) standard deviation of the group (as in GRPO implementations);
    a group of one sample gets advantage 0 (no relative signal). ``std_normalize=False`` returns
    ``r - mean_g`` (Dr. GRPO).
    """
    r = torch.as_tensor(rewards, dtype=torch.float32).flatten()
    if len(group_ids) != r.numel():
        raise ValueError(f"grpo_advantages: {r.numel()} rewards but {len(group_ids)} group ids")
    keys = {}
    gid = torch.tensor([keys.setdefault(g, len(keys)) for g in group_ids], dtype=torch.long)
    n_groups = len(keys)
    count = torch.zeros(n_groups).index_add_(0, gid, torch.ones_like(r))
    mean = torch.zeros(n_groups).index_add_(0, gid, r) / count
    dev = r - mean[gid]
    if not std_normalize:
        return dev
    var = torch.zeros(n_groups).index_add_(0, gid, dev * dev) / (count - 1).clamp(min=1.0)
    adv = dev / (var.sqrt()[gid] + eps)
    return torch.where(count[gid] > 1, adv, torch.zeros_like(adv))


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator ``exp(d) - d - 1`` with ``d = ref - logp``: estimates KL(p || ref)
    for tokens sampled from p; non-negative, unbiased."""
    d = ref_logprobs - logprobs
    return torch.exp(d) - d - 1.0


def _aggregate(per_token, loss_mask, loss_agg, sample_index, normalizer):
    if loss_agg not in LOSS_AGGS:
        raise ValueError(f"loss_agg must be one of {LOSS_AGGS}, got {loss_agg!r}")
    mask = loss_mask.to(per_token.dtype)
    if loss_agg == "token-mean":
        if normalizer is not None:
            return (per_token * mask).sum() / normalizer
        return masked_mean(per_token, mask)
    if sample_index is None:
        raise ValueError("loss_agg='seq-mean-token-mean' needs sample_index")
    idx = sample_index.reshape(-1)
    keep = (idx >= 0) & (mask.reshape(-1) > 0)
    idx, vals, w = idx[keep], (per_token * mask).reshape(-1)[keep], mask.reshape(-1)[keep]
    if idx.numel() == 0:
        return per_token.sum() * 0.0
    uniq, inv = torch.unique(idx, return_inverse=True)
    seq_sum = torch.zeros(len(uniq), dtype=vals.dtype, device=vals.device).index_add(0, inv, vals)
    seq_cnt = torch.zeros(len(uniq), dtype=vals.dtype, device=vals.device).index_add(0, inv, w)
    seq_mean = seq_sum / seq_cnt
    return seq_mean.sum() / (normalizer if normalizer is not None else len(uniq))


def policy_loss(logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, advantages: torch.Tensor,
                loss_mask: torch.Tensor, *, old_logprobs: Optional[torch.Tensor] = None, clip_eps: float = 0.2,
                clip_eps_high: Optional[float] = None, tis_cap: Optional[float] = None,
                loss_agg: str = "token-mean", sample_index: Optional[torch.Tensor] = None,
                normalizer: Optional[float] = None) -> tuple[torch.Tensor, dict]:
    """PPO-clip policy loss ``max(-A r, -A clip(r, 1-eps, 1+eps_high))``, aggregated over the mask.

    Ratio ``r = exp(logp - ref)``:
    - ``tis_cap`` None: ``ref = old_logprobs`` if given, else ``rollout_logprobs`` (the importance
      ratio against the policy that generated the data).
    - ``tis_cap`` set (truncated importance sampling): ``ref = old_logprobs`` if given, else
      ``logprobs.detach()`` (on-policy step), and each token's loss is multiplied by the constant
      ``min(exp(ref - rollout_logprobs), tis_cap)``, correcting the trainer/rollout mismatch.
    ``advantages``: per token, same shape as ``logprobs``. ``normalizer`` replaces the count in the
    mean (e.g. the token count of the whole step when accumulating micro-batches).
    Returns ``(loss, stats)`` with detached stats ``clip_frac``, ``ratio_mean``, ``tis_weight_mean``.
    """
    eps_hi = clip_eps if clip_eps_high is None else clip_eps_high
    if tis_cap is not None:
        if tis_cap <= 0:
            raise ValueError(f"tis_cap must be > 0, got {tis_cap}")
        ref = old_logprobs if old_logprobs is not None else logprobs.detach()
        weight = torch.exp(ref - rollout_logprobs).clamp(max=tis_cap).detach()
    else:
        ref = old_logprobs if old_logprobs is not None else rollout_logprobs
        weight = None
    ratio = torch.exp(logprobs - ref)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + eps_hi)
    per_token = torch.maximum(unclipped, clipped)
    if weight is not None:
        per_token = per_token * weight
    loss = _aggregate(per_token, loss_mask, loss_agg, sample_index, normalizer)
    with torch.no_grad():
        m = loss_mask.to(torch.float32)
        stats = {"clip_frac": masked_mean((clipped > unclipped).float(), m),
                 "ratio_mean": masked_mean(ratio.float(), m),
                 "tis_weight_mean": masked_mean(weight.float(), m) if weight is not None else torch.tensor(1.0)}
    return loss, stats


def router_alignment_loss(router_logits: Union[Mapping[int, torch.Tensor], Sequence[torch.Tensor]],
                          routed_experts: torch.Tensor, row_mask: Optional[torch.Tensor] = None,
                          moe_layers: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Cross-entropy of the trainer's router toward the replayed experts, averaged over MoE layers.

    Per (token, layer): ``-mean_j log softmax(logits)[e_j]`` over the k replayed ids (target: the
    uniform distribution on the replayed set). ``router_logits``: ``{layer: [N, E]}`` (as from
    ``RouterReplay.router_logits()``) or a sequence with ``moe_layers``; ``routed_experts``
    ``[N, num_layers, top_k]``; ``row_mask`` ``[N]`` (e.g. ``PackedBatch.routing_mask``).
    """
    if not isinstance(router_logits, Mapping):
        if moe_layers is None or len(moe_layers) != len(router_logits):
            raise ValueError("router_alignment_loss: a sequence of logits needs moe_layers of the same length")
        router_logits = dict(zip(moe_layers, router_logits))
    if not router_logits:
        raise ValueError("router_alignment_loss: no router logits")
    routed = torch.as_tensor(routed_experts)
    if routed.ndim == 4:
        routed = routed.reshape(-1, *routed.shape[2:])
    total = 0.0
    for layer, logits in router_logits.items():
        logits = logits.reshape(-1, logits.shape[-1])
        if logits.shape[0] != routed.shape[0]:
            raise ValueError(f"router_alignment_loss: layer {layer} logits have {logits.shape[0]} rows, "
                             f"routed_experts {routed.shape[0]}")
        ids = routed[:, layer].long().to(logits.device)
        ce = -torch.log_softmax(logits.float(), dim=-1).gather(1, ids).mean(-1)  # [N]
        mask = torch.ones_like(ce) if row_mask is None else row_mask.reshape(-1).to(ce)
        total = total + masked_mean(ce, mask)
    return total / len(router_logits)


@dataclass(frozen=True, kw_only=True)
class LossConfig:
    clip_eps: float = field(default=0.2, metadata={"help": "PPO clip: the ratio is clipped to "
                                                   "[1 - clip_eps, 1 + clip_eps_high]"})
    clip_eps_high: Optional[float] = field(default=None, metadata={"help": "upper clip (null: clip_eps)"})
    tis_cap: Optional[float] = field(default=None, metadata={"help": "truncated importance sampling: each token's "
                                     "loss times min(train/rollout probability ratio, tis_cap); null: the PPO "
                                     "ratio is taken against the rollout log-probs"})
    kl_coef: float = field(default=0.0, metadata={"help": "k3 KL to a reference policy's log-probs "
                                                  "(python -m trainer_bridge.train has none: 0 there)"})
    entropy_coef: float = field(default=0.0, metadata={"help": "entropy bonus"})
    router_align_coef: float = field(default=0.0, metadata={"help": "router alignment loss toward the replayed "
                                     "experts, from the router logits (python -m trainer_bridge.train: 0)"})
    loss_agg: str = field(default="token-mean", metadata={"help": f"aggregation, one of {', '.join(LOSS_AGGS)}"})
    temperature: float = field(default=1.0, metadata={"help": "divides the logits (the rollout temperature)"})

    def __post_init__(self):
        check_choice("loss_agg", self.loss_agg, LOSS_AGGS)
        for f in ("clip_eps", "kl_coef", "entropy_coef", "router_align_coef"):
            check_range(f, getattr(self, f), 0)
        check_range("clip_eps_high", self.clip_eps_high, 0, or_none=True)
        check_range("tis_cap", self.tis_cap, 0, lo_open=True, or_none=True)
        check_range("temperature", self.temperature, 0, lo_open=True)


def rl_loss(config: LossConfig, *, logits: torch.Tensor, batch, advantages: torch.Tensor,
            ref_logprobs: Optional[torch.Tensor] = None, old_logprobs: Optional[torch.Tensor] = None,
            router_logits: Optional[Mapping[int, torch.Tensor]] = None,
            normalizer: Optional[float] = None) -> tuple[torch.Tensor, dict]:
    """Full objective on a ``PackedBatch``: policy loss + kl_coef * k3(ref) - entropy_coef * H
    + router_align_coef * router alignment. ``advantages``: per sample (indexed like
    ``pack_samples``' list). Returns ``(loss, stats)``; stats include ``logprobs`` (detached)."""
    lp = token_logprobs(logits, batch.target_ids, config.temperature)
    adv = batch.per_token(advantages).to(lp)
    loss, stats = policy_loss(lp, batch.rollout_logprobs, adv, batch.loss_mask, old_logprobs=old_logprobs,
                              clip_eps=config.clip_eps, clip_eps_high=config.clip_eps_high,
                              tis_cap=config.tis_cap, loss_agg=config.loss_agg,
                              sample_index=batch.sample_index, normalizer=normalizer)
    stats["policy_loss"] = loss.detach()
    if config.kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs")
        kl = masked_mean(kl_k3(lp, ref_logprobs), batch.loss_mask)
        loss = loss + config.kl_coef * kl
        stats["kl_ref"] = kl.detach()
    if config.entropy_coef > 0:
        ent = masked_mean(token_entropy(logits, config.temperature), batch.loss_mask)
        loss = loss - config.entropy_coef * ent
        stats["entropy"] = ent.detach()
    if config.router_align_coef > 0:
        if router_logits is None or batch.routed_experts is None:
            raise ValueError("router_align_coef > 0 needs router_logits and routed batch")
        ra = router_alignment_loss(router_logits, batch.routed_experts, batch.routing_mask)
        loss = loss + config.router_align_coef * ra
        stats["router_align"] = ra.detach()
    stats["logprobs"] = lp.detach()
    return loss, stats
