"""Block-scaled FP8 W8A8 (DeepSeek-V3's recipe, as SGLang runs it) in plain torch: the definitions the
Triton kernels of fp8_gemm.py and fused_moe_fp8.py are tested against.

float8_e4m3fn: 4 exponent bits (bias 7), 3 mantissa bits, largest finite 448, no infinities.
- Weights: w_fp8 [N, K] with w_scale_inv [ceil(N / bn), ceil(K / bk)] fp32 (a checkpoint's
  `weight_scale_inv`); w[n, k] = w_fp8[n, k] * w_scale_inv[n // bn, k // bk]. The last row or column
  block may be partial.
- Activations, dynamic per token group (SGLang's per_token_group_quant_fp8): groups of `group`
  columns of a row (the last one may be partial), scale = max(amax |x| over the group, FP8_EPS) / 448
  in fp32, x_fp8 = clamp(x / scale, -448, 448) rounded to nearest even; x ~ x_fp8 * scale.
- GEMM: out[m, n] = sum over k-blocks kb, in order, of
  (sum_{k in kb} x_fp8[m, k] * w_fp8[n, k], in fp32) * x_scale[m, kb] * w_scale[n // bn, kb];
  the activation groups are the weight's k-blocks (group = bk).
- Fused MoE: x quantized per token before w13, the intermediate h = silu(gate) * up (fp32) quantized
  again before w2 (SGLang's fused_moe with use_fp8_w8a8 and block_shape; there gate and up are rounded
  to the model dtype before SiLU, here h is made from the fp32 accumulators).
"""
from __future__ import annotations

from typing import Optional

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
FP8_EPS = 1e-10                 # lower bound of a group's amax (SGLang's eps): an all-zero group gets a tiny scale
DEFAULT_BLOCK = (128, 128)      # (bn, bk), DeepSeek-V3's weight_block_size


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def quantize_fp8_per_token_group(x: torch.Tensor, group: int = 128,
                                 eps: float = FP8_EPS) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (any float dtype) -> (x_fp8 float8_e4m3fn [M, K], scales fp32 [M, ceil(K / group)]):
    scale = max(amax |x| over the group, eps) / 448, x_fp8 = RNE(clamp(x / scale, -448, 448)), in fp32."""
    assert x.dim() == 2 and group > 0, (x.shape, group)
    m, k = x.shape
    g = cdiv(k, group)
    xf = x.float()
    padded = torch.nn.functional.pad(xf, (0, g * group - k)).view(m, g, group)    # [M, G, group], tail zeros
    scales = padded.abs().amax(dim=2).clamp(min=eps) / FP8_MAX                    # [M, G]
    per_col = scales.repeat_interleave(group, dim=1)[:, :k]                       # [M, K]
    return (xf / per_col).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scales


def dequantize_fp8_blocks(q: torch.Tensor, scales: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """q [..., R, C] float8 with scales [..., ceil(R / br), ceil(C / bc)] -> fp32 q * scale of its block.
    Per-token-group activations are block (1, group)."""
    br, bc = block
    r, c = q.shape[-2:]
    assert scales.shape[-2:] == (cdiv(r, br), cdiv(c, bc)), (q.shape, scales.shape, block)
    s = scales.float().repeat_interleave(br, dim=-2)[..., :r, :].repeat_interleave(bc, dim=-1)[..., :c]
    return q.float() * s


def check_block_scales(w: torch.Tensor, w_scale_inv: torch.Tensor, block: tuple[int, int]) -> None:
    """w float8 [..., N, K] with fp32 w_scale_inv [..., ceil(N / bn), ceil(K / bk)]."""
    n, k = w.shape[-2:]
    assert w.dtype == FP8_DTYPE and w_scale_inv.dtype == torch.float32, (w.dtype, w_scale_inv.dtype)
    assert w_scale_inv.shape == (*w.shape[:-2], cdiv(n, block[0]), cdiv(k, block[1])), \
        (w.shape, w_scale_inv.shape, block)


def w8a8_block_fp8_matmul_reference(x_fp8: torch.Tensor, x_scales: torch.Tensor, w_fp8: torch.Tensor,
                                    w_scale_inv: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK,
                                    out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x_fp8 [M, K], x_scales [M, ceil(K / bk)], w_fp8 [N, K], w_scale_inv [ceil(N / bn), ceil(K / bk)]
    -> [M, N] out_dtype: the block-scaled GEMM of the module docstring, accumulated in fp32 one k-block
    at a time (acc + (partial * x_scale) * w_scale)."""
    bn, bk = block
    m, k = x_fp8.shape
    n = w_fp8.shape[0]
    assert x_fp8.dtype == FP8_DTYPE and w_fp8.shape[1] == k, (x_fp8.dtype, x_fp8.shape, w_fp8.shape)
    assert x_scales.shape == (m, cdiv(k, bk)), (x_scales.shape, x_fp8.shape, block)
    check_block_scales(w_fp8, w_scale_inv, block)
    w_scale_cols = w_scale_inv.repeat_interleave(bn, dim=0)[:n]                  # [N, KB]
    acc = torch.zeros((m, n), dtype=torch.float32, device=x_fp8.device)
    for kb in range(cdiv(k, bk)):
        cols = slice(kb * bk, min(k, (kb + 1) * bk))
        partial = x_fp8[:, cols].float() @ w_fp8[:, cols].float().T              # [M, N], products exact in fp32
        acc = acc + partial * x_scales[:, kb, None] * w_scale_cols[None, :, kb]
    return acc.to(out_dtype)


