"""Batch-invariant matrix products: every GEMM runs in row tiles of one fixed shape.

NOTE: torch's CPU GEMM picks its blocking (and a GEMV path for one row) by the number of rows M,
so `(x[:M] @ W.T)[:1]` differs in the last bits from `x[:1] @ W.T` for most M. Here the rows are
padded to a multiple of ROW_TILE and multiplied as a batch of [ROW_TILE, K] x [K, N] products of
one shape, whatever the batch: a row's result depends only on the row (tests/test_exact_ops.py
checks every row position of a tile and many M).
"""
from __future__ import annotations

import torch

ROW_TILE = 32
# NOTE: with fewer than 8 output columns (a shared-expert gate: N = 1) bmm takes a path whose row
# results depend on the number of tiles; weights are padded to a multiple of 8 rows.
COL_MULTIPLE = 8


def _pad_rows(x: torch.Tensor, tile: int) -> torch.Tensor:
    """x [M, K] -> [ceil(M / tile) * tile, K], zero rows appended."""
    pad = (-x.shape[0]) % tile
    return torch.cat((x, x.new_zeros(pad, x.shape[1]))) if pad else x


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), batch-invariant: x [..., K], weight [N, K], bias [N] -> [..., N]."""
    lead, k = x.shape[:-1], x.shape[-1]
    n = weight.shape[0]
    rows = x.reshape(-1, k)
    m = rows.shape[0]
    if m == 0:
        out = x.new_zeros(0, n)
    else:
        tiles = _pad_rows(rows, ROW_TILE).view(-1, ROW_TILE, k)                 # [T, ROW_TILE, K]
        w = _pad_rows(weight, COL_MULTIPLE)                                     # [N', K]
        out = torch.bmm(tiles, w.t().expand(tiles.shape[0], k, w.shape[0]))[..., :n].reshape(-1, n)[:m]  # [M, N]
    if bias is not None:
        out = out + bias
    return out.reshape(*lead, n)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Per group g: x[g] @ weight[g].T, batch-invariant. x [G, M, K], weight [G, N, K] -> [G, M, N]."""
    g, m, k = x.shape
    n = weight.shape[1]
    if m == 0:
        return x.new_zeros(g, 0, n)
    pad = (-m) % ROW_TILE
    xp = torch.cat((x, x.new_zeros(g, pad, k)), dim=1) if pad else x
    tiles_per_group = xp.shape[1] // ROW_TILE
    pad_n = (-n) % COL_MULTIPLE
    wp = torch.cat((weight, weight.new_zeros(g, pad_n, k)), dim=1) if pad_n else weight
    w = wp.transpose(1, 2)[:, None].expand(g, tiles_per_group, k, n + pad_n).reshape(-1, k, n + pad_n)
    out = torch.bmm(xp.reshape(-1, ROW_TILE, k), w)                             # [G * tiles, ROW_TILE, N']
    return out.view(g, -1, n + pad_n)[:, :m, :n]

