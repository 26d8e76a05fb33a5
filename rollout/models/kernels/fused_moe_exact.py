"""Batch-invariant fused MoE (Triton): the experts of deterministic inference on the triton backend.

The same two grouped GEMMs as rollout/models/kernels/fused_moe.py, made batch-invariant by construction:
- fixed tiles: BLOCK_M = EXACT_BLOCK_M rows per program whatever the batch, BLOCK_N / BLOCK_K fixed by
  the layer's shapes only, no split-K: each output element is one fp32 dot product over the whole
  reduction, folded BLOCK_K at a time from element 0, in one compiled kernel for every batch;
- no atomics: the w2 kernel writes each (token, slot) term, rounded to x's dtype and times its routing
  weight (as rollout.exact.fused_experts), to its own row of a [N, K, H] buffer; the k slots are then
  added in slot order by rollout.exact.sum_slots. A row's bits depend only on its token, its expert
  and its weight, never on which other rows share its block or how many blocks there are.
Not bitwise equal to rollout.exact.fused_experts (torch's GEMMs sum in another order, and h is made
in fp32 here): close within fp32 rounding. No host sync: runs inside CUDA graphs.
gpt-oss (constexpr flags, off by default): b13 added to the fp32 accumulators before the clamped
SwiGLU, b2 added to the rounded w2 product before the routing weight (as rollout.exact.fused_experts).

Triton is imported by this module: import it only where the triton backend is chosen.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from rollout.exact import sum_slots
from rollout.exact.experts import SWIGLU_ALPHA
from rollout.models.kernels.moe_align import ExpertBlocks
from rollout.models.kernels.fused_moe import _tile, _w13_kernel, _w2_block, check_biases

EXACT_BLOCK_M = 16   # (token, slot) rows per program, whatever the batch


@triton.jit
def _w2_terms_kernel(h_ptr, w_ptr, terms_ptr, pairs_ptr, block_expert_ptr, weights_ptr, b_ptr,
                     num_pairs, top_k, hidden, inter,
                     stride_h, stride_we, stride_wn, stride_wk, stride_t, stride_be,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
                     ROWWISE: tl.constexpr, HAS_BIAS: tl.constexpr = False):
    expert = tl.load(block_expert_ptr + tl.program_id(0))
    if expert < 0:
        return
    pair, row_ok, _, n, n_ok, acc = _w2_block(h_ptr, w_ptr, pairs_ptr, block_expert_ptr, num_pairs, top_k,
                                              hidden, inter, stride_h, stride_we, stride_wn, stride_wk,
                                              BLOCK_M, BLOCK_N, BLOCK_K, IEEE, ROWWISE)
    out_ty = terms_ptr.dtype.element_ty
    weight = tl.load(weights_ptr + pair, mask=row_ok, other=0.0).to(out_ty)            # [M]
    y = acc.to(out_ty)
    if HAS_BIAS:
        y = (y + tl.load(b_ptr + expert.to(tl.int64) * stride_be + n, mask=n_ok, other=0.0)[None, :]).to(out_ty)
    term = y * weight[:, None]                                                          # as exact.fused_experts
    # NOTE: row `pair` = token * top_k + slot of the [N, K, H] buffer: one writer per element
    tl.store(terms_ptr + pair[:, None] * stride_t + n[None, :], term.to(out_ty),
             mask=row_ok[:, None] & n_ok[None, :])


def fused_moe_exact(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor, expert_lo: int, per_slot: bool = False, *,
                    b13: Optional[torch.Tensor] = None, b2: Optional[torch.Tensor] = None,
                    swiglu_limit: Optional[float] = None, swiglu_alpha: float = SWIGLU_ALPHA) -> torch.Tensor:
    """x [N, H], w13 [E, 2I, H] (gate rows then up rows), w2 [E, H, I] for the global experts
    [expert_lo, expert_lo + E), topk_weights float32 [N, K], topk_ids int64 [N, K] (global ids)
    -> [N, H] in x.dtype: slot 0 + slot 1 + ... of topk_weight * expert(x) (slots routed elsewhere
    add 0). per_slot: the terms [N, K, H] unsummed (expert parallel: ranks add them slot by slot).
    b13 [E, 2I] (gate then up), b2 [E, H]: biases after each GEMM; swiglu_limit: the clamped SwiGLU
    with swiglu_alpha (None: silu(gate) * up), as rollout.exact.fused_experts."""
    n, hidden = x.shape
    top_k = topk_ids.shape[1]
    num_experts, inter = w13.shape[0], w2.shape[2]
    assert w13.shape == (num_experts, 2 * inter, hidden) and w2.shape == (num_experts, hidden, inter), \
        (x.shape, w13.shape, w2.shape)
    b13, b2 = check_biases(w13, w2, b13, b2)
    num_pairs = topk_ids.numel()
    terms = torch.zeros((n, top_k, hidden), dtype=x.dtype, device=x.device)         # [N, K, H]
    if num_pairs and num_experts:
        x = x.contiguous()
        blocks = ExpertBlocks.build(topk_ids, expert_lo, num_experts, EXACT_BLOCK_M)
        num_blocks = blocks.block_expert.numel()
        ieee = x.dtype == torch.float32
        rowwise = x.device.type == "cpu"    # the interpreter: see moe_triton._dot
        h = torch.empty((num_pairs, inter), dtype=x.dtype, device=x.device)         # [P, I] per pair
        block_n, block_k = _tile(x.device, inter, hidden, ieee)
        _w13_kernel[(num_blocks, triton.cdiv(inter, block_n))](
            x, w13, h, blocks.pairs, blocks.block_expert, b13 if b13 is not None else w13,
            num_pairs, top_k, hidden, inter,
            x.stride(0), w13.stride(0), w13.stride(1), w13.stride(2), h.stride(0),
            b13.stride(0) if b13 is not None else 0, float(swiglu_limit or 0.0), float(swiglu_alpha),
            BLOCK_M=EXACT_BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=ieee, ROWWISE=rowwise,
            HAS_BIAS=b13 is not None, CLAMPED=swiglu_limit is not None)
        flat = terms.view(num_pairs, hidden)                                         # [P, H]
        block_n, block_k = _tile(x.device, hidden, inter, ieee)
        _w2_terms_kernel[(num_blocks, triton.cdiv(hidden, block_n))](
            h, w2, flat, blocks.pairs, blocks.block_expert, topk_weights.contiguous(), b2 if b2 is not None else w2,
            num_pairs, top_k, hidden, inter,
            h.stride(0), w2.stride(0), w2.stride(1), w2.stride(2), flat.stride(0),
            b2.stride(0) if b2 is not None else 0,
            BLOCK_M=EXACT_BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=ieee, ROWWISE=rowwise,
            HAS_BIAS=b2 is not None)
    return terms if per_slot else sum_slots(terms)
