"""Random paged-attention batches over a real KVPool, for the kernel and metadata tests."""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from rollout.batch.forward_batch import ForwardBatch
from rollout.batch.kv_pool import SINK_SLOT, KVPool
from rollout.models.attention.paged import PagedAttention


def slot_table(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """ForwardBatch.build's kv_indices from each request's KV slots by position: [B, longest] int64,
    shorter rows padded with SINK_SLOT."""
    return torch.nn.utils.rnn.pad_sequence(list(rows), batch_first=True, padding_value=SINK_SLOT)


def attention_case(prefix_lens: Sequence[int], extend_lens: Sequence[int], *, heads: int = 4, kv_heads: int = 2,
                   dim: int = 32, seed: int = 0, dtype: torch.dtype = torch.float32, device: str = "cpu",
                   shared: Optional[Sequence[tuple[int, Sequence[int]]]] = None, window: Optional[int] = None):
    """-> (layer, q [N, H, D], fb, groups): request b's slots scattered over the pool; `shared`
    (prefix length P, member rows) gives members the same first P slots (a cached GRPO prompt)."""
    g = torch.Generator().manual_seed(seed)
    seq = [p + e for p, e in zip(prefix_lens, extend_lens)]
    total = sum(seq) + 8
    pool = KVPool(num_slots=total, num_layers=1, num_kv_heads=kv_heads, head_dim=dim, dtype=dtype, device=device)
    pool.kv_buffers[0].copy_(torch.randn(pool.kv_buffers[0].shape, generator=g).to(dtype))
    perm = (torch.randperm(total, generator=g) + 1).tolist()
    rows = []
    for n in seq:
        rows.append(torch.tensor(perm[:n], dtype=torch.int64))
        perm = perm[n:]
    groups = tuple((p, tuple(m)) for p, m in (shared or ()))
    for p, members in groups:
        for r in members[1:]:
            rows[r][:p] = rows[members[0]][:p]
    out_loc = torch.cat([r[p:] for r, p in zip(rows, prefix_lens)]) if rows else torch.zeros(0, dtype=torch.int64)
    fb = ForwardBatch.build(input_ids=[0] * sum(extend_lens), out_cache_loc=out_loc, prefix_lens=list(prefix_lens),
                            extend_lens=list(extend_lens), kv_indices=slot_table(rows), kv_pool=pool, device=device,
                            segment_attention=bool(groups), prefix_groups=groups)
    layer = PagedAttention(layer_id=0, num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, sliding_window=window)
    q = torch.randn(fb.num_tokens, heads, dim, generator=g).to(device=device, dtype=dtype)
    return layer, q, fb, groups


def reference(layer: PagedAttention, q: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
    """PagedAttention's torch path (the sliding-window mask when the layer has a window), fp32."""
    mask = PagedAttention.sliding_window_mask(fb, layer.sliding_window) if layer.sliding_window else None
    return layer.torch_attend(q.float(), fb, mask)


class _SinkModule(nn.Module):
    """What transformers' gpt-oss eager_attention_forward reads from its attention module."""

    def __init__(self, sinks: torch.Tensor, groups: int):
        super().__init__()
        self.sinks = sinks
        self.num_key_value_groups = groups


def hf_sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], scale: float,
                      sinks: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """transformers' gpt-oss eager attention itself, run in dtype (float64 by default: the
    reference): q [B, H, E, D], k/v [B, kvH, S, D], mask bool broadcastable to [B, 1 or H, E, S]
    (True = attend; to HF as an additive 0 / -inf mask) or None, sinks [H] -> [B, H, E, D] in dtype."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    module = _SinkModule(sinks.to(dtype), q.shape[1] // k.shape[1]).eval()
    additive = None
    if mask is not None:
        additive = torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, float("-inf"))
    out, _ = eager_attention_forward(module, q.to(dtype), k.to(dtype), v.to(dtype), additive, scale)
    return out.transpose(1, 2)                                                 # HF's [B, E, H, D] back


def sink_reference(q: torch.Tensor, fb: ForwardBatch, scale: float, sinks: torch.Tensor,
                   window: Optional[int] = None, seq_lens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The paged batch's attention with sinks by hf_sink_attention, request by request (causal,
    the keys of position > q_pos - window with a window) -> [N, H*D] fp64. seq_lens overrides
    fb.seq_lens (each request's queries are its last tokens)."""
    kv = fb.kv_pool.kv_buffers[0]
    seq_lens = fb.seq_lens if seq_lens is None else seq_lens
    out, at = [], 0
    for b, (n, e) in enumerate(zip(seq_lens.tolist(), fb.extend_lens.tolist())):
        cache = kv[fb.kv_indices[b, :n]].permute(1, 2, 0, 3)                    # [2, kvH, S, D]
        q_pos = torch.arange(n - e, n)[:, None]
        key_pos = torch.arange(n)[None, :]
        see = (key_pos <= q_pos) & (key_pos > q_pos - (window or n + 1))         # [E, S]
        rows = q[at:at + e].transpose(0, 1)[None]                               # [1, H, E, D]
        out.append(hf_sink_attention(rows, cache[0][None], cache[1][None], see[None, None], scale, sinks)[0]
                   .transpose(0, 1).reshape(e, -1))
        at += e
    return torch.cat(out)