def apply_w8a8_block_fp8_linear_reference(x: torch.Tensor, w_fp8: torch.Tensor, w_scale_inv: torch.Tensor,
                                          block: tuple[int, int] = DEFAULT_BLOCK,
                                          bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [..., K] -> [..., N] in x.dtype: x quantized per token group of bk, the block-scaled GEMM,
    rounded to x.dtype, then + bias."""
    k = x.shape[-1]
    xq, xs = quantize_fp8_per_token_group(x.reshape(-1, k), block[1])
    out = w8a8_block_fp8_matmul_reference(xq, xs, w_fp8, w_scale_inv, block, x.dtype)
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], w_fp8.shape[0])


def check_moe_fp8(x: torch.Tensor, w13: torch.Tensor, w13_scale_inv: torch.Tensor, w2: torch.Tensor,
                  w2_scale_inv: torch.Tensor, block: tuple[int, int]) -> tuple[int, int, int]:
    """Shapes of the FP8 experts -> (num_experts, hidden, inter). w13 [E, 2I, H] (gate rows then up
    rows) with w13_scale_inv [E, 2 * ceil(I / bn), ceil(H / bk)]: the gate half's block scales then the
    up half's, each half blocked on its own (as a checkpoint's gate_proj and up_proj scales, concatenated;
    when bn divides I this is [E, 2I / bn, H / bk]). w2 [E, H, I] with w2_scale_inv [E, ceil(H / bn), ceil(I / bk)]."""
    bn, bk = block
    hidden = x.shape[1]
    num_experts, inter = w13.shape[0], w2.shape[2]
    assert w13.shape == (num_experts, 2 * inter, hidden) and w2.shape == (num_experts, hidden, inter), \
        (x.shape, w13.shape, w2.shape)
    assert w13.dtype == FP8_DTYPE and w2.dtype == FP8_DTYPE, (w13.dtype, w2.dtype)
    assert w13_scale_inv.shape == (num_experts, 2 * cdiv(inter, bn), cdiv(hidden, bk)), \
        (w13_scale_inv.shape, w13.shape, block)
    check_block_scales(w2, w2_scale_inv, block)
    return num_experts, hidden, inter


def _held_pairs(topk_ids: torch.Tensor, expert_lo: int, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (local expert [P] of each pair p = token * top_k + slot, -1 where another rank holds it; the
    local experts that got a pair)."""
    local = topk_ids.reshape(-1) - expert_lo
    local = torch.where((local >= 0) & (local < num_experts), local, -1)
    return local, local[local >= 0].unique()


