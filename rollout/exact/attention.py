"""Batch-invariant attention: fixed query and key tiles, keys summed tile by tile in one order.

A query's result depends only on its own query vector and the keys/values at the positions its
mask admits: queries are cut into tiles of Q_TILE rows and keys into tiles of K_TILE positions
counted from the request's first key, every score and value product is a GEMM of one fixed tile
shape, and the tiles of keys are folded in with an online softmax from the first to the last.
A tile of keys that a query may not see changes nothing, exactly (its weights are exp(-inf) = 0
and its running max stays), so a decode step over L keys, a chunked prefill, a prefix-cache hit
and a full-sequence forward (a trainer's) give the same bits for the same query.
"""
from __future__ import annotations

import torch

Q_TILE = 16
K_TILE = 64


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, G, R, D], k [B, G, S, D], v [B, G, S, Dv], mask bool [B, 1 or G, R, S] (True = attend;
    key s of request b is its position s) -> [B, G, R, Dv] in q's dtype, computed in fp32.

    Rows whose mask admits no key get 0."""
    b, g, r, d = q.shape
    s, dv = k.shape[2], v.shape[-1]
    rp, sp = r + (-r) % Q_TILE, s + (-s) % K_TILE
    nq, nk = rp // Q_TILE, sp // K_TILE
    qf = torch.zeros(b, g, rp, d, dtype=torch.float32, device=q.device)
    qf[:, :, :r] = q
    kf = torch.zeros(b, g, sp, d, dtype=torch.float32, device=q.device)
    kf[:, :, :s] = k
    vf = torch.zeros(b, g, sp, dv, dtype=torch.float32, device=q.device)
    vf[:, :, :s] = v
    mf = torch.zeros(b, mask.shape[1], rp, sp, dtype=torch.bool, device=q.device)
    mf[:, :, :r, :s] = mask
    mf = mf.expand(b, g, rp, sp).reshape(b, g, nq, Q_TILE, nk, K_TILE)
    q_tiles = qf.view(b * g * nq, Q_TILE, d)
    m = torch.full((b * g * nq, Q_TILE, 1), float("-inf"), device=q.device)   # running max
    l = torch.zeros(b * g * nq, Q_TILE, 1, device=q.device)                    # running sum of weights
    acc = torch.zeros(b * g * nq, Q_TILE, dv, device=q.device)                 # running weighted values
    for t in range(nk):
        keys = kf[:, :, None, t * K_TILE:(t + 1) * K_TILE].expand(b, g, nq, K_TILE, d).reshape(-1, K_TILE, d)
        vals = vf[:, :, None, t * K_TILE:(t + 1) * K_TILE].expand(b, g, nq, K_TILE, dv).reshape(-1, K_TILE, dv)
        scores = torch.bmm(q_tiles, keys.transpose(1, 2)) * scale                 # [T, Q_TILE, K_TILE]
        scores = scores.masked_fill(~mf[:, :, :, :, t].reshape(-1, Q_TILE, K_TILE), float("-inf"))
        m_new = torch.maximum(m, scores.amax(-1, keepdim=True))
        # NOTE: a row that has seen no key yet has m_new = -inf; shift by 0 there (its weights are 0)
        shift = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        p = torch.exp(scores - shift)
        alpha = torch.exp(m - shift)
        l = l * alpha + p.sum(-1, keepdim=True)
        acc = acc * alpha + torch.bmm(p, vals)
        m = m_new
    out = acc / torch.where(l == 0, torch.ones_like(l), l)
    return out.view(b, g, rp, dv)[:, :, :r].to(q.dtype)
