"""The online-softmax step the Triton paged attention kernels share (inlined into each kernel).

One block of keys, gathered through the slot table, updates a running (max, sum, output) of the
query rows: the flash-attention recurrence in fp32. A row that has seen no key yet keeps max
-inf without NaNs (its scores are all -inf: exp(-inf - 0) = 0).

Attention sinks (gpt-oss): a head's sink logit joins its rows' softmax denominator and adds no
value. A row whose state starts from sink_state has it as a key already seen: max = sink, sum =
exp(sink - sink) = 1, output 0; the recurrence then rescales it like any key, and a row that sees
no key finishes with output 0 and log-sum-exp = sink.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def attend_block(q, m_i, l_i, acc, KV, Table, pos, n_mask, see, kvh, stride_ks, stride_kt, stride_kh, offs_d,
                 d_mask, scale, IEEE: tl.constexpr, ROWWISE: tl.constexpr = False):
    """q [M, D] (KV's dtype), keys at slots Table[pos] (n_mask: pos in range; see [M, N]: row may
    attend) -> updated m_i [M], l_i [M], acc [M, D]. ROWWISE: products as broadcast sums, the same
    for every row (the interpreter's tl.dot is numpy's BLAS, whose rows depend on their place)."""
    slot = tl.load(Table + pos, mask=n_mask, other=0).to(tl.int64)
    kv_ptr = KV + slot[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :]
    kd_mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(kv_ptr, mask=kd_mask, other=0.0)                                 # [N, D]
    v = tl.load(kv_ptr + stride_kt, mask=kd_mask, other=0.0)                     # [N, D]
    if ROWWISE:
        s = tl.sum(q[:, None, :].to(tl.float32) * k[None, :, :].to(tl.float32), axis=2)
    elif IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = tl.where(see, s * scale, float("-inf"))                                 # [M, N]
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if ROWWISE:
        pv = tl.sum(p[:, :, None] * v[None, :, :].to(tl.float32), axis=1)
    elif IEEE:
        pv = tl.dot(p, v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def sink_state(Sinks, heads, has):
    """Sinks [H] fp32 at heads [M] (has [M]: the row takes its sink) -> the rows' starting (max [M],
    sum [M]): (sink, 1) with a sink, (-inf, 0) (the empty state) without."""
    m = tl.load(Sinks + heads, mask=has, other=float("-inf")).to(tl.float32)
    return m, tl.where(m == float("-inf"), 0.0, 1.0)


@triton.jit
def finish_rows(m_i, l_i, acc):
    """-> the rows' attention output [M, D] and log-sum-exp [M] (-inf for a row with no key)."""
    seen = l_i > 0
    safe = tl.where(seen, l_i, 1.0)
    return acc / safe[:, None], tl.where(seen, m_i + tl.log(safe), float("-inf"))


def check_sinks(sinks: torch.Tensor | None, heads: int) -> None:
    """A kernel's sinks: None or fp32 [heads], contiguous (one logit per query head)."""
    if sinks is not None:
        assert sinks.shape == (heads,) and sinks.dtype == torch.float32 and sinks.is_contiguous(), \
            (tuple(sinks.shape), sinks.dtype, heads)
