"""Fused MoE (Triton): two grouped-GEMM kernels over the (token, k) pairs aligned by expert in blocks.

1. w13: h = silu(x @ w13[e, :I].T) * (x @ w13[e, I:].T) for each pair's token and expert, SiLU-and-
   multiply fused, stored per pair [P, I] in x's dtype.
2. w2: out[token] += topk_weight * (h @ w2[e].T), the weight and the sum over k fused (atomic adds into
   an fp32 [N, H] buffer), cast to x's dtype at the end.
gpt-oss (constexpr flags, off by default): biases b13 / b2 added to the fp32 accumulators right after
each GEMM, and the clamped SwiGLU (rollout.exact.experts.swiglu) in place of silu(gate) * up.
Only the experts this module holds take part (expert parallel: other ranks add theirs). Products
accumulate in fp32 (fp32 inputs: IEEE fp32 dots, no TF32). No host sync: runs inside CUDA graphs.
FusedExperts (rollout/models/moe/) stays the reference; this is its "triton" impl.

Triton is imported by this module: import it only where the triton backend is chosen.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from rollout.exact.experts import SWIGLU_ALPHA
from rollout.models.kernels.moe_align import ExpertBlocks


@triton.jit
def _block_rows(pairs_ptr, num_pairs, top_k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's block: its pairs [M] (token * top_k + k), which are real (not padding), their
    tokens, and its output columns [N]."""
    pair = tl.load(pairs_ptr + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    n = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    return pair, pair < num_pairs, pair // top_k, n


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr, ROWWISE: tl.constexpr = False):
    if ROWWISE:
        # NOTE: the interpreter's tl.dot is numpy's BLAS, whose result for a row depends on the row's
        # place in the block; a broadcast product summed over K is the same for every row
        return acc + tl.sum(a[:, :, None] * b[None, :, :], axis=1)
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _w13_kernel(x_ptr, w_ptr, h_ptr, pairs_ptr, block_expert_ptr, b_ptr,
                num_pairs, top_k, hidden, inter,
                stride_x, stride_we, stride_wn, stride_wk, stride_h, stride_be, limit, alpha,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
                ROWWISE: tl.constexpr = False, HAS_BIAS: tl.constexpr = False, CLAMPED: tl.constexpr = False):
    expert = tl.load(block_expert_ptr + tl.program_id(0))
    if expert < 0:
        return
    pair, row_ok, token, n = _block_rows(pairs_ptr, num_pairs, top_k, BLOCK_M, BLOCK_N)   # n: rows of w13's halves
    n_ok = n < inter
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K).to(tl.int64)
        k_ok = kk < hidden
        a = tl.load(x_ptr + token[:, None] * stride_x + kk[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)                                                          # [M, K]
        w_mask = k_ok[:, None] & n_ok[None, :]
        w_gate = tl.load(w_base + n[None, :] * stride_wn + kk[:, None] * stride_wk, mask=w_mask, other=0.0)
        w_up = tl.load(w_base + (n + inter)[None, :] * stride_wn + kk[:, None] * stride_wk, mask=w_mask,
                       other=0.0)                                                       # [K, N]
        acc_gate = _dot(a, w_gate, acc_gate, IEEE, ROWWISE)
        acc_up = _dot(a, w_up, acc_up, IEEE, ROWWISE)
    if HAS_BIAS:
        b_base = b_ptr + expert.to(tl.int64) * stride_be
        acc_gate += tl.load(b_base + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        acc_up += tl.load(b_base + inter + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if CLAMPED:
        gate = tl.minimum(acc_gate, limit)
        up = tl.minimum(tl.maximum(acc_up, -limit), limit)
        h = gate * (1.0 / (1.0 + tl.exp(-(alpha * gate)))) * (up + 1.0)                 # gpt-oss clamped SwiGLU
    else:
        h = acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up                              # silu(gate) * up
    tl.store(h_ptr + pair[:, None] * stride_h + n[None, :], h.to(h_ptr.dtype.element_ty),
             mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _w2_block(h_ptr, w_ptr, pairs_ptr, block_expert_ptr, num_pairs, top_k, hidden, inter,
              stride_h, stride_we, stride_wn, stride_wk,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
              ROWWISE: tl.constexpr):
    """This program's block of h @ w2[expert].T in fp32 (its expert >= 0) -> pairs [M], which are
    real [M], tokens [M], hidden columns [N], columns in range [N], acc [M, N]."""
    expert = tl.load(block_expert_ptr + tl.program_id(0))
    pair, row_ok, token, n = _block_rows(pairs_ptr, num_pairs, top_k, BLOCK_M, BLOCK_N)   # n: hidden columns
    n_ok = n < hidden
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K).to(tl.int64)
        k_ok = kk < inter
        a = tl.load(h_ptr + pair[:, None] * stride_h + kk[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)                    # [M, K]
        w = tl.load(w_base + n[None, :] * stride_wn + kk[:, None] * stride_wk,
                    mask=k_ok[:, None] & n_ok[None, :], other=0.0)                      # [K, N]
        acc = _dot(a, w, acc, IEEE, ROWWISE)
    return pair, row_ok, token, n, n_ok, acc


@triton.jit
def _w2_kernel(h_ptr, w_ptr, out_ptr, pairs_ptr, block_expert_ptr, weights_ptr, b_ptr,
               num_pairs, top_k, hidden, inter,
               stride_h, stride_we, stride_wn, stride_wk, stride_out, stride_be,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
               HAS_BIAS: tl.constexpr = False):
    expert = tl.load(block_expert_ptr + tl.program_id(0))
    if expert < 0:
        return
    pair, row_ok, token, n, n_ok, acc = _w2_block(h_ptr, w_ptr, pairs_ptr, block_expert_ptr, num_pairs, top_k,
                                                  hidden, inter, stride_h, stride_we, stride_wn, stride_wk,
                                                  BLOCK_M, BLOCK_N, BLOCK_K, IEEE, False)
    if HAS_BIAS:
        acc += tl.load(b_ptr + expert.to(tl.int64) * stride_be + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    weight = tl.load(weights_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)        # [M]
    # NOTE: the k pairs of one token sit in different blocks: atomic adds, so on a GPU the order of
    # the (at most top_k) fp32 additions per element varies from run to run (as torch's index_add_).
    # Relaxed: nothing reads `out` before the kernel ends, so no ordering against other memory is needed.
    tl.atomic_add(out_ptr + token[:, None] * stride_out + n[None, :], acc * weight[:, None],
                  mask=row_ok[:, None] & n_ok[None, :], sem="relaxed")


def _block_m(num_pairs: int, num_experts: int) -> int:
    """Rows per block: small when each expert gets few rows (decode), so less of a block is padding."""
    per_expert = num_pairs / max(1, min(num_experts, num_pairs))
    return 16 if per_expert <= 16 else 32 if per_expert <= 48 else 64


def _tile(device: torch.device, n: int, k: int, ieee: bool) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K) for an output width n and a reduction length k."""
    if device.type == "cpu":
        # NOTE: the interpreter's cost is per op, not per element: whole rows in one step.
        return min(256, max(16, triton.next_power_of_2(n))), min(256, max(16, triton.next_power_of_2(k)))
    return min(64, max(16, triton.next_power_of_2(n))), 32 if ieee else 64


def check_biases(w13: torch.Tensor, w2: torch.Tensor, b13: Optional[torch.Tensor],
                 b2: Optional[torch.Tensor]) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """b13 [E, 2I] and b2 [E, H] checked against w13 [E, 2I, H] / w2 [E, H, I] (shape and dtype);
    contiguous rows."""
    assert b13 is None or (b13.shape == w13.shape[:2] and b13.dtype == w13.dtype), (b13.shape, b13.dtype, w13.shape)
    assert b2 is None or (b2.shape == w2.shape[:2] and b2.dtype == w2.dtype), (b2.shape, b2.dtype, w2.shape)
    return (b13 if b13 is None or b13.stride(1) == 1 else b13.contiguous(),
            b2 if b2 is None or b2.stride(1) == 1 else b2.contiguous())


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, expert_lo: int, *, b13: Optional[torch.Tensor] = None,
              b2: Optional[torch.Tensor] = None, swiglu_limit: Optional[float] = None,
              swiglu_alpha: float = SWIGLU_ALPHA) -> torch.Tensor:
    """x [N, H], w13 [E, 2I, H] (gate rows then up rows), w2 [E, H, I] for the global experts
    [expert_lo, expert_lo + E), topk_weights float32 [N, K], topk_ids int64 [N, K] (global ids)
    -> [N, H] in x.dtype: the sum over k of topk_weight * expert(x) over the pairs whose expert is here.
    b13 [E, 2I] (gate then up), b2 [E, H]: biases after each GEMM; swiglu_limit: the clamped SwiGLU
    with swiglu_alpha (None: silu(gate) * up), as rollout.exact.experts.swiglu."""
    n, hidden = x.shape
    num_experts, inter = w13.shape[0], w2.shape[2]
    assert w13.shape == (num_experts, 2 * inter, hidden) and w2.shape == (num_experts, hidden, inter), \
        (x.shape, w13.shape, w2.shape)
    b13, b2 = check_biases(w13, w2, b13, b2)
    num_pairs = topk_ids.numel()
    if num_pairs == 0 or num_experts == 0:
        return torch.zeros_like(x)
    x = x.contiguous()
    blocks = ExpertBlocks.build(topk_ids, expert_lo, num_experts, _block_m(num_pairs, num_experts))
    bm = blocks.block_m
    num_blocks = blocks.block_expert.numel()
    ieee = x.dtype == torch.float32
    h = torch.empty((num_pairs, inter), dtype=x.dtype, device=x.device)             # [P, I] per pair
    block_n, block_k = _tile(x.device, inter, hidden, ieee)
    _w13_kernel[(num_blocks, triton.cdiv(inter, block_n))](
        x, w13, h, blocks.pairs, blocks.block_expert, b13 if b13 is not None else w13,
        num_pairs, topk_ids.shape[1], hidden, inter,
        x.stride(0), w13.stride(0), w13.stride(1), w13.stride(2), h.stride(0),
        b13.stride(0) if b13 is not None else 0, float(swiglu_limit or 0.0), float(swiglu_alpha),
        BLOCK_M=bm, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=ieee,
        HAS_BIAS=b13 is not None, CLAMPED=swiglu_limit is not None)
    out = torch.zeros((n, hidden), dtype=torch.float32, device=x.device)            # [N, H]
    block_n, block_k = _tile(x.device, hidden, inter, ieee)
    _w2_kernel[(num_blocks, triton.cdiv(hidden, block_n))](
        h, w2, out, blocks.pairs, blocks.block_expert, topk_weights.contiguous(), b2 if b2 is not None else w2,
        num_pairs, topk_ids.shape[1], hidden, inter,
        h.stride(0), w2.stride(0), w2.stride(1), w2.stride(2), out.stride(0), b2.stride(0) if b2 is not None else 0,
        BLOCK_M=bm, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=ieee, HAS_BIAS=b2 is not None)
    return out.to(x.dtype)
