"""Block-scaled FP8 W8A8: the torch definitions (rollout/models/kernels/fp8_reference.py) against float64,
the Triton kernels (fp8_gemm.py, fused_moe_fp8.py) against them.

The interpreter loads, stores, widens and multiplies float8 exactly (its tl.dot widens to fp16, products
exact in fp32), but its fp32 -> float8 cast rounds wrongly; the kernels round to the e4m3 grid
themselves (fp8_gemm._round_e4m3), so the quantizer is proven bitwise under the interpreter and the
GEMMs within fp32 reordering. The tests marked gpu run the compiled kernels (on sm_90 the fp8 dot
accumulates inside a 128-wide block with reduced precision: wider tolerances there); the slow test
compiles every kernel for sm_90 without a GPU.

Tolerances (u = 2^-24, fp32's unit roundoff; abs_sum[m, n] = sum_k |x[m, k] w[n, k]| of the dequantized
operands, in float64): the reference GEMM is within (bk + k-blocks + 4) u abs_sum of the float64
definition (fp32 sums of at most bk exact products, two scale products and one add per block); a
kernel and the reference, each within that, within twice it.
"""
import os
import subprocess
import sys

import pytest
import torch

from rollout.exact import sum_slots
from rollout.models.kernels.fp8_reference import (FP8_EPS, FP8_MAX, apply_w8a8_block_fp8_linear_reference, cdiv,
                                                  fused_moe_fp8_reference, moe_down_fp8_reference,
                                                  moe_gate_up_fp8_reference, quantize_fp8_per_token_group,
                                                  w8a8_block_fp8_matmul_reference)
from rollout.models.moe.routing import softmax_topk

U = 2.0 ** -24
FP8 = torch.float8_e4m3fn


# ---------------------------------------------------------------------------------------------- helpers

def e4m3_grid() -> torch.Tensor:
    """The non-negative finite float8_e4m3fn values, float64, indexed by their code (0 .. 126)."""
    return torch.arange(127, dtype=torch.uint8).view(FP8).double()


def round_e4m3_64(t: torch.Tensor) -> torch.Tensor:
    """t float64 within [-448, 448] -> the nearest e4m3 value, ties to the even code (independent of torch's cast)."""
    grid = e4m3_grid()
    mag = t.abs()
    hi = torch.searchsorted(grid, mag).clamp(max=126)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = mag - grid[lo], grid[hi] - mag
    pick = torch.where(d_lo < d_hi, lo, torch.where(d_hi < d_lo, hi, torch.where(lo % 2 == 0, lo, hi)))
    return torch.copysign(grid[pick], t)


def expand(s: torch.Tensor, block: tuple[int, int], shape: tuple[int, ...]) -> torch.Tensor:
    """Block scales [..., ceil(R / br), ceil(C / bc)] -> per element [..., R, C]."""
    r, c = shape[-2:]
    return s.repeat_interleave(block[0], dim=-2)[..., :r, :].repeat_interleave(block[1], dim=-1)[..., :c]


