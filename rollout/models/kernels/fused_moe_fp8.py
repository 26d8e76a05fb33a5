"""Fused MoE with block-scaled FP8 experts, W8A8 (Triton): the grouped GEMMs of fused_moe.py over the
same expert-aligned blocks (moe_align.ExpertBlocks), with float8_e4m3fn weights and block scales.

1. x is quantized per token group of bk (fp8_gemm.quantize_fp8_per_token_group).
2. gate_up: for each pair (token * top_k + slot) gate and up by the block-scaled GEMM (fp8_gemm), then
   h = silu(gate) * up from the fp32 accumulators, quantized per group of bk in the same program (its
   N tile is one group) -> h_fp8 [P, I], h_scales [P, ceil(I / bk)].
3. down: h @ w2[e].T block-scaled; default: topk_weight * y atomically added into an fp32 [N, H]
   buffer (on a GPU the order of the <= top_k adds per element varies), cast to x's dtype at the end.
   deterministic: EXACT_BLOCK_M rows per program whatever the batch, no atomics: each (token, slot)
   term, y rounded to x's dtype times its weight, to its own row of [N, K, H], then the slots added in
   order (rollout.exact.sum_slots), as fused_moe_exact.py.
The definitions: fp8_reference.fused_moe_fp8_reference and its two halves. No host sync (CUDA graphs).

Triton is imported by this module: import it only where the triton backend is chosen.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from rollout.exact import sum_slots
from rollout.models.kernels.fp8_gemm import (EXACT_BLOCK_M, _dot8, _quantize_rows, check_block, num_warps,
                                             quantize_fp8_per_token_group)
from rollout.models.kernels.fp8_reference import DEFAULT_BLOCK, FP8_DTYPE, FP8_EPS, FP8_MAX, cdiv, check_moe_fp8
from rollout.models.kernels.fused_moe import _block_m, _block_rows
from rollout.models.kernels.moe_align import ExpertBlocks


@triton.jit
def _gate_up_kernel(xq_ptr, xs_ptr, w_ptr, ws_ptr, hq_ptr, hs_ptr, pairs_ptr, block_expert_ptr,
                    num_pairs, top_k, hidden, inter, half_blocks, group_n, eps,
                    stride_xq, stride_xs, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
                    stride_hq, stride_hs,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROWWISE: tl.constexpr,
                    FP8_MAX: tl.constexpr):
    # NOTE: BLOCK_N == BLOCK_K == bk: this program's columns of h are one quantization group
    expert = tl.load(block_expert_ptr + tl.program_id(0))
    if expert < 0:
        return
    pair, row_ok, token, n = _block_rows(pairs_ptr, num_pairs, top_k, BLOCK_M, BLOCK_N)   # n: rows of each half
    n_ok = n < inter
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    s_base = ws_ptr + expert.to(tl.int64) * stride_se
    s_gate = s_base + (n // group_n) * stride_sn                                       # [N] the gate half's blocks
    s_up = s_base + (half_blocks + n // group_n) * stride_sn                           # [N] then the up half's
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K).to(tl.int64)
        k_ok = kk < hidden
        kb = k0 // BLOCK_K
        a = tl.load(xq_ptr + token[:, None] * stride_xq + kk[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)                                                          # [M, K] fp8
        a_s = tl.load(xs_ptr + token * stride_xs + kb, mask=row_ok, other=0.0)         # [M]
        w_mask = k_ok[:, None] & n_ok[None, :]
        w_gate = tl.load(w_base + n[None, :] * stride_wn + kk[:, None] * stride_wk, mask=w_mask, other=0.0)
        w_up = tl.load(w_base + (n + inter)[None, :] * stride_wn + kk[:, None] * stride_wk, mask=w_mask,
                       other=0.0)                                                       # [K, N] fp8
        sg = tl.load(s_gate + kb * stride_sk, mask=n_ok, other=0.0)                     # [N]
        su = tl.load(s_up + kb * stride_sk, mask=n_ok, other=0.0)
        acc_gate += _dot8(a, w_gate, ROWWISE) * a_s[:, None] * sg[None, :]
        acc_up += _dot8(a, w_up, ROWWISE) * a_s[:, None] * su[None, :]
    # silu(gate) * up; NOTE: IEEE division (Triton's fp32 `/` is div.full, 2 ulp)
    h = tl.math.div_rn(acc_gate, 1.0 + tl.exp(-acc_gate)) * acc_up
    h = tl.where(n_ok[None, :], h, 0.0)                                                # a partial last group
    hq, hs = _quantize_rows(h, eps, FP8_MAX)
    tl.store(hq_ptr + pair[:, None] * stride_hq + n[None, :], hq, mask=row_ok[:, None] & n_ok[None, :])
    tl.store(hs_ptr + pair * stride_hs + tl.program_id(1), hs, mask=row_ok)


@triton.jit
def _down_block(hq_ptr, hs_ptr, w_ptr, ws_ptr, pairs_ptr, block_expert_ptr, num_pairs, top_k, hidden, inter,
                group_n, stride_hq, stride_hs, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROWWISE: tl.constexpr):
    """This program's block of h @ w2[expert].T, block-scaled, in fp32 (its expert >= 0) -> pairs [M],
    which are real [M], tokens [M], hidden columns [N], columns in range [N], acc [M, N]."""
    expert = tl.load(block_expert_ptr + tl.program_id(0))
    pair, row_ok, token, n = _block_rows(pairs_ptr, num_pairs, top_k, BLOCK_M, BLOCK_N)   # n: hidden columns
    n_ok = n < hidden
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    s_rows = ws_ptr + expert.to(tl.int64) * stride_se + (n // group_n) * stride_sn     # [N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K).to(tl.int64)
        k_ok = kk < inter
        kb = k0 // BLOCK_K
        a = tl.load(hq_ptr + pair[:, None] * stride_hq + kk[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)                                                          # [M, K] fp8
        a_s = tl.load(hs_ptr + pair * stride_hs + kb, mask=row_ok, other=0.0)          # [M]
        w = tl.load(w_base + n[None, :] * stride_wn + kk[:, None] * stride_wk, mask=k_ok[:, None] & n_ok[None, :],
                    other=0.0)                                                          # [K, N] fp8
        w_s = tl.load(s_rows + kb * stride_sk, mask=n_ok, other=0.0)                    # [N]
        acc += _dot8(a, w, ROWWISE) * a_s[:, None] * w_s[None, :]
    return pair, row_ok, token, n, n_ok, acc


@triton.jit
def _down_kernel(hq_ptr, hs_ptr, w_ptr, ws_ptr, out_ptr, pairs_ptr, block_expert_ptr, weights_ptr,
                 num_pairs, top_k, hidden, inter, group_n,
                 stride_hq, stride_hs, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk, stride_out,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    expert = tl.load(block_expert_ptr + tl.program_id(0))
    if expert < 0:
        return
    pair, row_ok, token, n, n_ok, acc = _down_block(
        hq_ptr, hs_ptr, w_ptr, ws_ptr, pairs_ptr, block_expert_ptr, num_pairs, top_k, hidden, inter, group_n,
        stride_hq, stride_hs, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
        BLOCK_M, BLOCK_N, BLOCK_K, False)
    weight = tl.load(weights_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)        # [M]
    # NOTE: the k pairs of one token sit in different blocks: atomic adds (order varies on a GPU);
    # relaxed: nothing reads `out` before the kernel ends
    tl.atomic_add(out_ptr + token[:, None] * stride_out + n[None, :], acc * weight[:, None],
                  mask=row_ok[:, None] & n_ok[None, :], sem="relaxed")


@triton.jit
def _down_terms_kernel(hq_ptr, hs_ptr, w_ptr, ws_ptr, terms_ptr, pairs_ptr, block_expert_ptr, weights_ptr,
                       num_pairs, top_k, hidden, inter, group_n,
                       stride_hq, stride_hs, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
                       stride_t,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROWWISE: tl.constexpr):
    expert = tl.load(block_expert_ptr + tl.program_id(0))
    if expert < 0:
        return
    pair, row_ok, _, n, n_ok, acc = _down_block(
        hq_ptr, hs_ptr, w_ptr, ws_ptr, pairs_ptr, block_expert_ptr, num_pairs, top_k, hidden, inter, group_n,
        stride_hq, stride_hs, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
        BLOCK_M, BLOCK_N, BLOCK_K, ROWWISE)
    out_ty = terms_ptr.dtype.element_ty
    weight = tl.load(weights_ptr + pair, mask=row_ok, other=0.0).to(out_ty).to(tl.float32)   # [M]
    # y rounded to out_ty times the weight in out_ty, rounded once (exact in fp32 for bf16 / fp16 operands)
    # NOTE: not out_ty arithmetic: the interpreter multiplies bf16 wrongly
    term = acc.to(out_ty).to(tl.float32) * weight[:, None]
    # NOTE: row `pair` = token * top_k + slot of the [N, K, H] buffer: one writer per element
    tl.store(terms_ptr + pair[:, None] * stride_t + n[None, :], term.to(out_ty), mask=row_ok[:, None] & n_ok[None, :])


def _down_tile(device: torch.device, hidden: int) -> int:
    """BLOCK_N of the down GEMM (its output width is hidden)."""
    if device.type == "cpu":
        return min(256, max(16, triton.next_power_of_2(hidden)))   # NOTE: interpreter: cost per op
    return min(128, max(16, triton.next_power_of_2(hidden)))


def fp8_moe_gate_up(x_fp8: torch.Tensor, x_scales: torch.Tensor, w13: torch.Tensor, w13_scale_inv: torch.Tensor,
                    blocks: ExpertBlocks, top_k: int, block: tuple[int, int] = DEFAULT_BLOCK,
                    rowwise: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The first half: x_fp8 [N, H] with x_scales [N, ceil(H / bk)] (per token group of bk), w13 [E, 2I, H]
    with w13_scale_inv (check_moe_fp8) -> (h_fp8 [P, I], h_scales fp32 [P, ceil(I / bk)]) per pair
    (token * top_k + slot), h = silu(gate) * up quantized per group of bk; rows of pairs in no block
    are left unwritten. rowwise: the interpreter's batch-invariant dot (deterministic mode)."""
    bn, bk = check_block(block)
    num_pairs = blocks.num_pairs
    hidden, inter = w13.shape[2], w13.shape[1] // 2
    h_fp8 = torch.empty((num_pairs, inter), dtype=FP8_DTYPE, device=x_fp8.device)          # [P, I]
    h_scales = torch.empty((num_pairs, cdiv(inter, bk)), dtype=torch.float32, device=x_fp8.device)
    if num_pairs == 0 or inter == 0:
        return h_fp8, h_scales
    assert x_scales.stride(1) == 1 and x_fp8.stride(1) == 1, (x_scales.stride(), x_fp8.stride())
    _gate_up_kernel[(blocks.block_expert.numel(), h_scales.shape[1])](
        x_fp8, x_scales, w13, w13_scale_inv, h_fp8, h_scales, blocks.pairs, blocks.block_expert,
        num_pairs, top_k, hidden, inter, cdiv(inter, bn), bn, float(FP8_EPS),
        x_fp8.stride(0), x_scales.stride(0), w13.stride(0), w13.stride(1), w13.stride(2),
        w13_scale_inv.stride(0), w13_scale_inv.stride(1), w13_scale_inv.stride(2), h_fp8.stride(0), h_scales.stride(0),
        BLOCK_M=blocks.block_m, BLOCK_N=bk, BLOCK_K=bk, ROWWISE=rowwise, FP8_MAX=FP8_MAX,
        num_warps=num_warps(blocks.block_m))
    return h_fp8, h_scales


