"""Batch-invariant fused experts: per-expert GEMMs in fixed row tiles, the k experts summed in order.

Each (token, expert) row is computed in a tile of ROW_TILE rows that belong to one expert (rows of
an expert padded to whole tiles), so its value does not depend on how many other rows the expert
got; the k results of a token are then added in top-k slot order (slot 0 first), never by
index_add_ or atomics, whose order follows the batch.
"""
from __future__ import annotations

from typing import Optional

import torch

from rollout.exact.matmul import ROW_TILE
from rollout.exact.pointwise import sigmoid, silu

SWIGLU_ALPHA = 1.702    # gpt-oss's default alpha of the clamped SwiGLU


def swiglu(gate: torch.Tensor, up: torch.Tensor, *, limit: Optional[float] = None,
           alpha: float = SWIGLU_ALPHA) -> torch.Tensor:
    """The experts' activation, elementwise (batch-invariant: exp-based sigmoid and silu).
    limit None: silu(gate) * up. A float: gpt-oss's clamped form, gate clamped above at limit, up to
    [-limit, limit], then gate * sigmoid(alpha * gate) * (up + 1)."""
    if limit is None:
        return silu(gate) * up
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return gate * sigmoid(alpha * gate) * (up + 1)


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, first_id: int = 0, per_slot: bool = False, *,
                  b13: Optional[torch.Tensor] = None, b2: Optional[torch.Tensor] = None,
                  swiglu_limit: Optional[float] = None, swiglu_alpha: float = SWIGLU_ALPHA) -> torch.Tensor:
    """x [N, H]; w13 [E, 2I, H] (gate rows then up rows) and w2 [E, H, I] of the experts
    first_id .. first_id + E - 1; topk_weights float32 [N, K], topk_ids int64 [N, K] (global ids)
    -> [N, H] in x's dtype: sum over slots j of weight[n, j] * expert(x[n]) for the held experts
    (slots routed elsewhere add nothing). per_slot: return the terms [N, K, H] unsummed instead
    (expert parallel: the ranks' terms are added slot by slot, each slot has one nonzero term, then
    sum_slots adds the k slots in the same order as without expert parallelism).
    b13 [E, 2I] (gate biases then up biases), b2 [E, H]: added right after their GEMM (gpt-oss).
    swiglu_limit / swiglu_alpha: the activation (see swiglu; None: silu(gate) * up)."""
    n, k = topk_ids.shape
    e = w13.shape[0]
    hidden = x.shape[1]
    assert b13 is None or (b13.shape == (e, w13.shape[1]) and b13.dtype == w13.dtype), (b13.shape, b13.dtype, w13.shape)
    assert b2 is None or (b2.shape == (e, hidden) and b2.dtype == w2.dtype), (b2.shape, b2.dtype, w2.shape)
    flat = topk_ids.reshape(-1) - first_id                                     # [N*K]
    held = (flat >= 0) & (flat < e)
    group = torch.where(held, flat, e)                                         # not held: last
    order = torch.argsort(group, stable=True)                                  # [N*K] grouped by expert
    counts = torch.bincount(group, minlength=e + 1)[:e]                        # [E]
    rows = int(counts.sum())
    terms = x.new_zeros(n * k, hidden)                                         # [N*K, H]
    if rows:
        order = order[:rows]                                                   # held rows only
        tiles = (counts + ROW_TILE - 1) // ROW_TILE                            # [E] tiles per expert
        # NOTE: when no expert needs two tiles (a decode batch) every expert gets exactly one, and
        # the products take the weights as they are (no per-tile copy of them): each tile is the
        # same [ROW_TILE, H] x [H, 2I] product either way, so the same bits
        one_each = int(tiles.max()) <= 1
        if one_each:
            tiles = torch.ones_like(tiles)
        padded_start = (torch.cumsum(tiles, 0) - tiles) * ROW_TILE             # [E] first padded row
        start = torch.cumsum(counts, 0) - counts                               # [E] first sorted row
        expert = group.index_select(0, order)                                  # [rows]
        slot = padded_start.index_select(0, expert) + torch.arange(rows, device=x.device) - start.index_select(0, expert)
        total = int(tiles.sum()) * ROW_TILE
        xp = x.new_zeros(total, hidden).index_copy_(0, slot, x.index_select(0, order // k))
        if one_each:
            w_up, w_down, b_up, b_down = w13, w2, b13, b2
        else:
            tile_expert = torch.repeat_interleave(torch.arange(e, device=x.device), tiles)   # [tiles]
            w_up, w_down = w13.index_select(0, tile_expert), w2.index_select(0, tile_expert)
            b_up = b13.index_select(0, tile_expert) if b13 is not None else None            # [tiles, 2I]
            b_down = b2.index_select(0, tile_expert) if b2 is not None else None            # [tiles, H]
        gate_up = torch.bmm(xp.view(-1, ROW_TILE, hidden), w_up.transpose(1, 2))   # [tiles, ROW_TILE, 2I]
        if b_up is not None:
            gate_up = gate_up + b_up[:, None, :]
        gate, up = gate_up.chunk(2, dim=-1)                                    # [tiles, ROW_TILE, I]
        y = torch.bmm(swiglu(gate, up, limit=swiglu_limit, alpha=swiglu_alpha),
                      w_down.transpose(1, 2))                                  # [tiles, ROW_TILE, H]
        if b_down is not None:
            y = y + b_down[:, None, :]
        y = y.view(total, hidden).index_select(0, slot)                        # [rows, H] sorted order
        y = y * topk_weights.reshape(-1).index_select(0, order)[:, None].to(y.dtype)
        terms.index_copy_(0, order, y)
    terms = terms.view(n, k, hidden)
    return terms if per_slot else sum_slots(terms)


def sum_slots(terms: torch.Tensor) -> torch.Tensor:
    """terms [N, K, H] -> [N, H]: slot 0 + slot 1 + ... in that order (elementwise adds only)."""
    out = terms[:, 0]
    for j in range(1, terms.shape[1]):
        out = out + terms[:, j]
    return out
