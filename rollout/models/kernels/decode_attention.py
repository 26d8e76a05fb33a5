"""Triton paged decode attention: one query per request over its KV slots, split over the KV length.

Replaces the decode path of PagedAttention (rollout/models/attention/paged.py, which stays the
reference). Program (request, kv head, split) takes the kv head's G query heads as rows and
attends them over its share of the request's keys, read once through the slot table; it leaves
a partial output and its log-sum-exp, and merge_attention_kernel merges the splits. A request's
keys are cut into NUM_SPLITS even shares (of MIN_SPLIT keys at least) at run time, from its own
length only: the grid depends only on shapes (CUDA graph safe) and a request's result does not
depend on the batch around it. Math in fp32. Attention sinks (one logit per query head that joins
the softmax denominator, gpt-oss): split 0 starts from its rows' sinks, so the merge counts each
sink once, as a part of its own.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from rollout.models.kernels.attention_block import attend_block, check_sinks, finish_rows, sink_state
from rollout.models.kernels.merge_attention import merge_attention_states

NO_WINDOW = 1 << 30
MIN_SPLIT = 64   # GPU: fewest keys per split (a split that short is all launch and merge)


@triton.jit
def _decode_partial_kernel(Q, KV, Table, KvStart, KvLen, OutPart, LsePart, Sinks,
                           stride_qb, stride_qh, stride_ks, stride_kt, stride_kh,
                           stride_pb, stride_ph, stride_pp, stride_lb, stride_lh,
                           scale, window,
                           GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
                           MIN_SPLIT: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                           BLOCK_N: tl.constexpr,
                           IEEE: tl.constexpr, HAS_SINKS: tl.constexpr = False):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    start = tl.load(KvStart + b).to(tl.int64)
    length = tl.load(KvLen + b).to(tl.int32)
    lo = tl.maximum(length - window, 0)                    # sliding window: the last `window` keys
    share = tl.maximum(tl.cdiv(length - lo, NUM_SPLITS), MIN_SPLIT)
    s_lo = lo + split * share
    s_hi = tl.minimum(s_lo + share, length)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_g
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)            # [G, D]
    q = q.to(KV.dtype.element_ty)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    if HAS_SINKS:
        # NOTE: a tensor, not the scalar split == 0 (the interpreter makes int32 of bool & scalar bool)
        m_i, l_i = sink_state(Sinks, heads, g_mask & (offs_g * 0 + split == 0))
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for n0 in range(s_lo, s_hi, BLOCK_N):
        pos = n0 + offs_n
        n_mask = pos < s_hi
        m_i, l_i, acc = attend_block(q, m_i, l_i, acc, KV, Table + start, pos, n_mask, n_mask[None, :], kvh,
                                     stride_ks, stride_kt, stride_kh, offs_d, d_mask, scale, IEEE)
    out, lse = finish_rows(m_i, l_i, acc)
    tl.store(OutPart + b * stride_pb + heads[:, None] * stride_ph + split * stride_pp + offs_d[None, :], out,
             mask=g_mask[:, None] & d_mask[None, :])
    tl.store(LsePart + b * stride_lb + heads * stride_lh + split, lse, mask=g_mask)


def default_num_splits(device: torch.device) -> int:
    """Splits per request on a GPU: 16 (with MIN_SPLIT keys at least each, so short contexts use
    fewer); 1 on CPU (the interpreter pays per program; the kernel tests split explicitly).
    NOTE: never a function of the batch: a request's keys are cut the same way whatever batch
    (or CUDA graph bucket) it is in, so its output is bitwise the same."""
    return 16 if device.type == "cuda" else 1


def decode_partials(q: torch.Tensor, kv_buffer: torch.Tensor, table: torch.Tensor, kv_start: torch.Tensor,
                    kv_len: torch.Tensor, out_part: torch.Tensor, lse_part: torch.Tensor, *, splits: int,
                    scale: float, window: int | None = None, sinks: torch.Tensor | None = None) -> None:
    """Stage 1: parts 0 .. splits-1 of out_part [B, H, P, D] / lse_part [B, H, P] (fp32, P >= splits).
    q [B, H, D]; kv_buffer [slots, 2, kvH, D]; request b's keys are at slots
    table[kv_start[b] .. kv_start[b] + kv_len[b] - 1] (table: flat int32/int64). sinks [H] fp32:
    head h's sink logit, counted in part 0 (which then holds it even with no key)."""
    bsz, heads, dim = q.shape
    kvh = kv_buffer.shape[2]
    if bsz == 0:
        return
    assert q.stride(2) == 1 and kv_buffer.stride(3) == 1 and table.is_contiguous()
    group = heads // kvh
    check_sinks(sinks, heads)
    _decode_partial_kernel[(bsz, kvh, splits)](
        q, kv_buffer, table, kv_start, kv_len, out_part, lse_part, sinks,
        q.stride(0), q.stride(1), kv_buffer.stride(0), kv_buffer.stride(1), kv_buffer.stride(2),
        out_part.stride(0), out_part.stride(1), out_part.stride(2), lse_part.stride(0), lse_part.stride(1),
        scale, NO_WINDOW if window is None else window,
        GROUP=group, HEAD_DIM=dim, NUM_SPLITS=splits, MIN_SPLIT=MIN_SPLIT if q.is_cuda else 1,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_D=max(16, triton.next_power_of_2(dim)), BLOCK_N=32, IEEE=kv_buffer.dtype == torch.float32,
        HAS_SINKS=sinks is not None)


def decode_attention(q: torch.Tensor, kv_buffer: torch.Tensor, kv_indices: torch.Tensor, seq_lens: torch.Tensor,
                     *, scale: float, window: int | None = None, num_splits: int | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, H, D] (request b's query at position seq_lens[b] - 1), kv_buffer [slots, 2, kvH, D],
    kv_indices [B, S] (request b's slots by position; cells past seq_lens[b] are not read) ->
    [B, H*D] in q's dtype. sinks [H] fp32: query head h's sink logit (None: no sinks); a request
    with no key then gets 0."""
    bsz, heads, dim = q.shape
    if bsz == 0:
        return q.new_zeros(0, heads * dim)
    splits = num_splits or default_num_splits(q.device)
    table = kv_indices.contiguous()
    kv_start = torch.arange(bsz, device=q.device, dtype=torch.int64) * table.shape[1]
    out_part = torch.empty(bsz, heads, splits, dim, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(bsz, heads, splits, dtype=torch.float32, device=q.device)
    decode_partials(q, kv_buffer, table, kv_start, seq_lens, out_part, lse_part, splits=splits, scale=scale,
                    window=window, sinks=sinks)
    if splits == 1:
        return out_part.view(bsz, heads * dim).to(q.dtype)
    out = torch.empty(bsz, heads, dim, dtype=q.dtype, device=q.device)
    return merge_attention_states(out_part, lse_part, out).view(bsz, heads * dim)