def fp8_moe_down(h_fp8: torch.Tensor, h_scales: torch.Tensor, w2: torch.Tensor, w2_scale_inv: torch.Tensor,
                 topk_weights: torch.Tensor, blocks: ExpertBlocks, num_tokens: int, top_k: int,
                 block: tuple[int, int] = DEFAULT_BLOCK, out_dtype: torch.dtype = torch.bfloat16,
                 deterministic: bool = False, per_slot: bool = False) -> torch.Tensor:
    """The second half: h_fp8 [P, I] with h_scales [P, ceil(I / bk)], w2 [E, H, I] with w2_scale_inv
    [E, ceil(H / bn), ceil(I / bk)], topk_weights float32 [N, K] -> [N, H] out_dtype, the weighted sum
    over the slots in blocks (deterministic / per_slot: see the module docstring; per_slot gives the
    terms [N, K, H])."""
    bn, bk = check_block(block)
    hidden, inter = w2.shape[1], w2.shape[2]
    num_pairs = blocks.num_pairs
    dev = h_fp8.device
    assert h_fp8.stride(1) == 1 and h_scales.stride(1) == 1, (h_fp8.stride(), h_scales.stride())
    grid = (blocks.block_expert.numel(), cdiv(hidden, _down_tile(dev, hidden)))
    common = dict(BLOCK_M=blocks.block_m, BLOCK_N=_down_tile(dev, hidden), BLOCK_K=bk,
                  num_warps=num_warps(blocks.block_m))
    weights = topk_weights.contiguous()
    if deterministic or per_slot:
        terms = torch.zeros((num_tokens, top_k, hidden), dtype=out_dtype, device=dev)     # [N, K, H]
        if num_pairs and hidden and inter:
            flat = terms.view(num_pairs, hidden)                                           # [P, H]
            _down_terms_kernel[grid](
                h_fp8, h_scales, w2, w2_scale_inv, flat, blocks.pairs, blocks.block_expert, weights,
                num_pairs, top_k, hidden, inter, bn, h_fp8.stride(0), h_scales.stride(0),
                w2.stride(0), w2.stride(1), w2.stride(2),
                w2_scale_inv.stride(0), w2_scale_inv.stride(1), w2_scale_inv.stride(2), flat.stride(0),
                ROWWISE=dev.type == "cpu", **common)
        return terms if per_slot else sum_slots(terms)
    out = torch.zeros((num_tokens, hidden), dtype=torch.float32, device=dev)               # [N, H]
    if num_pairs and hidden and inter:
        _down_kernel[grid](
            h_fp8, h_scales, w2, w2_scale_inv, out, blocks.pairs, blocks.block_expert, weights,
            num_pairs, top_k, hidden, inter, bn, h_fp8.stride(0), h_scales.stride(0),
            w2.stride(0), w2.stride(1), w2.stride(2),
            w2_scale_inv.stride(0), w2_scale_inv.stride(1), w2_scale_inv.stride(2), out.stride(0), **common)
    return out.to(out_dtype)


