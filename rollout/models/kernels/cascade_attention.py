"""Triton GRPO cascade decode attention: a group's shared prefix read once for all its members.

Replaces DecodeCascade.attend (rollout/batch/decode_cascade.py, the torch reference) on the Triton
backend, over the two levels of PagedKVMetadata (rollout/batch/paged_kv_metadata.py). Level 0: program
(group, kv head, block of rows) takes every member's query heads of that kv head as rows and
attends them over the group's prefix keys, so each prefix key is read once per group instead of
once per sample; it leaves each member's partial output and log-sum-exp in the last part. Level 1:
each request's own keys after the prefix through the split-KV decode kernel (parts 0 .. S-1).
The merge kernel combines all parts by log-sum-exp. Math in fp32. Attention sinks (gpt-oss): each
request's split 0 of level 1 counts its heads' sinks (decode_partials), the prefix part none.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from rollout.models.kernels.attention_block import attend_block, check_sinks, finish_rows
from rollout.models.kernels.decode_attention import decode_partials, default_num_splits
from rollout.models.kernels.merge_attention import merge_attention_states
from rollout.batch.paged_kv_metadata import PagedKVMetadata


@triton.jit
def _shared_prefix_kernel(Q, KV, Table, QoIndptr, KvIndptr, OutPart, LsePart,
                          stride_qb, stride_qh, stride_ks, stride_kt, stride_kh,
                          stride_pb, stride_ph, stride_pp, stride_lb, stride_lh, part, scale,
                          GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr):
    g = tl.program_id(0)
    kvh = tl.program_id(1)
    mblk = tl.program_id(2)
    q_lo = tl.load(QoIndptr + g).to(tl.int64)
    rows = (tl.load(QoIndptr + g + 1).to(tl.int64) - q_lo) * GROUP
    kv_lo = tl.load(KvIndptr + g).to(tl.int32)
    kv_hi = tl.load(KvIndptr + g + 1).to(tl.int32)
    kv_hi = tl.where(mblk * BLOCK_M < rows, kv_hi, kv_lo)   # a block past the group's rows: nothing
    offs_m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < rows
    d_mask = offs_d < HEAD_DIM
    req = q_lo + offs_m // GROUP                                              # [M] query row
    head = kvh * GROUP + offs_m % GROUP                                       # [M] query head
    qd_mask = m_mask[:, None] & d_mask[None, :]
    q = tl.load(Q + req[:, None] * stride_qb + head[:, None] * stride_qh + offs_d[None, :], mask=qd_mask, other=0.0)
    q = q.to(KV.dtype.element_ty)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(kv_lo, kv_hi, BLOCK_N):
        pos = n0 + offs_n
        n_mask = pos < kv_hi
        m_i, l_i, acc = attend_block(q, m_i, l_i, acc, KV, Table, pos, n_mask, n_mask[None, :], kvh,
                                     stride_ks, stride_kt, stride_kh, offs_d, d_mask, scale, IEEE)
    out, lse = finish_rows(m_i, l_i, acc)
    tl.store(OutPart + req[:, None] * stride_pb + head[:, None] * stride_ph + part * stride_pp + offs_d[None, :],
             out, mask=qd_mask)
    tl.store(LsePart + req * stride_lb + head * stride_lh + part, lse, mask=m_mask)


def cascade_decode_attention(q: torch.Tensor, kv_buffer: torch.Tensor, meta: PagedKVMetadata, *, scale: float,
                             num_splits: int | None = None, block_m: int = 16,
                             sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, H, D] (one query per request, batch order), kv_buffer [slots, 2, kvH, D], meta: a
    two-level (cascade) PagedKVMetadata on q's device -> [B, H*D] in q's dtype. sinks [H] fp32:
    query head h's sink logit (None: no sinks)."""
    assert meta.is_cascade and len(meta.levels) == 2
    bsz, heads, dim = q.shape
    if bsz == 0:
        return q.new_zeros(0, heads * dim)
    kvh = kv_buffer.shape[2]
    group = heads // kvh
    check_sinks(sinks, heads)
    prefix, own = meta.levels
    splits = num_splits or default_num_splits(q.device)
    rows = q.index_select(0, meta.order).contiguous()                        # group members adjacent
    out_part = torch.empty(bsz, heads, splits + 1, dim, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(bsz, heads, splits + 1, dtype=torch.float32, device=q.device)
    assert rows.stride(2) == 1 and kv_buffer.stride(3) == 1
    _shared_prefix_kernel[(prefix.num_entries, kvh, triton.cdiv(prefix.max_qo_len * group, block_m))](
        rows, kv_buffer, prefix.kv_indices, prefix.qo_indptr, prefix.kv_indptr, out_part, lse_part,
        rows.stride(0), rows.stride(1), kv_buffer.stride(0), kv_buffer.stride(1), kv_buffer.stride(2),
        out_part.stride(0), out_part.stride(1), out_part.stride(2), lse_part.stride(0), lse_part.stride(1),
        splits, scale, GROUP=group, HEAD_DIM=dim, BLOCK_M=block_m, BLOCK_N=32,
        BLOCK_D=max(16, triton.next_power_of_2(dim)), IEEE=kv_buffer.dtype == torch.float32)
    own_start = own.kv_indptr[:-1]
    own_len = own.kv_indptr[1:] - own_start
    decode_partials(rows, kv_buffer, own.kv_indices, own_start, own_len, out_part, lse_part, splits=splits,
                    scale=scale, sinks=sinks)
    merged = merge_attention_states(out_part, lse_part, torch.empty_like(rows))
    return torch.empty_like(merged).index_copy_(0, meta.order, merged).view(bsz, heads * dim)
