"""Batch-invariant attention: fixed query and key tiles, every tile in one batched GEMM, tiles of
keys summed in a fixed tree.

A query's result depends only on its own query vector and the keys/values at the positions its
mask admits. Queries are cut into tiles of Q_TILE rows and keys into tiles of K_TILE positions
counted from the request's first key; the scores of every (query tile, key tile) pair and the
weighted values of every pair are one bmm each, of one fixed tile shape whatever the batch. The
softmax is two-pass: the row's maximum over all its admitted keys (a max is exact in any order),
then exp, the per-tile sums (a fixed-length row reduction) and the per-tile weighted values,
added over the key tiles by a pairwise tree aligned at tile 0 (tile 2i with 2i + 1, then pairs of
pairs, ...). A tile of keys that a query may not see contributes exactly 0, and a zero subtree
leaves the sum unchanged, so the result does not depend on how many tiles the grid has: a decode
step over L keys, a chunked prefill, a prefix-cache hit and a full-sequence forward (a trainer's)
give the same bits for the same query, and which other rows share its query tile changes nothing
(tests/test_exact_attention.py checks row positions, grid widths and heads as rows).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

Q_TILE = 4
K_TILE = 64


def tree_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum over dim (kept, size 1) by a pairwise tree aligned at index 0: elements 2i and 2i + 1,
    then those pairs, ...; odd levels get a zero appended. Appending zeros to x leaves the bits
    of the result unchanged (elementwise adds only)."""
    dim = dim % x.dim()
    while x.shape[dim] > 1:
        if x.shape[dim] % 2:
            x = torch.cat((x, torch.zeros_like(x.narrow(dim, 0, 1))), dim)
        pairs = x.unflatten(dim, (-1, 2))
        x = pairs.select(dim + 1, 0) + pairs.select(dim + 1, 1)
    return x


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, G, R, D], k [B, G, S, D], v [B, G, S, Dv], mask bool [B, 1 or G, R, S] (True = attend;
    key s of request b is its position s) -> [B, G, R, Dv] in q's dtype, computed in fp32.

    Rows whose mask admits no key get 0."""
    b, g, r, d = q.shape
    s, dv = k.shape[2], v.shape[-1]
    mg = mask.shape[1]
    mask = mask.expand(b, mg, r, s)
    pr, ps = (-r) % Q_TILE, (-s) % K_TILE
    nq, nk = (r + pr) // Q_TILE, (s + ps) // K_TILE
    qf, kf, vf = _pad_rows(q.float(), pr), _pad_rows(k.float(), ps), _pad_rows(v.float(), ps)
    # [B, mG, nq, nk, Qt, Kt], laid out as the scores
    mf = (F.pad(mask, (0, ps, 0, pr)) if pr or ps else mask).reshape(b, mg, nq, Q_TILE, nk, K_TILE)
    mf = mf.transpose(3, 4).contiguous()
    q_tiles = qf.reshape(b, g, nq, 1, Q_TILE, d).expand(b, g, nq, nk, Q_TILE, d).reshape(-1, Q_TILE, d)
    k_tiles = kf.reshape(b, g, 1, nk, K_TILE, d).expand(b, g, nq, nk, K_TILE, d).reshape(-1, K_TILE, d)
    v_tiles = vf.reshape(b, g, 1, nk, K_TILE, dv).expand(b, g, nq, nk, K_TILE, dv).reshape(-1, K_TILE, dv)
    scores = (torch.bmm(q_tiles, k_tiles.transpose(1, 2)) * scale).view(b, g, nq, nk, Q_TILE, K_TILE)
    scores = scores.masked_fill(~mf, float("-inf"))
    m = scores.amax(dim=(3, 5), keepdim=True)                                   # [B, G, nq, 1, Qt, 1]
    # NOTE: a row that sees no key has m = -inf; shift by 0 there (its weights are all 0)
    shift = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = torch.exp(scores - shift)                                               # [B, G, nq, nk, Qt, Kt]
    l = tree_sum(p.sum(-1, keepdim=True), 3)                                    # [B, G, nq, 1, Qt, 1]
    acc = tree_sum(torch.bmm(p.reshape(-1, Q_TILE, K_TILE), v_tiles).view(b, g, nq, nk, Q_TILE, dv), 3)
    out = acc / torch.where(l == 0, torch.ones_like(l), l)                      # [B, G, nq, 1, Qt, Dv]
    return out.view(b, g, nq * Q_TILE, dv)[:, :, :r].to(q.dtype)


def _pad_rows(x: torch.Tensor, pad: int) -> torch.Tensor:
    """x [..., n, w] -> [..., n + pad, w], zero rows appended (x itself when pad is 0)."""
    return F.pad(x, (0, 0, 0, pad)) if pad else x