def fused_moe_fp8(x: torch.Tensor, w13: torch.Tensor, w13_scale_inv: torch.Tensor, w2: torch.Tensor,
                  w2_scale_inv: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, expert_lo: int,
                  block: tuple[int, int] = DEFAULT_BLOCK, *, deterministic: bool = False,
                  per_slot: bool = False) -> torch.Tensor:
    """x [N, H]; float8_e4m3fn experts [expert_lo, expert_lo + E): w13 [E, 2I, H] (gate rows then up
    rows) with w13_scale_inv [E, 2 * ceil(I / bn), ceil(H / bk)] (the gate half's block scales, then the
    up half's), w2 [E, H, I] with w2_scale_inv [E, ceil(H / bn), ceil(I / bk)]; topk_weights float32
    [N, K], topk_ids int64 [N, K] (global ids) -> [N, H] in x.dtype (per_slot: the terms [N, K, H]).
    As fp8_reference.fused_moe_fp8_reference; deterministic: batch-invariant (module docstring)."""
    num_experts, hidden, inter = check_moe_fp8(x, w13, w13_scale_inv, w2, w2_scale_inv, block)
    n, top_k = topk_ids.shape
    num_pairs = topk_ids.numel()
    deterministic = deterministic or per_slot
    if num_pairs == 0 or num_experts == 0:
        shape = (n, top_k, hidden) if per_slot else (n, hidden)
        return torch.zeros(shape, dtype=x.dtype, device=x.device)
    xq, xs = quantize_fp8_per_token_group(x, block[1])
    block_m = EXACT_BLOCK_M if deterministic else _block_m(num_pairs, num_experts)
    blocks = ExpertBlocks.build(topk_ids, expert_lo, num_experts, block_m)
    rowwise = deterministic and x.device.type == "cpu"
    hq, hs = fp8_moe_gate_up(xq, xs, w13, w13_scale_inv, blocks, top_k, block, rowwise)
    return fp8_moe_down(hq, hs, w2, w2_scale_inv, topk_weights, blocks, n, top_k, block, x.dtype,
                        deterministic, per_slot)