def moe_gate_up_fp8_reference(x_fp8: torch.Tensor, x_scales: torch.Tensor, w13: torch.Tensor,
                              w13_scale_inv: torch.Tensor, topk_ids: torch.Tensor, expert_lo: int,
                              block: tuple[int, int] = DEFAULT_BLOCK) -> torch.Tensor:
    """The fused MoE's first half: x_fp8 [N, H] with x_scales [N, ceil(H / bk)] -> h fp32 [N * K, I]
    per pair (token * top_k + slot) = silu(gate) * up of the pair's expert (rows of pairs held elsewhere: 0)."""
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    half = cdiv(inter, block[0])
    top_k = topk_ids.shape[1]
    local, used = _held_pairs(topk_ids, expert_lo, num_experts)
    h = torch.zeros((local.numel(), inter), dtype=torch.float32, device=x_fp8.device)
    for e in used.tolist():
        rows = (local == e).nonzero().squeeze(1)
        tokens = rows // top_k
        xq, xs = x_fp8.index_select(0, tokens), x_scales.index_select(0, tokens)
        gate = w8a8_block_fp8_matmul_reference(xq, xs, w13[e, :inter], w13_scale_inv[e, :half], block)
        up = w8a8_block_fp8_matmul_reference(xq, xs, w13[e, inter:], w13_scale_inv[e, half:], block)
        h[rows] = gate / (1.0 + torch.exp(-gate)) * up
    return h


def moe_down_fp8_reference(h_fp8: torch.Tensor, h_scales: torch.Tensor, w2: torch.Tensor,
                           w2_scale_inv: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                           expert_lo: int, block: tuple[int, int] = DEFAULT_BLOCK,
                           out_dtype: torch.dtype = torch.float32, deterministic: bool = False,
                           per_slot: bool = False) -> torch.Tensor:
    """The fused MoE's second half: h_fp8 [N * K, I] with h_scales [N * K, ceil(I / bk)] per pair ->
    [N, H] out_dtype. Default: the fp32 sum over slots of topk_weight * y, rounded once at the end.
    deterministic: each term y rounded to out_dtype times the weight in out_dtype, the slots added in
    order (rollout.exact.sum_slots); per_slot: the terms [N, K, H] unsummed."""
    from rollout.exact import sum_slots

    n, top_k = topk_ids.shape
    num_experts, hidden = w2.shape[0], w2.shape[1]
    local, used = _held_pairs(topk_ids, expert_lo, num_experts)
    y = torch.zeros((local.numel(), hidden), dtype=torch.float32, device=h_fp8.device)   # [P, H]
    for e in used.tolist():
        rows = (local == e).nonzero().squeeze(1)
        y[rows] = w8a8_block_fp8_matmul_reference(h_fp8.index_select(0, rows), h_scales.index_select(0, rows),
                                                  w2[e], w2_scale_inv[e], block)
    weights = topk_weights.reshape(-1, 1)
    if not (deterministic or per_slot):
        out = torch.zeros((n, hidden), dtype=torch.float32, device=h_fp8.device)
        for j in range(top_k):
            out = out + (y * weights.float()).view(n, top_k, hidden)[:, j]
        return out.to(out_dtype)
    held = (local >= 0)[:, None]
    terms = torch.where(held, y.to(out_dtype) * weights.to(out_dtype), 0).to(out_dtype).view(n, top_k, hidden)
    return terms if per_slot else sum_slots(terms)


def fused_moe_fp8_reference(x: torch.Tensor, w13: torch.Tensor, w13_scale_inv: torch.Tensor, w2: torch.Tensor,
                            w2_scale_inv: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                            expert_lo: int, block: tuple[int, int] = DEFAULT_BLOCK, *, deterministic: bool = False,
                            per_slot: bool = False) -> torch.Tensor:
    """x [N, H]; FP8 experts [expert_lo, expert_lo + E) as check_moe_fp8; topk_weights float32 [N, K],
    topk_ids int64 [N, K] (global ids) -> [N, H] in x.dtype: x quantized per token group of bk,
    h = silu(gate) * up in fp32 quantized per pair group of bk, then the down GEMM and the weighted sum
    over the slots held here (deterministic / per_slot: as moe_down_fp8_reference)."""
    check_moe_fp8(x, w13, w13_scale_inv, w2, w2_scale_inv, block)
    xq, xs = quantize_fp8_per_token_group(x, block[1])
    h = moe_gate_up_fp8_reference(xq, xs, w13, w13_scale_inv, topk_ids, expert_lo, block)
    hq, hs = quantize_fp8_per_token_group(h, block[1])
    return moe_down_fp8_reference(hq, hs, w2, w2_scale_inv, topk_weights, topk_ids, expert_lo, block, x.dtype,
                                  deterministic, per_slot)
