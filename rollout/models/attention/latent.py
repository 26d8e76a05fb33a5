"""LatentAttention: the MLA attention core over the KV pool's latent layout (one shared KV head).

With W_UK absorbed into the queries (see mla_attention.py), MLA is multi-query attention in the
latent space: every head's query [kv_lora_rank + rope] attends over the cached rows
[latent | rope key] of the pool, the values are the latent part of the same rows, and the
output stays in the latent space [H, kv_lora_rank] (W_UV is applied afterwards, token-wise).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rollout import exact as exact_ops
from rollout.batch.forward_batch import ForwardBatch
from rollout.models.attention.paged import pad_keys_to_tiles


class LatentAttention(nn.Module):
    """Same contract as PagedAttention.attend: q [N, H, R + P] over the step's grid -> [N, H * R]."""

    sliding_window = None
    exact = False   # rollout.exact.attention (deterministic inference)

    def __init__(self, *, layer_id: int, num_heads: int, kv_lora_rank: int, rope_dim: int, scale: float):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.kv_lora_rank = kv_lora_rank
        self.width = kv_lora_rank + rope_dim
        self.scale = scale

    def reads_mask(self, fb: ForwardBatch) -> bool:
        return True   # NOTE: MLA always attends with torch (no kernel backend is bound for it)

    def forward(self, q: torch.Tensor, latent: torch.Tensor, v: None, fb: ForwardBatch,
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """PagedAttention.forward's contract (the compiled forward's attention op): the latent rows
        [N, R + P] written, then q [N, H, R + P] attends -> [N, H * R]; v: None (values are latents)."""
        self.write_latent(latent, fb)
        return self.attend(q, fb, attn_mask)

    def write_latent(self, latent: torch.Tensor, fb: ForwardBatch) -> None:
        """latent [N, R + P] (normed latent, rotated rope key) at fb.out_cache_loc (token-wise)."""
        fb.kv_pool.write_latent(self.layer_id, fb.out_cache_loc, latent)

    def attend(self, q: torch.Tensor, fb: ForwardBatch, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """q [N, H, R + P] over the latent KV already in the pool -> [N, H * R].

        NOTE: a DecodeCascade (fb.cascade) is built for the GQA layout; MLA ignores it and attends
        over the step's whole grid, which fb always carries. Deterministic inference (exact):
        rollout.exact.attention over the same grids (the segments too)."""
        pool = fb.kv_pool.kv_buffers[self.layer_id]
        if fb.segments and fb.cascade is None:
            return torch.cat([
                self._grid(q[g.tok_lo:g.tok_hi], pool, g.kv_flat, g.hi - g.lo, g.extend, g.q_pad_index,
                           fb.segment_mask(g, attn_mask))
                for g in fb.segments])
        mask = fb.attn_mask if attn_mask is None else attn_mask             # [B, 1, E, S]
        bsz = fb.kv_indices.shape[0]
        full = q.shape[0] == bsz * fb.max_extend
        return self._grid(q, pool, fb.kv_indices.reshape(-1), bsz, fb.max_extend,
                          None if full else fb.q_pad_index, mask)

    def _grid(self, q: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor, bsz: int, extend: int,
              q_pad_index: torch.Tensor | None, mask: torch.Tensor) -> torch.Tensor:
        """q [N, H, R + P] of bsz requests (grid rows b * extend + i, q_pad_index; None: N == bsz *
        extend), slots [bsz * S] request-major, mask [bsz, 1, extend, S] -> [N, H * R]."""
        n, h, d = q.shape
        if self.exact:
            slots, mask = pad_keys_to_tiles(slots, mask, bsz)
        seq = mask.shape[-1]
        # NOTE: padded key columns read the sink or stale slots; masked, and always finite.
        kv = pool.index_select(0, slots).view(bsz, 1, seq, d).to(q.dtype)  # [B, 1, S, R + P]
        if q_pad_index is not None:
            q_pad = q.new_zeros(bsz * extend, h, d)
            q_pad[q_pad_index] = q
            q = q_pad
        # one KV head: every (query token, head) pair is a query row of that head
        rows = q.view(bsz, 1, extend * h, d)                                # [B, 1, E*H, D]
        row_mask = mask[:, :, :, None, :].expand(bsz, 1, extend, h, seq).reshape(bsz, 1, extend * h, seq)
        # NOTE: values = the same rows (keys and values share one gather); the rope columns of the
        # output are dropped
        if self.exact:
            out = exact_ops.attention(rows, kv, kv, row_mask, self.scale)
        else:
            out = F.scaled_dot_product_attention(rows, kv, kv, attn_mask=row_mask, scale=self.scale)
        out = out[..., :self.kv_lora_rank].reshape(bsz * extend, h * self.kv_lora_rank)
        return out if q_pad_index is None else out[q_pad_index]
