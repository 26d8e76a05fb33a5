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

Attention sinks (gpt-oss): a row's sink logit joins its softmax denominator and adds no value. It
enters the row's maximum (exact in any order) and its exp(sink - max) is added once to the row's
key sum after the tree, so a row's bits still depend only on its own keys and its own sink.
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


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
              sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, G, R, D], k [B, G, S, D], v [B, G, S, Dv], mask bool [B, 1 or G, R or 1, S] (True =
    attend; key s of request b is its position s; R 1: the same keys for every row) -> [B, G, R, Dv]
    in q's dtype, computed in fp32. sinks: each row's sink logit, broadcastable to [B, G, R] (the
    caller maps query heads to rows: [1, G, 1] for one head per group, [1, kvH, E*grp] for a kv
    head's (token, head) rows), taken in fp32; None: no sinks.

    Rows whose mask admits no key get 0."""
    b, g, r, d = q.shape
    s, dv = k.shape[2], v.shape[-1]
    pr, ps = (-r) % Q_TILE, (-s) % K_TILE
    nq, nk = (r + pr) // Q_TILE, (s + ps) // K_TILE
    qf, kf, vf = _pad_rows(q.float(), pr), _pad_rows(k.float(), ps), _pad_rows(v.float(), ps)
    # heads first: [G, B, nq, nk, Qt, Kt], each head's tiles one bmm
    scores = torch.stack([torch.bmm(qf[:, h].reshape(b, nq, 1, Q_TILE, d).expand(b, nq, nk, Q_TILE, d)
                                    .reshape(-1, Q_TILE, d), _tiles(kf[:, h], nq, nk).transpose(1, 2))
                          for h in range(g)])
    scores = (scores * scale).view(g, b, nq, nk, Q_TILE, K_TILE)
    scores = scores.masked_fill(~_score_mask(mask, nq, nk, pr, ps).transpose(0, 1), float("-inf"))
    m = scores.amax(dim=(3, 5), keepdim=True)                                   # [G, B, nq, 1, Qt, 1]
    if sinks is not None:
        sink = _row_sinks(sinks, b, g, r, pr)                                   # [G, B, nq, 1, Qt, 1]
        m = torch.maximum(m, sink)
    # NOTE: a row that sees no key (and has no sink) has m = -inf; shift by 0 there (its weights are all 0)
    shift = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = torch.exp(scores - shift)                                               # [G, B, nq, nk, Qt, Kt]
    l = tree_sum(p.sum(-1, keepdim=True), 3)                                    # [G, B, nq, 1, Qt, 1]
    if sinks is not None:
        l = l + torch.exp(sink - shift)
    pv = torch.stack([torch.bmm(p[h].view(-1, Q_TILE, K_TILE), _tiles(vf[:, h], nq, nk)) for h in range(g)])
    acc = tree_sum(pv.view(g, b, nq, nk, Q_TILE, dv), 3)
    out = acc / torch.where(l == 0, torch.ones_like(l), l)                      # [G, B, nq, 1, Qt, Dv]
    return out.view(g, b, nq * Q_TILE, dv)[:, :, :r].transpose(0, 1).to(q.dtype)


def _row_sinks(sinks: torch.Tensor, b: int, g: int, r: int, pr: int) -> torch.Tensor:
    """sinks broadcastable to [B, G, R] -> fp32 [G, B, nq, 1, Q_TILE, 1] (padded rows' sinks 0)."""
    rows = _pad_rows(sinks.float().expand(b, g, r)[..., None], pr)              # [B, G, nq * Qt, 1]
    return rows.reshape(b, g, (r + pr) // Q_TILE, 1, Q_TILE, 1).transpose(0, 1)   # NOTE: B may be 0


def _tiles(x: torch.Tensor, nq: int, nk: int) -> torch.Tensor:
    """One head's keys or values x [B, S, w] (S = nk * K_TILE) -> [B * nq * nk, K_TILE, w], key
    tile j of request b repeated for each of its nq query tiles. With one query tile and rows of
    a request evenly strided (contiguous x, or a gathered cache's [B, S, 2, kvH, D] slice) this is
    a view: the bmm reads the cache's rows where they lie (the same bits as from a copy)."""
    bx, _, w = x.shape
    if nq == 1:
        return x.reshape(bx * nk, K_TILE, w)
    return x.reshape(bx, 1, nk, K_TILE, w).expand(bx, nq, nk, K_TILE, w).reshape(-1, K_TILE, w)


def _score_mask(mask: torch.Tensor, nq: int, nk: int, pr: int, ps: int) -> torch.Tensor:
    """mask [B, mG, R or 1, S] -> a view (no copy of the cells) [B, mG, nq or 1, nk, Qt or 1, Kt]
    that broadcasts against the scores; padded keys masked, padded rows as any (their output is
    dropped, and every row is computed on its own)."""
    bm, mg, rm, _ = mask.shape
    mask = F.pad(mask, (0, ps, 0, pr if rm > 1 else 0)) if ps or (pr and rm > 1) else mask
    if rm == 1:
        return mask.reshape(bm, mg, 1, 1, nk, K_TILE).transpose(3, 4)
    return mask.reshape(bm, mg, nq, Q_TILE, nk, K_TILE).transpose(3, 4)


def _pad_rows(x: torch.Tensor, pad: int) -> torch.Tensor:
    """x [..., n, w] -> [..., n + pad, w], zero rows appended (x itself when pad is 0)."""
    return F.pad(x, (0, 0, 0, pad)) if pad else x