def dq64(q: torch.Tensor, s: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Dequantized exactly (float64)."""
    return q.double() * expand(s.double(), block, q.shape)


def block_fp8_weight(shape: tuple[int, ...], block: tuple[int, int], gen: torch.Generator,
                     scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [..., N, K] quantized per (bn, bk) block as a checkpoint is (scale = block amax / 448), its
    blocks' magnitudes spread over 2^-3 .. 2^3 so that the scales differ -> (w_fp8, w_scale_inv)."""
    *lead, n, k = shape
    nb, kb = cdiv(n, block[0]), cdiv(k, block[1])
    mag = torch.exp2(torch.rand(*lead, nb, kb, generator=gen) * 6 - 3) * scale
    w = torch.randn(shape, generator=gen) * expand(mag, block, shape)
    pad = torch.nn.functional.pad(w.abs(), (0, kb * block[1] - k, 0, nb * block[0] - n))
    amax = pad.view(*lead, nb, block[0], kb, block[1]).amax(dim=(-3, -1))
    s = amax.clamp(min=1e-12) / FP8_MAX
    return (w / expand(s, block, shape)).clamp(-FP8_MAX, FP8_MAX).to(FP8), s


def activations(m: int, k: int, gen: torch.Generator, spread: int = 8) -> torch.Tensor:
    """[M, K] fp32 whose entries' magnitudes span 2^-spread .. 2^spread (groups with very different scales)."""
    exponents = torch.randint(-spread, spread + 1, (m, k), generator=gen).float()
    return torch.randn(m, k, generator=gen) * torch.exp2(exponents)


def abs_sum(xq, xs, w, ws, block) -> torch.Tensor:
    """sum_k |x[m, k] w[n, k]| of the dequantized operands, float64 [M, N]."""
    return dq64(xq, xs, (1, block[1])).abs() @ dq64(w, ws, block).abs().T


def gemm_tol(k: int, block: tuple[int, int], sums: torch.Tensor) -> torch.Tensor:
    return (block[1] + cdiv(k, block[1]) + 4) * U * sums


def assert_within(out: torch.Tensor, ref: torch.Tensor, tol: torch.Tensor) -> None:
    err = (out.double() - ref.double()).abs()
    assert out.shape == ref.shape
    assert (err <= tol).all(), (err.max().item(), (err - tol).max().item(), int((err > tol).sum()))


def moe_weights(num_experts: int, hidden: int, inter: int, block: tuple[int, int], gen: torch.Generator):
    """FP8 experts as a checkpoint gives them: gate and up quantized each on its own blocks, then
    concatenated (weights and scales) -> (w13, w13_scale_inv, w2, w2_scale_inv)."""
    gate, s_gate = block_fp8_weight((num_experts, inter, hidden), block, gen, hidden ** -0.5)
    up, s_up = block_fp8_weight((num_experts, inter, hidden), block, gen, hidden ** -0.5)
    w2, s2 = block_fp8_weight((num_experts, hidden, inter), block, gen, inter ** -0.5)
    return torch.cat([gate, up], 1), torch.cat([s_gate, s_up], 1), w2, s2


def routing(n: int, num_experts: int, top_k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    weights, ids = softmax_topk(torch.randn(n, num_experts, generator=gen), top_k, renormalize=True)
    return weights.contiguous(), ids.contiguous()


# ------------------------------------------------------------------------------ the torch definitions

QUANT_CASES = [(7, 300, 128, torch.float32), (5, 1408, 128, torch.bfloat16), (9, 40, 16, torch.float32),
               (3, 100, 32, torch.float16), (1, 7, 128, torch.float32)]


@pytest.mark.parametrize("m,k,group,dtype", QUANT_CASES)
def test_quantizer_reference_is_the_definition(m, k, group, dtype):
    """Scales exactly max(amax, eps) / 448; values the round-to-nearest-even e4m3 of clamp(x / scale);
    each group's largest magnitude lands on 448; the round trip within half an e4m3 step."""
    gen = torch.Generator().manual_seed(m * k)
    x = activations(m, k, gen).to(dtype)
    x[0, : min(k, group)] = 0                                       # an all-zero group
    q, s = quantize_fp8_per_token_group(x, group)
    assert q.dtype == FP8 and q.shape == (m, k) and s.dtype == torch.float32 and s.shape == (m, cdiv(k, group))
    x64 = x.double()
    groups = [x64[:, g * group:(g + 1) * group] for g in range(cdiv(k, group))]
    amax = torch.stack([gr.abs().amax(dim=1) for gr in groups], dim=1)                     # [M, G] exact
    # NOTE: an fp32 quotient rounded from float64 is the correctly rounded fp32 quotient (53 >= 2 * 24 + 2)
    assert torch.equal(s, (amax.clamp(min=FP8_EPS) / FP8_MAX).float())
    s_col = expand(s, (1, group), (m, k))
    t = (x.float() / s_col).clamp(-FP8_MAX, FP8_MAX)                                        # the fp32 quotient
    assert torch.equal(q.double(), round_e4m3_64(t.double()))
    qmax = torch.stack([q.double()[:, g * group:(g + 1) * group].abs().amax(dim=1) for g in range(s.shape[1])], 1)
    assert torch.equal(qmax, torch.where(amax > 0, FP8_MAX, 0.0).double())
    assert torch.equal(q[0, : min(k, group)].double(), torch.zeros(min(k, group), dtype=torch.float64))
    # round trip: |x - q s| <= half an e4m3 step of x / s (2^-4 relative; 2^-10 s among the subnormals)
    # plus the fp32 quotient's rounding
    err = (x64 - q.double() * s_col.double()).abs()
    bound = 2.0 ** -4 * x64.abs() + 2.0 ** -10 * s_col.double() + 2.0 ** -22 * x64.abs()
    assert (err <= bound).all(), (err - bound).max()


GEMM_CASES = [(5, 200, 300, (128, 128)), (7, 72, 40, (32, 16)), (2, 130, 1408, (128, 128)), (1, 17, 64, (8, 32)),
              (33, 48, 96, (16, 32))]


@pytest.mark.parametrize("m,n,k,block", GEMM_CASES)
def test_matmul_reference_is_the_definition(m, n, k, block):
    """The reference GEMM against float64: the sum over k-blocks of (x_fp8 . w_fp8) * x_scale * w_scale,
    which is also dq(x) @ dq(w).T (the weights w_fp8 * w_scale_inv of their block); partial blocks."""
    gen = torch.Generator().manual_seed(m + n + k)
    w, ws = block_fp8_weight((n, k), block, gen)
    xq, xs = quantize_fp8_per_token_group(activations(m, k, gen, 3), block[1])
    ref = w8a8_block_fp8_matmul_reference(xq, xs, w, ws, block)
    assert ref.dtype == torch.float32 and ref.shape == (m, n)
    exact = torch.zeros(m, n, dtype=torch.float64)
    ws_rows = expand(ws.double(), (block[0], 1), (n, ws.shape[1]))                         # [N, KB]
    for kb in range(cdiv(k, block[1])):
        cols = slice(kb * block[1], (kb + 1) * block[1])
        exact += (xq[:, cols].double() @ w[:, cols].double().T) * xs[:, kb, None].double() * ws_rows[None, :, kb]
    sums = abs_sum(xq, xs, w, ws, block)
    assert torch.allclose(exact, dq64(xq, xs, (1, block[1])) @ dq64(w, ws, block).T, rtol=0, atol=1e-12 * sums.max())
    assert_within(ref, exact, gemm_tol(k, block, sums))
    assert torch.equal(w8a8_block_fp8_matmul_reference(xq, xs, w, ws, block, torch.bfloat16), ref.bfloat16())


MOE_CASES = [  # n, hidden, inter, experts, top_k, block, expert_lo, expert_hi
    (9, 80, 48, 6, 2, (32, 32), 0, 6),          # hidden and intermediate tails; w13's halves blocked apart
    (33, 64, 40, 8, 4, (16, 16), 2, 6),         # expert parallel: experts 2..5 here
    (1, 256, 128, 4, 4, (128, 128), 0, 4),      # one token, DeepSeek's block
    (5, 48, 24, 12, 8, (16, 32), 0, 12),        # bn != bk, top-8
]


def moe_case(n, hidden, inter, num_experts, top_k, block, lo, hi, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed + n * hidden + inter)
    w13, s13, w2, s2 = moe_weights(num_experts, hidden, inter, block, gen)
    weights, ids = routing(n, num_experts, top_k, gen)
    x = torch.randn(n, hidden, generator=gen).to(dtype)
    return x, (w13[lo:hi], s13[lo:hi], w2[lo:hi], s2[lo:hi]), weights, ids


@pytest.mark.parametrize("case", MOE_CASES)
def test_moe_reference_is_the_definition(case):
    """Each half of the reference fused MoE against float64, per (token, slot): h = silu(gate) * up of
    the slot's expert on the dequantized operands; the weighted sum over the held slots of dq(h_fp8) @
    dq(w2).T; slots held by another rank contribute nothing; the modes agree."""
    n, hidden, inter, num_experts, top_k, block, lo, hi = case
    x, (w13, s13, w2, s2), weights, ids = moe_case(*case)
    half = cdiv(inter, block[0])
    xq, xs = quantize_fp8_per_token_group(x, block[1])
    h = moe_gate_up_fp8_reference(xq, xs, w13, s13, ids, lo, block)
    assert h.shape == (n * top_k, inter) and h.dtype == torch.float32
    x64 = dq64(xq, xs, (1, block[1]))
    for p in range(n * top_k):
        e = int(ids.view(-1)[p]) - lo
        if not 0 <= e < hi - lo:
            assert not h[p].any()
            continue
        g_w, u_w = dq64(w13[e, :inter], s13[e, :half], block), dq64(w13[e, inter:], s13[e, half:], block)
        xt = x64[p // top_k]
        gate, up = g_w @ xt, u_w @ xt
        c = (block[1] + cdiv(hidden, block[1]) + 4) * U
        d_gate, d_up = c * (g_w.abs() @ xt.abs()), c * (u_w.abs() @ xt.abs())            # the GEMMs' bounds
        exact = gate * torch.sigmoid(gate) * up
        tol = 1.1 * d_gate * (up.abs() + d_up) + (gate.abs() + d_gate) * d_up + 2.0 ** -20 * exact.abs()
        assert_within(h[p], exact, tol)
    hq, hs = quantize_fp8_per_token_group(h, block[1])
    out = moe_down_fp8_reference(hq, hs, w2, s2, weights, ids, lo, block)
    h64 = dq64(hq, hs, (1, block[1]))
    exact = torch.zeros(n, hidden, dtype=torch.float64)
    sums = torch.zeros(n, hidden, dtype=torch.float64)
    for p in range(n * top_k):
        e = int(ids.view(-1)[p]) - lo
        if 0 <= e < hi - lo:
            w_e = dq64(w2[e], s2[e], block)
            exact[p // top_k] += float(weights.view(-1)[p]) * (w_e @ h64[p])
            sums[p // top_k] += float(weights.view(-1)[p]) * (w_e.abs() @ h64[p].abs())
    assert_within(out, exact, (block[1] + cdiv(inter, block[1]) + 4 + top_k) * U * sums)
    assert torch.equal(fused_moe_fp8_reference(x, w13, s13, w2, s2, weights, ids, lo, block), out)
    terms = fused_moe_fp8_reference(x, w13, s13, w2, s2, weights, ids, lo, block, per_slot=True)
    held = ((ids >= lo) & (ids < hi))[:, :, None]
    assert terms.shape == (n, top_k, hidden) and not terms.masked_select(~held).any()
    assert torch.equal(fused_moe_fp8_reference(x, w13, s13, w2, s2, weights, ids, lo, block, deterministic=True),
                       sum_slots(terms))
    assert_within(sum_slots(terms), exact, (block[1] + cdiv(inter, block[1]) + 8 + top_k) * U * sums)


# -------------------------------------------------------------------- the Triton kernels, interpreted

def _triton():
    pytest.importorskip("triton")
    from rollout.models.kernels import fp8_gemm, fused_moe_fp8
    return fp8_gemm, fused_moe_fp8


def grid_rows() -> torch.Tensor:
    """Rows whose scale is a power of two (amax 448 * 2^j), so x / scale is exact: every e4m3 value,
    every midpoint (ties: to even), one fp32 step either side of each, signed zeros, subnormal ties."""
    vals = e4m3_grid().float()
    mids = (vals[1:] + vals[:-1]) / 2
    up, down = torch.nextafter(mids, torch.tensor(1e9)), torch.nextafter(mids, torch.tensor(-1e9))
    row = torch.cat([vals, mids, up, down, torch.tensor([-0.0, 2.0 ** -10, 3 * 2.0 ** -10, 2.0 ** -11])])
    row = torch.cat([row, -row])
    return torch.stack([row * 2.0 ** j for j in (0, -7, 5)])


@pytest.mark.interpreter
@pytest.mark.parametrize("m,k,group,dtype", QUANT_CASES)
def test_quantizer_triton_bitwise(m, k, group, dtype):
    fp8_gemm, _ = _triton()
    gen = torch.Generator().manual_seed(m * k + 1)
    x = activations(m, k, gen).to(dtype)
    x[0, : min(k, group)] = 0
    q, s = fp8_gemm.quantize_fp8_per_token_group(x, group)
    q_ref, s_ref = quantize_fp8_per_token_group(x, group)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)


@pytest.mark.interpreter
def test_quantizer_triton_rounds_every_value_and_tie():
    fp8_gemm, _ = _triton()
    rows = grid_rows()
    q, s = fp8_gemm.quantize_fp8_per_token_group(rows, rows.shape[1])
    q_ref, s_ref = quantize_fp8_per_token_group(rows, rows.shape[1])
    assert torch.equal(s.view(-1), torch.tensor([1.0, 2.0 ** -7, 2.0 ** 5]))
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))                  # signs of zeros included
    assert torch.equal(q.double(), round_e4m3_64(rows.double() / s.double()))


@pytest.mark.interpreter
@pytest.mark.parametrize("m,n,k,block", GEMM_CASES + [(70, 40, 48, (16, 16))])
def test_matmul_triton(m, n, k, block):
    """fp32 out within the reordering tolerance; bf16 out within one bf16 step of it (the interpreter
    truncates fp32 -> bf16); deterministic mode: each row alone bitwise as in the batch; strided operands."""
    fp8_gemm, _ = _triton()
    gen = torch.Generator().manual_seed(m * n + k)
    w, ws = block_fp8_weight((n, k), block, gen)
    xq, xs = quantize_fp8_per_token_group(activations(m, k, gen, 3), block[1])
    ref = w8a8_block_fp8_matmul_reference(xq, xs, w, ws, block)
    tol = 2 * gemm_tol(k, block, abs_sum(xq, xs, w, ws, block))
    out = fp8_gemm.w8a8_block_fp8_matmul(xq, xs, w, ws, block, torch.float32)
    assert_within(out, ref, tol)
    bf = fp8_gemm.w8a8_block_fp8_matmul(xq, xs, w, ws, block, torch.bfloat16)
    assert bf.dtype == torch.bfloat16
    assert_within(bf, ref, tol + 2.0 ** -7 * ref.abs().double())
    # strided: x rows inside a wider buffer, w stored transposed
    wide = torch.zeros(m, k + 8, dtype=FP8)
    wide[:, :k] = xq
    w_t = w.T.contiguous().T
    assert w_t.stride() == (1, n)
    assert_within(fp8_gemm.w8a8_block_fp8_matmul(wide[:, :k], xs, w_t, ws, block, torch.float32), ref, tol)
    det = fp8_gemm.w8a8_block_fp8_matmul(xq, xs, w, ws, block, torch.float32, deterministic=True)
    assert_within(det, ref, tol)
    for r in sorted({0, m // 2, m - 1}):
        alone = fp8_gemm.w8a8_block_fp8_matmul(xq[r:r + 1], xs[r:r + 1], w, ws, block, torch.float32, True)
        assert torch.equal(alone, det[r:r + 1])


@pytest.mark.interpreter
def test_linear_triton():
    fp8_gemm, _ = _triton()
    gen = torch.Generator().manual_seed(3)
    block = (32, 32)
    w, ws = block_fp8_weight((50, 70), block, gen)
    x, bias = torch.randn(2, 3, 70, generator=gen), torch.randn(50, generator=gen)
    out = fp8_gemm.apply_w8a8_block_fp8_linear(x, w, ws, block, bias)
    ref = apply_w8a8_block_fp8_linear_reference(x, w, ws, block, bias)
    assert out.shape == (2, 3, 50) and out.dtype == torch.float32
    xq, xs = quantize_fp8_per_token_group(x.view(-1, 70), block[1])
    assert_within(out.view(6, 50), ref.view(6, 50), 2 * gemm_tol(70, block, abs_sum(xq, xs, w, ws, block)) + 1e-6)


def _moe_stages(fused_moe_fp8, x, weights_fp8, ids, lo, block, block_m):
    """The kernel's h (fp8, scales) per pair, from the reference's quantized x."""
    from rollout.models.kernels.moe_align import ExpertBlocks

    w13, s13 = weights_fp8[:2]
    blocks = ExpertBlocks.build(ids, lo, w13.shape[0], block_m)
    xq, xs = quantize_fp8_per_token_group(x, block[1])
    return blocks, fused_moe_fp8.fp8_moe_gate_up(xq, xs, w13, s13, blocks, ids.shape[1], block)


@pytest.mark.interpreter
@pytest.mark.parametrize("case", MOE_CASES)
def test_fused_moe_triton(case):
    """Stage by stage, then whole. gate_up: the kernel's quantized h is a round-to-nearest e4m3 of the
    reference h (fp32 h differs by reordering, so a value next to a tie may round the other way) within
    the round-trip bound, its scales within 2^-20; down, given the kernel's h: within the reordering
    tolerance; whole: that plus what the h values that rounded differently can change, exactly."""
    _, fused_moe_fp8 = _triton()
    n, hidden, inter, num_experts, top_k, block, lo, hi = case
    x, wts, weights, ids = moe_case(*case)
    w13, s13, w2, s2 = wts
    held = ((ids >= lo) & (ids < hi)).view(-1)
    blocks, (hq, hs) = _moe_stages(fused_moe_fp8, x, wts, ids, lo, block, 16)
    xq, xs = quantize_fp8_per_token_group(x, block[1])
    h_ref = moe_gate_up_fp8_reference(xq, xs, w13, s13, ids, lo, block)[held]
    hq_ref, hs_ref = quantize_fp8_per_token_group(h_ref, block[1])
    assert_within(hs[held], hs_ref, 2.0 ** -20 * hs_ref.double())
    h_k = dq64(hq[held], hs[held], (1, block[1]))
    s_col = expand(hs[held].double(), (1, block[1]), h_k.shape)
    mag = h_ref.abs().double()
    bound = (2.0 ** -4 * mag + 2.0 ** -10 * s_col) * (1 + 2.0 ** -18) + 2.0 ** -20 * mag
    assert_within(h_k, h_ref, bound)
    flipped = hq[held].view(torch.uint8) != hq_ref.view(torch.uint8)
    assert flipped.float().mean() <= 0.01, flipped.float().mean()
    # down, on the kernel's own h
    for det in (False, True):
        out = fused_moe_fp8.fp8_moe_down(hq, hs, w2, s2, weights, blocks, n, top_k, block, torch.float32, det)
        ref = moe_down_fp8_reference(hq, hs, w2, s2, weights, ids, lo, block, torch.float32, det)
        hq_full = torch.zeros(n * top_k, inter, dtype=FP8)
        hs_full = torch.zeros(n * top_k, hs.shape[1])
        hq_full[held], hs_full[held] = hq[held], hs[held]
        sums = torch.zeros(n, hidden, dtype=torch.float64)
        h_abs = dq64(hq_full, hs_full, (1, block[1])).abs()
        for p in held.nonzero().view(-1).tolist():
            e = int(ids.view(-1)[p]) - lo
            sums[p // top_k] += float(weights.view(-1)[p]) * (dq64(w2[e], s2[e], block).abs() @ h_abs[p])
        fp32_tol = 2 * (block[1] + cdiv(inter, block[1]) + 8 + top_k) * U * sums
        assert_within(out, ref, fp32_tol)
    # whole: the h values that rounded differently change the output by exactly their w2 columns
    flip_effect = torch.zeros(n, hidden, dtype=torch.float64)
    diff = (h_k - dq64(hq_ref, hs_ref, (1, block[1]))).abs()                               # [held pairs, I]
    for row, p in enumerate(held.nonzero().view(-1).tolist()):
        e = int(ids.view(-1)[p]) - lo
        flip_effect[p // top_k] += float(weights.view(-1)[p]) * (dq64(w2[e], s2[e], block).abs() @ diff[row])
    for det in (False, True):
        out = fused_moe_fp8.fused_moe_fp8(x, *wts, weights, ids, lo, block, deterministic=det)
        ref = fused_moe_fp8_reference(x, *wts, weights, ids, lo, block, deterministic=det)
        assert out.shape == (n, hidden) and out.dtype == x.dtype
        assert_within(out, ref, fp32_tol + 2 * flip_effect + 1e-30)


@pytest.mark.interpreter
def test_fused_moe_triton_deterministic_is_batch_invariant():
    """Deterministic mode: a token's output (and its per-slot terms) bitwise the same alone or among
    others; per_slot terms of expert-parallel shards add up to the whole."""
    _, fused_moe_fp8 = _triton()
    case = (21, 64, 48, 6, 3, (16, 32), 0, 6)
    x, wts, weights, ids = moe_case(*case)
    block = case[5]
    whole = fused_moe_fp8.fused_moe_fp8(x, *wts, weights, ids, 0, block, deterministic=True)
    terms = fused_moe_fp8.fused_moe_fp8(x, *wts, weights, ids, 0, block, per_slot=True)
    assert torch.equal(sum_slots(terms), whole)
    for rows in ([0], [20], [3, 4, 5], list(range(7, 21, 2))):
        part = fused_moe_fp8.fused_moe_fp8(x[rows], *wts, weights[rows], ids[rows], 0, block, deterministic=True)
        assert torch.equal(part, whole[rows]), rows
    w13, s13, w2, s2 = wts
    shards = [fused_moe_fp8.fused_moe_fp8(x, w13[a:b], s13[a:b], w2[a:b], s2[a:b], weights, ids, a, block,
                                          per_slot=True) for a, b in ((0, 2), (2, 5), (5, 6))]
    assert torch.equal(shards[0] + shards[1] + shards[2], terms)


@pytest.mark.interpreter
def test_fused_moe_triton_empty():
    _, fused_moe_fp8 = _triton()
    x, wts, weights, ids = moe_case(4, 32, 32, 4, 2, (16, 16), 0, 4)
    assert torch.equal(fused_moe_fp8.fused_moe_fp8(x[:0], *wts, weights[:0], ids[:0], 0, (16, 16)),
                       torch.zeros(0, 32))
    far = torch.full_like(ids, 3)          # every slot on expert 3, which another rank holds
    w13, s13, w2, s2 = wts
    out = fused_moe_fp8.fused_moe_fp8(x, w13[:2], s13[:2], w2[:2], s2[:2], weights, far, 0, (16, 16))
    assert torch.equal(out, torch.zeros_like(x))


# ------------------------------------------------------------------------------------- on a GPU

@pytest.mark.gpu
def test_quantizer_gpu_bitwise():
    fp8_gemm, _ = _triton()
    gen = torch.Generator().manual_seed(11)
    for dtype in (torch.float32, torch.bfloat16):
        x = activations(333, 7168 + 64, gen).to(dtype)
        q, s = fp8_gemm.quantize_fp8_per_token_group(x.cuda(), 128)
        q_ref, s_ref = quantize_fp8_per_token_group(x, 128)
        assert torch.equal(q.cpu().view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s.cpu(), s_ref)
    rows = grid_rows()
    q, _ = fp8_gemm.quantize_fp8_per_token_group(rows.cuda(), rows.shape[1])
    q_ref, _ = quantize_fp8_per_token_group(rows, rows.shape[1])
    assert torch.equal(q.cpu().view(torch.uint8), q_ref.view(torch.uint8))


def assert_close_gpu(out: torch.Tensor, ref: torch.Tensor, tol: torch.Tensor, rel_rms: float) -> None:
    """|out - ref| <= tol elementwise, and the relative RMS error within rel_rms (a wrong scale or block
    index gives errors of the output's own size)."""
    err = out.double().cpu() - ref.double().cpu()
    assert (err.abs() <= tol.cpu()).all(), (err.abs() - tol.cpu()).max().item()
    assert err.norm() <= rel_rms * ref.double().norm(), (err.norm() / ref.double().norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(1, 4096, 7168), (37, 1536, 1408), (200, 640, 384 + 72)])
def test_matmul_gpu(m, n, k):
    """Compiled on sm_90: 64-row tiles use fp8 wgmma, which accumulates a 128-wide block with reduced
    precision (about 14 bits; promoted to fp32 once per block, as SGLang and DeepSeek-V3): error within
    2^-9 abs_sum (4x the bound of 2^-13 per 32-wide MMA step, 4 steps a block); bf16 out adds half a
    bf16 step. Deterministic mode: a row alone bitwise as in the batch."""
    fp8_gemm, _ = _triton()
    block = (128, 128)
    gen = torch.Generator().manual_seed(m)
    w, ws = block_fp8_weight((n, k), block, gen)
    xq, xs = quantize_fp8_per_token_group(activations(m, k, gen, 3), 128)
    ref = w8a8_block_fp8_matmul_reference(xq, xs, w, ws, block)
    tol = 2.0 ** -9 * abs_sum(xq, xs, w, ws, block)
    args = (xq.cuda(), xs.cuda(), w.cuda(), ws.cuda(), block)
    assert_close_gpu(fp8_gemm.w8a8_block_fp8_matmul(*args, torch.float32), ref, tol, 2.0 ** -8)
    bf = fp8_gemm.w8a8_block_fp8_matmul(*args, torch.bfloat16)
    assert_close_gpu(bf.float(), ref, tol + 2.0 ** -8 * ref.abs().double(), 2.0 ** -7)
    det = fp8_gemm.w8a8_block_fp8_matmul(*args, torch.bfloat16, True)
    assert_close_gpu(det.float(), ref, tol + 2.0 ** -8 * ref.abs().double(), 2.0 ** -7)
    alone = fp8_gemm.w8a8_block_fp8_matmul(xq[-1:].cuda(), xs[-1:].cuda(), *args[2:], torch.bfloat16, True)
    assert torch.equal(alone, det[-1:])


@pytest.mark.gpu
@pytest.mark.parametrize("n,hidden,inter", [(37, 512, 384), (200, 384, 1408), (37, 256, 200)])
def test_fused_moe_gpu(n, hidden, inter):
    """bf16 model, DeepSeek's blocks (a 1408-wide intermediate; a partial last block; 200 tokens: 64-row
    tiles, fp8 wgmma): the compiled kernels
    against the reference (relative RMS: the reduced-precision fp8 wgmma accumulation, h values next to
    a tie rounding the other way, bf16 output), bitwise batch invariance in deterministic mode, and
    CUDA graph replays on new inputs (captured with host syncs raising) bitwise equal to eager runs."""
    _, fused_moe_fp8 = _triton()
    block = (128, 128)
    x, wts, weights, ids = moe_case(n, hidden, inter, 8, 2, block, 0, 8, dtype=torch.bfloat16)
    ref = fused_moe_fp8_reference(x, *wts, weights, ids, 0, block)
    cuda = [t.cuda() for t in (x, *wts, weights, ids)]
    out = fused_moe_fp8.fused_moe_fp8(*cuda[:7], 0, block)
    err = (out.double().cpu() - ref.double())
    assert err.norm() <= 2.0 ** -6 * ref.double().norm(), (err.norm() / ref.double().norm()).item()
    det = fused_moe_fp8.fused_moe_fp8(*cuda[:7], 0, block, deterministic=True)
    err = (det.double().cpu() - ref.double())
    assert err.norm() <= 2.0 ** -6 * ref.double().norm(), (err.norm() / ref.double().norm()).item()
    xc, (w13, s13, w2, s2), wc, ic = cuda[0], cuda[1:5], cuda[5], cuda[6]
    for rows in ([0], [5, 6, 7], list(range(3, 37, 3))):
        part = fused_moe_fp8.fused_moe_fp8(xc[rows], w13, s13, w2, s2, wc[rows], ic[rows], 0, block, deterministic=True)
        assert torch.equal(part, det[rows]), rows
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.cuda.set_sync_debug_mode("error")                         # a host sync raises
        try:
            captured = fused_moe_fp8.fused_moe_fp8(xc, w13, s13, w2, s2, wc, ic, 0, block, deterministic=True)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for seed in (1, 2):                                                 # replayed on new tokens and routing
        x_new, _, w_new, ids_new = moe_case(n, hidden, inter, 8, 2, block, 0, 8, seed=seed, dtype=torch.bfloat16)
        xc.copy_(x_new)
        wc.copy_(w_new)
        ic.copy_(ids_new)
        graph.replay()
        eager = fused_moe_fp8.fused_moe_fp8(xc, w13, s13, w2, s2, wc, ic, 0, block, deterministic=True)
        assert torch.equal(captured, eager), seed


# ------------------------------------------------------------------------- compiled for sm_90, no GPU

def compile_all() -> list[str]:
    """Every FP8 kernel compiled for sm_90 as a launch at a real shape specializes it (strides of 1 become
    constants, pointers and sizes divisible by 16 are marked so), with the wrapper's num_warps. PTX
    checks: IEEE divisions where h or x is quantized (no div.full / approx) and the subnormal rounding's
    add and subtract of 2^14 kept; the GEMMs on tensor cores reading fp8 (wgmma e4m3 for 64-row tiles;
    below, fp8 widened exactly to f16 for mma.sync), their fp8 tiles loaded by cp.async (pipelined),
    never byte by byte; relaxed atomics in the down kernel."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from rollout.models.kernels.fp8_gemm import _gemm_kernel, _quant_kernel, num_warps
    from rollout.models.kernels.fused_moe_fp8 import _down_kernel, _down_terms_kernel, _gate_up_kernel

    target = GPUTarget("cuda", 90, 32)
    unit = {"stride_xk", "stride_wk", "stride_xsk", "stride_wsk", "stride_sk", "stride_on"}
    div16 = {"M", "N", "K", "hidden", "inter", "stride_xm", "stride_wn", "stride_we", "stride_om", "stride_xq",
             "stride_hq", "stride_out", "stride_t", "stride_x", "stride_q", "cols"}
    done = []

    def build(fn, sig: dict, const: dict, label: str, *, quantizes=False, atomics=False):
        const = dict(const, **{name: 1 for name in fn.arg_names if name in unit})
        signature = {name: "constexpr" if name in const else sig.get(name, "i32") for name in fn.arg_names}
        attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
                 if name not in const and (name.endswith("_ptr") or name in div16)}
        warps = num_warps(const["BLOCK_M"]) if "BLOCK_M" in const else 4
        ptx = triton.compile(ASTSource(fn, signature, constexprs=const, attrs=attrs), target=target,
                             options=dict(num_warps=warps)).asm["ptx"]
        lines = [re.sub(r"^@!?%p\d+\s+", "", line.strip()) for line in ptx.splitlines()]
        if quantizes:
            assert any(line.startswith("div.rn.f32") for line in lines), f"{label}: no div.rn.f32"
            bad = [line for line in lines
                   if line.startswith("div.") and not line.startswith(("div.rn.", "div.s", "div.u"))]
            assert not bad, f"{label}: inexact divisions {bad[:3]}"
            # the subnormal rounding's (|v| + 2^14) - 2^14 must survive compilation
            plus = [line for line in lines if line.startswith("add.f32") and "0f46800000" in line]
            minus = [line for line in lines if (line.startswith("add.f32") and "0fC6800000" in line)
                     or (line.startswith("sub.f32") and "0f46800000" in line)]
            assert plus and len(minus) == len(plus), f"{label}: 2^14 rounding folded ({len(plus)}, {len(minus)})"
        found = [line for line in lines if line.startswith(("atom.", "red."))]
        if atomics:
            assert found and all(".relaxed" in a and "acq_rel" not in a for a in found), f"{label}: {found[:3]}"
        if "BLOCK_K" in const:
            # NOTE: 64-row tiles: Hopper's fp8 wgmma; smaller ones: fp8 widened to f16 (exact) for mma.sync
            want = ("wgmma.mma_async", "e4m3.e4m3") if const["BLOCK_M"] >= 64 else ("mma.sync", "f16.f16")
            assert any(line.startswith(want[0]) and want[1] in line for line in lines), f"{label}: no {want}"
            assert any("e4m3" in line for line in lines if line.startswith(("cvt.", "wgmma."))), label
            assert any(line.startswith("cp.async") for line in lines), f"{label}: tiles not loaded by cp.async"
            assert not any(line.startswith("ld.global.b8") for line in lines), f"{label}: fp8 loaded byte by byte"
        done.append(label)

    for dtype in ("fp32", "bf16"):
        build(_quant_kernel, {"x_ptr": f"*{dtype}", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "eps": "fp32"},
              dict(BLOCK_R=16, BLOCK_G=128, FP8_MAX=448.0), f"quant/{dtype}", quantizes=True)
    gemm_sig = {"x_ptr": "*fp8e4nv", "w_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "ws_ptr": "*fp32"}
    for dtype, block_m in (("fp32", 16), ("bf16", 32), ("bf16", 64)):
        build(_gemm_kernel, dict(gemm_sig, out_ptr=f"*{dtype}"),
              dict(BLOCK_M=block_m, BLOCK_N=128, BLOCK_K=128, ROWWISE=False), f"gemm/{dtype}/m{block_m}")
    moe_sig = {"xq_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32", "hq_ptr": "*fp8e4nv",
               "hs_ptr": "*fp32", "pairs_ptr": "*i32", "block_expert_ptr": "*i32", "eps": "fp32",
               "out_ptr": "*fp32", "weights_ptr": "*fp32", "terms_ptr": "*bf16"}
    for block_m in (16, 64):
        build(_gate_up_kernel, moe_sig, dict(BLOCK_M=block_m, BLOCK_N=128, BLOCK_K=128, ROWWISE=False, FP8_MAX=448.0),
              f"gate_up/m{block_m}", quantizes=True)
        build(_down_kernel, moe_sig, dict(BLOCK_M=block_m, BLOCK_N=128, BLOCK_K=128), f"down/m{block_m}",
              atomics=True)
    build(_down_terms_kernel, moe_sig, dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, ROWWISE=False), "down_terms/bf16")
    return done


COMPILED = ["quant/fp32", "quant/bf16", "gemm/fp32/m16", "gemm/bf16/m32", "gemm/bf16/m64", "gate_up/m16", "down/m16",
            "gate_up/m64", "down/m64", "down_terms/bf16"]


@pytest.mark.slow
def test_fp8_kernels_compile_for_sm90():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert proc.stdout.split() == COMPILED


if __name__ == "__main__":
    print("\n".join(compile_all()))
