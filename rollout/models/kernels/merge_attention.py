"""Triton kernel: merges partial attention states (output, log-sum-exp) into one output.

The split-KV decode kernel and the cascade kernel each leave P partial softmaxes per (request,
head): outputs o_p over disjoint key sets and their log-sum-exps l_p. The exact attention over
the union is sum_p exp(l_p - L) o_p with L = log sum_p exp(l_p) (what DecodeCascade.attend does
in torch for two parts). A part with no keys has l_p = -inf and weighs nothing.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _merge_states_kernel(OutPart, LsePart, Out, stride_pb, stride_ph, stride_pp, stride_lb, stride_lh,
                         stride_ob, stride_oh, NUM_HEADS: tl.constexpr, NUM_PARTS: tl.constexpr,
                         HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr,
                         BLOCK_D: tl.constexpr):
    b = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_p = tl.arange(0, BLOCK_P)
    offs_d = tl.arange(0, BLOCK_D)
    hp_mask = (offs_h < NUM_HEADS)[:, None] & (offs_p < NUM_PARTS)[None, :]
    d_mask = offs_d < HEAD_DIM
    lse = tl.load(LsePart + b * stride_lb + offs_h[:, None] * stride_lh + offs_p[None, :], mask=hp_mask,
                  other=float("-inf"))                                        # [H, P]
    top = tl.max(lse, 1)
    top = tl.where(top == float("-inf"), 0.0, top)
    w = tl.exp(lse - top[:, None])                                            # [H, P]
    o = tl.load(OutPart + b * stride_pb + offs_h[:, None, None] * stride_ph + offs_p[None, :, None] * stride_pp
                + offs_d[None, None, :], mask=hp_mask[:, :, None] & d_mask[None, None, :], other=0.0)  # [H, P, D]
    total = tl.sum(w, 1)
    merged = tl.sum(o * w[:, :, None], 1) / tl.where(total > 0, total, 1.0)[:, None]           # [H, D]
    tl.store(Out + b * stride_ob + offs_h[:, None] * stride_oh + offs_d[None, :], merged.to(Out.dtype.element_ty),
             mask=(offs_h < NUM_HEADS)[:, None] & d_mask[None, :])


def merge_attention_states(out_part: torch.Tensor, lse_part: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out_part [B, H, P, D] fp32, lse_part [B, H, P] fp32 -> out [B, H, D] (written and returned)."""
    bsz, heads, parts, dim = out_part.shape
    if bsz == 0:
        return out
    assert out_part.stride(3) == 1 and lse_part.stride(2) == 1 and out.stride(2) == 1
    # NOTE: a GPU program per (request, head); the interpreter pays per program, so one per request
    block_h = 1 if out.is_cuda else triton.next_power_of_2(heads)
    _merge_states_kernel[(bsz, triton.cdiv(heads, block_h))](
        out_part, lse_part, out, out_part.stride(0), out_part.stride(1), out_part.stride(2),
        lse_part.stride(0), lse_part.stride(1), out.stride(0), out.stride(1),
        NUM_HEADS=heads, NUM_PARTS=parts, HEAD_DIM=dim, BLOCK_H=block_h, BLOCK_P=triton.next_power_of_2(parts),
        BLOCK_D=triton.next_power_of_2(dim))
    return out
