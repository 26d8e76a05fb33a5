"""paged_reference_attention: attention over PagedKVMetadata in plain torch, one entry at a time.

The CPU reference for the metadata the FlashInfer backend and the Triton cascade kernel consume:
if this agrees with PagedAttention's padded grid, the metadata is right. Slow by design (a
Python loop over entries); fp32 throughout.
"""
from __future__ import annotations

import torch

from rollout.batch.paged_kv_metadata import PagedKVLevel, PagedKVMetadata


def level_attention(q: torch.Tensor, kv_buffer: torch.Tensor, level: PagedKVLevel, *, scale: float,
                    causal: bool, window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, H, D] in the level's row order -> fp32 out [N, H, D] and log-sum-exp [N, H]."""
    n, heads, dim = q.shape
    kvh = kv_buffer.shape[2]
    out = torch.zeros(n, heads, dim, dtype=torch.float32)
    lse = torch.full((n, heads), float("-inf"), dtype=torch.float32)
    qo, kvp = level.qo_indptr.tolist(), level.kv_indptr.tolist()
    for r in range(level.num_entries):
        rows = slice(qo[r], qo[r + 1])
        slots = level.kv_indices[kvp[r]:kvp[r + 1]].long().cpu()
        if slots.numel() == 0 or qo[r] == qo[r + 1]:
            continue
        kv = kv_buffer.index_select(0, slots.to(kv_buffer.device)).float().cpu()       # [K, 2, kvH, D]
        keys = kv[:, 0].repeat_interleave(heads // kvh, dim=1)                         # [K, H, D]
        values = kv[:, 1].repeat_interleave(heads // kvh, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[rows].float().cpu(), keys) * scale     # [H, Q, K]
        nq, nk = scores.shape[1:]
        q_pos = torch.arange(nq)[:, None] + (nk - nq)
        k_pos = torch.arange(nk)[None, :]
        see = torch.ones(nq, nk, dtype=torch.bool)
        if causal:
            see &= k_pos <= q_pos
        if window is not None:
            see &= k_pos > q_pos - window
        scores = scores.masked_fill(~see, float("-inf"))
        entry_lse = torch.logsumexp(scores, -1)                                        # [H, Q]
        probs = torch.exp(scores - entry_lse[..., None]).nan_to_num(0.0)
        out[rows] = torch.einsum("hqk,khd->qhd", probs, values)
        lse[rows] = entry_lse.transpose(0, 1)
    return out, lse


def paged_reference_attention(q: torch.Tensor, kv_buffer: torch.Tensor, meta: PagedKVMetadata, *, scale: float,
                              window: int | None = None) -> torch.Tensor:
    """q [N, H, D] in batch order -> [N, H*D] fp32 (on the CPU): every level, merged by log-sum-exp."""
    n, heads, dim = q.shape
    rows = q if meta.order is None else q.index_select(0, meta.order.to(q.device))
    parts = [level_attention(rows, kv_buffer, level, scale=scale, causal=meta.causal and i == 0, window=window)
             for i, level in enumerate(meta.levels)]
    lses = torch.stack([lse for _, lse in parts], -1)                                  # [N, H, levels]
    top = lses.amax(-1, keepdim=True)
    weights = torch.exp(lses - top.masked_fill(torch.isinf(top), 0.0))
    merged = sum(o * weights[..., i, None] for i, (o, _) in enumerate(parts)) / weights.sum(-1)[..., None]
    if meta.order is not None:
        merged = torch.empty_like(merged).index_copy_(0, meta.order.cpu(), merged)
    return merged.reshape(n, heads * dim)
