"""Block-scaled FP8 W8A8 (Triton): the per-token-group activation quantizer and the block-scaled GEMM,
the definitions of rollout/models/kernels/fp8_reference.py (its *_reference functions).

The quantizer is bitwise the reference (torch's x / scale, clamp, round-to-nearest-even cast): the
divisions are IEEE (div_rn, not Triton's default approximate fp32 `/`) and the rounding to the e4m3
grid is done in fp32 before the cast (_round_e4m3), so the cast itself is exact. The GEMM folds one
k-block (BLOCK_K = bk) per step: acc += dot(x_fp8, w_fp8) * x_scale * w_scale. On sm_90 a 64-row tile
runs Hopper's fp8 wgmma, which accumulates inside the block with reduced precision (Triton's default
there, as in SGLang; promoted to fp32 once per block, DeepSeek-V3's recipe); 16- and 32-row tiles
widen fp8 to f16 (exact) for mma.sync with fp32 accumulation. So the default mode's numerics follow
M (its tile); deterministic mode keeps 16-row tiles whatever M.

Triton is imported by this module: import it only where the triton backend is chosen.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from rollout.models.kernels.fp8_reference import (DEFAULT_BLOCK, FP8_DTYPE, FP8_EPS, FP8_MAX, cdiv,
                                                  check_block_scales)

EXACT_BLOCK_M = 16   # rows per program in deterministic mode, whatever M


@triton.jit
def _round_e4m3(v):
    """v fp32 in [-448, 448] -> the nearest float8_e4m3fn value (ties to even), still fp32.
    NOTE: the interpreter's fp32 -> fp8 cast rounds wrongly (truncates subnormals, ties away, a
    mantissa carry lost); a value already on the e4m3 grid casts exactly there and on a GPU."""
    bits = v.to(tl.int32, bitcast=True)
    # normal e4m3 (|v| >= 2^-6): keep 3 of fp32's 23 mantissa bits, round to nearest even on the bits
    lsb = (bits >> 20) & 1
    normal = ((bits + 0x7FFFF + lsb) & -0x100000).to(tl.float32, bitcast=True)
    # subnormal e4m3: multiples of 2^-9; adding 2^14 leaves fp32 a quantum of 2^-9 (round to nearest even)
    mag = tl.abs(v)
    sub = (mag + 16384.0) - 16384.0
    sub = tl.where(bits < 0, -sub, sub)                          # the sign bit: -0.0 stays -0.0
    return tl.where(mag < 0.015625, sub, normal)


@triton.jit
def _quantize_rows(v, eps, FP8_MAX: tl.constexpr):
    """v fp32 [M, G] (one quantization group per row, masked columns 0) -> (v_fp8 [M, G], scale fp32 [M])."""
    amax = tl.max(tl.abs(v), axis=1)
    scale = tl.math.div_rn(tl.maximum(amax, eps), tl.full(amax.shape, FP8_MAX, tl.float32))
    t = tl.math.div_rn(v, tl.broadcast_to(scale[:, None], v.shape))
    t = tl.minimum(tl.maximum(t, -FP8_MAX), FP8_MAX)
    return _round_e4m3(t).to(tl.float8e4nv), scale


@triton.jit
def _dot8(a, b, ROWWISE: tl.constexpr):
    """a fp8 [M, K] . b fp8 [K, N] -> fp32 [M, N]."""
    if ROWWISE:
        # NOTE: the interpreter's tl.dot is numpy's BLAS, whose result for a row depends on the row's
        # place in the block; a broadcast product summed over K is the same for every row
        return tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    return tl.dot(a, b)


@triton.jit
def _quant_kernel(x_ptr, q_ptr, s_ptr, rows, cols, group, eps, stride_x, stride_q, stride_s,
                  BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr, FP8_MAX: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    g = tl.program_id(1)
    c = g.to(tl.int64) * group + tl.arange(0, BLOCK_G)
    mask = (r < rows)[:, None] & ((tl.arange(0, BLOCK_G) < group) & (c < cols))[None, :]
    v = tl.load(x_ptr + r[:, None] * stride_x + c[None, :], mask=mask, other=0.0).to(tl.float32)   # [R, G]
    q, scale = _quantize_rows(v, eps, FP8_MAX)
    tl.store(q_ptr + r[:, None] * stride_q + c[None, :], q, mask=mask)
    tl.store(s_ptr + r * stride_s + g, scale, mask=r < rows)


@triton.jit
def _gemm_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, M, N, K, group_n,
                 stride_xm, stride_xk, stride_xsm, stride_xsk, stride_wn, stride_wk, stride_wsn, stride_wsk,
                 stride_om, stride_on,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROWWISE: tl.constexpr):
    m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = m < M, n < N
    sn = n // group_n                                                                 # [N] weight scale rows
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K).to(tl.int64)
        k_ok = kk < K
        kb = k0 // BLOCK_K
        a = tl.load(x_ptr + m[:, None] * stride_xm + kk[None, :] * stride_xk, mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0)                                                        # [M, K] fp8
        b = tl.load(w_ptr + n[None, :] * stride_wn + kk[:, None] * stride_wk, mask=k_ok[:, None] & n_ok[None, :],
                    other=0.0)                                                        # [K, N] fp8
        a_s = tl.load(xs_ptr + m * stride_xsm + kb * stride_xsk, mask=m_ok, other=0.0)  # [M]
        b_s = tl.load(ws_ptr + sn * stride_wsn + kb * stride_wsk, mask=n_ok, other=0.0)  # [N]
        acc += _dot8(a, b, ROWWISE) * a_s[:, None] * b_s[None, :]
    tl.store(out_ptr + m[:, None] * stride_om + n[None, :] * stride_on, acc.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def num_warps(block_m: int) -> int:
    """Warps of a GEMM program: 8 for 64-row tiles (Hopper's fp8 wgmma; 4 spill there), else 4."""
    return 8 if block_m >= 64 else 4


def check_block(block: tuple[int, int]) -> tuple[int, int]:
    """(bn, bk): bk is a kernel tile (a power of two, at least 16: tl.dot's smallest K)."""
    bn, bk = block
    assert bn > 0 and bk >= 16 and bk & (bk - 1) == 0, block
    return bn, bk


def quantize_fp8_per_token_group(x: torch.Tensor, group: int = 128,
                                 eps: float = FP8_EPS) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (any float dtype, unit column stride) -> (x_fp8 float8_e4m3fn [M, K], scales fp32
    [M, ceil(K / group)]), bitwise fp8_reference.quantize_fp8_per_token_group."""
    assert x.dim() == 2 and group > 0, (x.shape, group)
    rows, cols = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    q = torch.empty((rows, cols), dtype=FP8_DTYPE, device=x.device)
    s = torch.empty((rows, cdiv(cols, group)), dtype=torch.float32, device=x.device)
    if q.numel():
        block_g = triton.next_power_of_2(group)
        block_r = max(1, min(64, triton.next_power_of_2(rows))) if x.device.type == "cpu" \
            else max(1, min(16, 4096 // block_g))
        _quant_kernel[(cdiv(rows, block_r), s.shape[1])](
            x, q, s, rows, cols, group, float(eps), x.stride(0), q.stride(0), s.stride(0),
            BLOCK_R=block_r, BLOCK_G=block_g, FP8_MAX=FP8_MAX)
    return q, s


def _gemm_tiles(device: torch.device, m: int, n: int, deterministic: bool) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) of the block-scaled GEMM."""
    if device.type == "cpu":
        # NOTE: the interpreter's cost is per op, not per element: large tiles
        block_m = EXACT_BLOCK_M if deterministic else min(64, max(16, triton.next_power_of_2(m)))
        return block_m, min(256, max(16, triton.next_power_of_2(n)))
    block_m = EXACT_BLOCK_M if deterministic else 16 if m <= 16 else 32 if m <= 32 else 64
    return block_m, 128


def w8a8_block_fp8_matmul(x_fp8: torch.Tensor, x_scales: torch.Tensor, w_fp8: torch.Tensor,
                          w_scale_inv: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK,
                          out_dtype: torch.dtype = torch.bfloat16, deterministic: bool = False) -> torch.Tensor:
    """x_fp8 [M, K] with x_scales [M, ceil(K / bk)] (quantize_fp8_per_token_group, group = bk),
    w_fp8 [N, K] with w_scale_inv [ceil(N / bn), ceil(K / bk)] -> [M, N] out_dtype: the block-scaled
    GEMM of fp8_reference (fp32 accumulation). deterministic: the same tiles whatever M, so a row's
    result does not depend on the other rows (batch-invariant). No host sync (CUDA-graph safe)."""
    bn, bk = check_block(block)
    m, k = x_fp8.shape
    n = w_fp8.shape[0]
    assert x_fp8.dtype == FP8_DTYPE and w_fp8.shape[1] == k, (x_fp8.dtype, x_fp8.shape, w_fp8.shape)
    assert x_scales.shape == (m, cdiv(k, bk)) and x_scales.dtype == torch.float32, (x_scales.shape, x_fp8.shape, block)
    check_block_scales(w_fp8, w_scale_inv, block)
    out = torch.empty((m, n), dtype=out_dtype, device=x_fp8.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    block_m, block_n = _gemm_tiles(x_fp8.device, m, n, deterministic)
    _gemm_kernel[(cdiv(m, block_m), cdiv(n, block_n))](
        x_fp8, x_scales, w_fp8, w_scale_inv, out, m, n, k, bn,
        x_fp8.stride(0), x_fp8.stride(1), x_scales.stride(0), x_scales.stride(1),
        w_fp8.stride(0), w_fp8.stride(1), w_scale_inv.stride(0), w_scale_inv.stride(1), out.stride(0), out.stride(1),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=bk, ROWWISE=deterministic and x_fp8.device.type == "cpu",
        num_warps=num_warps(block_m))
    return out


def apply_w8a8_block_fp8_linear(x: torch.Tensor, w_fp8: torch.Tensor, w_scale_inv: torch.Tensor,
                                block: tuple[int, int] = DEFAULT_BLOCK, bias: Optional[torch.Tensor] = None,
                                deterministic: bool = False) -> torch.Tensor:
    """x [..., K] -> [..., N] in x.dtype: x quantized per token group of bk, the block-scaled GEMM,
    rounded to x.dtype, then + bias (fp8_reference.apply_w8a8_block_fp8_linear_reference)."""
    k = x.shape[-1]
    xq, xs = quantize_fp8_per_token_group(x.reshape(-1, k), block[1])
    out = w8a8_block_fp8_matmul(xq, xs, w_fp8, w_scale_inv, block, x.dtype, deterministic)
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], w_fp8.shape[0])
