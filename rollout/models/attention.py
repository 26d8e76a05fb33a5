"""PagedAttention: attention over a request's KV slots in the KVPool, batched with padding."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rollout.forward_batch import ForwardBatch


class PagedAttention(nn.Module):
    """Writes this forward's k/v into the pool, then attends over every request's slots at once.

    Queries are scattered into a padded [B, max_extend] grid (fb.q_pad_index), keys/values are
    gathered from the pool as [B, max_seq] (fb.kv_indices) and one SDPA call covers the batch.
    """

    def __init__(self, *, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 sliding_window: int | None = None):
        super().__init__()
        assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.sliding_window = sliding_window
        self.scale = head_dim ** -0.5

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fb: ForwardBatch,
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """q [N, H, D], k/v [N, kvH, D] -> [N, H*D]. attn_mask overrides fb.attn_mask (sliding window)."""
        self.write_kv(k, v, fb)
        return self.attend(q, fb, attn_mask)

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, fb: ForwardBatch) -> None:
        """Stores this forward's k/v [N, kvH, D] at fb.out_cache_loc (token-wise: graph-safe)."""
        fb.kv_pool.write(self.layer_id, fb.out_cache_loc, k, v)

    def attend(self, q: torch.Tensor, fb: ForwardBatch, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """q [N, H, D] over the KV already in the pool -> [N, H*D] (the step's own attention grid)."""
        n, h, d = q.shape
        bsz, seq = fb.kv_indices.shape
        if fb.segments and attn_mask is None:
            # a decode batch in runs of similar length (one query per request, in batch order)
            return torch.cat([self._decode_grid(q[s.lo:s.hi], s.kv_flat, s.mask, fb.kv_pool) for s in fb.segments])
        # every request has max_extend tokens (decode; a full bucket): the grid is q itself
        full = n == bsz * fb.max_extend
        mask = fb.attn_mask if attn_mask is None else attn_mask              # [B, 1, E, S]
        if full and fb.max_extend == 1:
            return self._decode_grid(q, fb.kv_indices.reshape(-1), mask, fb.kv_pool)
        keys, values = self._gather(fb.kv_pool, fb.kv_indices.reshape(-1), bsz, seq, q.dtype)
        if full:
            q_pad = q
        else:
            q_pad = q.new_zeros(bsz * fb.max_extend, h, d)
            q_pad[fb.q_pad_index] = q
        q_pad = q_pad.view(bsz, fb.max_extend, h, d).transpose(1, 2)         # [B, H, E, D]
        out = F.scaled_dot_product_attention(
            q_pad, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask,
            scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads)  # [B, H, E, D]
        out = out.transpose(1, 2).reshape(bsz * fb.max_extend, h * d)
        return out if full else out[fb.q_pad_index]

    def _gather(self, pool, slots: torch.Tensor, bsz: int, seq: int,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [B, S, kvH, D] of slots [B * S] (request-major), one gather for both."""
        # NOTE: padded key columns read the sink slot or a stale slot; they are masked out, but
        # must hold finite values (0 * NaN is NaN after softmax): every slot only ever holds real k/v.
        # (index_select, not advanced indexing: several times faster for this row gather on CPU)
        kv = pool.kv_buffers[self.layer_id].index_select(0, slots)
        kv = kv.view(bsz, seq, 2, self.num_kv_heads, self.head_dim).to(dtype)
        return kv[:, :, 0], kv[:, :, 1]

    def _decode_grid(self, q: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor, pool) -> torch.Tensor:
        """One query per request: q [B, H, D], slots [B * S], mask [B, 1, 1, S] -> [B, H*D]."""
        bsz, h, d = q.shape
        kvh = self.num_kv_heads
        keys, values = self._gather(pool, slots, bsz, mask.shape[-1], q.dtype)
        if kvh != h:
            # GQA: each kv head's query heads become its query rows (same math, and the CPU
            # kernel is faster than with enable_gqa)
            out = F.scaled_dot_product_attention(
                q.view(bsz, kvh, h // kvh, d), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask,
                scale=self.scale)                                            # [B, kvH, G, D]
        else:
            out = F.scaled_dot_product_attention(
                q.view(bsz, 1, h, d).transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                attn_mask=mask, scale=self.scale)                            # [B, H, 1, D]
        return out.reshape(bsz, h * d)

    @staticmethod
    def sliding_window_mask(fb: ForwardBatch, window: int) -> torch.Tensor:
        """fb.attn_mask restricted to keys at positions > q_pos - window (HF's sliding overlay)."""
        dev = fb.attn_mask.device
        prefix = fb.seq_lens - fb.extend_lens                                 # [B]
        q_pos = prefix[:, None] + torch.arange(fb.max_extend, device=dev)     # [B, E]
        key_pos = torch.arange(fb.attn_mask.shape[-1], device=dev)            # [S]
        in_window = key_pos[None, None, :] > (q_pos[:, :, None] - window)     # [B, E, S]
        mask = fb.attn_mask & in_window[:, None]
        # NOTE: a padded query row may lose every key; give it key 0 back so softmax stays finite.
        mask[..., 0] |= ~mask.any(-1)
        return mask
