"""Triton paged extend (prefill) attention: each request's new tokens over its cached prefix and
themselves, causally, reading keys through the slot table.

Replaces the prefill path of PagedAttention (rollout/models/attention/paged.py, which stays the
reference). Program (request, query head, block of new tokens): the block's queries sit at
positions kv_len - qo_len + i; it walks the request's keys up to its last query's position
(and from its first query's window start, for sliding-window layers) with an online softmax.
GQA: query head h reads kv head h // G. Math in fp32. Attention sinks (gpt-oss): a query's
softmax starts from its head's sink logit (a key seen before any other, of value 0).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from rollout.models.kernels.attention_block import attend_block, check_sinks, finish_rows, sink_state
from rollout.models.kernels.decode_attention import NO_WINDOW


@triton.jit
def _extend_kernel(Q, KV, Table, QoStart, QoLen, KvStart, KvLen, Out, Sinks,
                   stride_qn, stride_qh, stride_ks, stride_kt, stride_kh, stride_on, stride_oh,
                   scale, window,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_D: tl.constexpr, IEEE: tl.constexpr, ALIGN: tl.constexpr = False,
                   ROWWISE: tl.constexpr = False, HAS_SINKS: tl.constexpr = False):
    b = tl.program_id(0)
    h = tl.program_id(1)
    mblk = tl.program_id(2)
    qo_start = tl.load(QoStart + b).to(tl.int64)
    qo_len = tl.load(QoLen + b).to(tl.int32)
    kv_start = tl.load(KvStart + b).to(tl.int64)
    kv_len = tl.load(KvLen + b).to(tl.int32)
    kvh = h // GROUP
    offs_m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < qo_len
    d_mask = offs_d < HEAD_DIM
    q = tl.load(Q + (qo_start + offs_m)[:, None] * stride_qn + h * stride_qh + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)             # [M, D]
    q = q.to(KV.dtype.element_ty)
    first = kv_len - qo_len                                                   # position of query 0
    q_pos = first + offs_m                                                    # [M]
    blk_first = first + mblk * BLOCK_M
    hi = tl.minimum(kv_len, blk_first + BLOCK_M)     # causal: no key after the block's last query
    hi = tl.where(mblk * BLOCK_M < qo_len, hi, 0)    # a block past the request's tokens: nothing
    lo = tl.maximum(blk_first - window + 1, 0)       # sliding window of the block's first query
    if ALIGN:
        # NOTE: key tiles start at multiples of BLOCK_N: a query's tiles are the same whatever its
        # block (the extra leading / trailing tiles are all masked for it and leave its sums unchanged)
        lo = lo // BLOCK_N * BLOCK_N
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if HAS_SINKS:
        m_i, l_i = sink_state(Sinks, h + tl.zeros([BLOCK_M], tl.int32), m_mask)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        pos = n0 + offs_n
        n_mask = pos < hi
        see = n_mask[None, :] & (pos[None, :] <= q_pos[:, None]) & (pos[None, :] > q_pos[:, None] - window)
        m_i, l_i, acc = attend_block(q, m_i, l_i, acc, KV, Table + kv_start, pos, n_mask, see, kvh,
                                     stride_ks, stride_kt, stride_kh, offs_d, d_mask, scale, IEEE, ROWWISE)
    out, _ = finish_rows(m_i, l_i, acc)
    tl.store(Out + (qo_start + offs_m)[:, None] * stride_on + h * stride_oh + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def extend_attention(q: torch.Tensor, kv_buffer: torch.Tensor, kv_indices: torch.Tensor, extend_lens: torch.Tensor,
                     seq_lens: torch.Tensor, *, max_extend: int, scale: float, window: int | None = None,
                     block_m: int | None = None, exact: bool = False,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [N, H, D] packed (request b's extend_lens[b] new tokens in order, at positions
    seq_lens[b] - extend_lens[b] ..), kv_buffer [slots, 2, kvH, D] (the new tokens' k/v already
    written), kv_indices [B, S] slots by position -> [N, H*D] in q's dtype. max_extend: the
    largest extend_lens (a host int: the grid). exact: batch-invariant (deterministic inference):
    fixed blocks, key tiles aligned at key 0, so a query's bits depend only on its own request's
    keys up to it: decode (extend 1), chunked prefill and a whole prompt agree. sinks [H] fp32:
    query head h's sink logit (None: no sinks); a query that sees no key then gets 0."""
    n, heads, dim = q.shape
    bsz = extend_lens.shape[0]
    check_sinks(sinks, heads)
    out = torch.zeros(n, heads, dim, dtype=q.dtype, device=q.device)
    if n == 0 or bsz == 0:
        return out.view(n, heads * dim)
    # NOTE: the interpreter pays per program: bigger query blocks on CPU
    block_m = (32 if q.is_cuda else 64) if exact or block_m is None else block_m
    table = kv_indices.contiguous()
    kv_start = torch.arange(bsz, device=q.device, dtype=torch.int64) * table.shape[1]
    qo_start = torch.cumsum(extend_lens, 0) - extend_lens
    kvh = kv_buffer.shape[2]
    assert q.stride(2) == 1 and kv_buffer.stride(3) == 1
    _extend_kernel[(bsz, heads, triton.cdiv(max_extend, block_m))](
        q, kv_buffer, table, qo_start, extend_lens, kv_start, seq_lens, out, sinks,
        q.stride(0), q.stride(1), kv_buffer.stride(0), kv_buffer.stride(1), kv_buffer.stride(2),
        out.stride(0), out.stride(1), scale, NO_WINDOW if window is None else window,
        GROUP=heads // kvh, HEAD_DIM=dim, BLOCK_M=block_m, BLOCK_N=32,
        BLOCK_D=max(16, triton.next_power_of_2(dim)), IEEE=kv_buffer.dtype == torch.float32,
        ALIGN=exact, ROWWISE=exact and not q.is_cuda, HAS_SINKS=sinks is not None)
    return out.view(n, heads * dim)
