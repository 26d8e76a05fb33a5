"""PagedAttention: the attention core over a request's KV slots in the KVPool, batched with
padding: the torch path (every kernel's reference), the batch-invariant path of deterministic
inference, and the dispatch to the engine's attention backend (attention/backend.py)."""
from __future__ import annotations

from functools import partial
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from rollout import exact as exact_ops
from rollout.batch.forward_batch import ForwardBatch
from rollout.models.attention.sink_sdpa import sdpa_with_sinks


MASK_BLOCK_CELLS = 1 << 24   # query x key cells of one mask block (16 MiB of bool)


class PagedAttention(nn.Module):
    """Writes this forward's k/v into the pool, then attends over every request's slots at once.

    Queries are scattered into a padded [B, max_extend] grid (fb.q_pad_index), keys/values are
    gathered from the pool as [B, max_seq] (fb.kv_indices) and one SDPA call covers the batch.
    """

    exact = False   # rollout.exact.attention (deterministic inference)

    def __init__(self, *, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 sliding_window: int | None = None, sinks: bool = False):
        super().__init__()
        assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.sliding_window = sliding_window
        self.scale = head_dim ** -0.5
        # gpt-oss: one learned logit per query head joins each softmax's denominator (no value);
        # kept in float32 (the kernels read it so; bf16 -> fp32 is exact)
        self.sinks = nn.Parameter(torch.empty(num_heads, dtype=torch.float32)) if sinks else None

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        if self.sinks is not None and self.sinks.dtype != torch.float32:
            self.sinks.data = self.sinks.data.float()
        return self

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fb: ForwardBatch,
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """q [N, H, D], k/v [N, kvH, D] -> [N, H*D]. attn_mask overrides fb.attn_mask (sliding window)."""
        self.write_kv(k, v, fb)
        return self.attend(q, fb, attn_mask)

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, fb: ForwardBatch) -> None:
        """Stores this forward's k/v [N, kvH, D] at fb.out_cache_loc (token-wise: graph-safe)."""
        fb.kv_pool.write(self.layer_id, fb.out_cache_loc, k, v)

    def attend(self, q: torch.Tensor, fb: ForwardBatch, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """q [N, H, D] over the KV already in the pool -> [N, H*D], through the engine's attention
        backend (fb.attention: Triton or FlashInfer kernels) or, without one, torch. Deterministic
        inference (exact): a backend's batch-invariant kernels (its `exact`), else
        rollout.exact.attention over the same grids as torch (no cascade)."""
        if fb.attention is not None and (not self.exact or getattr(fb.attention, "exact", False)):
            return fb.attention.attend(self, q, fb, attn_mask)
        return self.torch_attend(q, fb, attn_mask)

    def torch_attend(self, q: torch.Tensor, fb: ForwardBatch, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The torch path (and every kernel's reference): SDPA over the step's own attention grid."""
        if fb.cascade is not None and attn_mask is None and not self.exact and self.sinks is None:
            return fb.cascade.attend(q, fb.kv_pool.kv_buffers[self.layer_id], self.scale)
        if fb.segments:
            return torch.cat([
                self._grid(q[g.tok_lo:g.tok_hi], g.kv_flat, g.hi - g.lo, g.extend, g.width, g.q_pad_index,
                           fb.segment_mask(g, attn_mask) if attn_mask is not None else partial(fb.grid_mask, g.lo, g.hi),
                           fb.kv_pool)
                for g in fb.segments])
        bsz = fb.kv_indices.shape[0]
        full = q.shape[0] == bsz * fb.max_extend
        mask = attn_mask if attn_mask is not None else partial(fb.grid_mask, 0, bsz)
        return self._grid(q, fb.kv_indices.reshape(-1), bsz, fb.max_extend, fb.kv_indices.shape[1],
                          None if full else fb.q_pad_index, mask, fb.kv_pool)

    def _grid(self, q: torch.Tensor, slots: torch.Tensor, bsz: int, extend: int, seq: int,
              q_pad_index: torch.Tensor | None, mask: torch.Tensor | Callable, pool) -> torch.Tensor:
        """q [N, H, D] of bsz requests, request b's queries at grid rows b*extend + i (q_pad_index;
        None: N == bsz * extend), keys at slots [bsz * seq] (request-major), mask [bsz, 1, extend, seq]
        or mask(rows, width, q_lo, keep=...) making its query rows q_lo .. q_lo+rows-1 -> [N, H*D].

        NOTE: one request's long chunk (extend x S past MASK_BLOCK_CELLS) attends in blocks of
        query rows, each with its own mask, so the mask never takes more than that."""
        if self.exact:
            if callable(mask):
                mask = mask(extend, seq, 0, keep=True)
            return self._exact_grid(q, slots, bsz, extend, q_pad_index, mask, pool)
        # NOTE: padded key columns read the sink slot or a stale slot; they are masked out, but
        # must hold finite values (0 * NaN is NaN after softmax): every slot only ever holds real k/v.
        # (index_select, not advanced indexing: several times faster for this row gather on CPU;
        # a slot's key and value side by side: one gather for both)
        kv = pool.kv_buffers[self.layer_id].index_select(0, slots).view(bsz, seq, 2, self.num_kv_heads, q.shape[2])
        kv = kv.to(q.dtype)
        keys, values = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)  # [B, kvH, S, D]
        if not callable(mask):
            return self._sdpa(q, keys, values, bsz, extend, q_pad_index, mask)
        if extend > 1 and extend == seq and q_pad_index is None and self.sinks is None:
            # NOTE: every request's queries are all its keys (no prefix, no padding): the mask is the
            # causal one, which SDPA's is_causal applies without reading the blocks above the
            # diagonal (on CPU the same bits as with the mask, half the work at 2,048 tokens)
            return self._sdpa(q, keys, values, bsz, extend, None, None)
        if bsz > 1 or q_pad_index is not None or extend * seq <= MASK_BLOCK_CELLS:
            return self._sdpa(q, keys, values, bsz, extend, q_pad_index, mask(extend, seq, 0, keep=True))
        rows = max(1, MASK_BLOCK_CELLS // seq)
        return torch.cat([self._sdpa(q[i:i + rows], keys, values, 1, min(rows, extend - i), None,
                                     mask(min(rows, extend - i), seq, i))
                          for i in range(0, extend, rows)])

    def _sdpa(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bsz: int, extend: int,
              q_pad_index: torch.Tensor | None, mask: torch.Tensor | None) -> torch.Tensor:
        """q [N, H, D] over keys / values [B, kvH, S, D] under mask [B, 1, extend, S] -> [N, H*D];
        mask None: causal (extend == S, no padding)."""
        n, h, d = q.shape
        kvh = self.num_kv_heads
        if extend == 1 and q_pad_index is None and kvh != h and self.sinks is None:
            # decode with GQA: each kv head's query heads become its query rows (same math, and
            # the CPU kernel is faster than with enable_gqa)
            out = F.scaled_dot_product_attention(q.view(bsz, kvh, h // kvh, d), keys, values, attn_mask=mask,
                                                 scale=self.scale)              # [B, kvH, G, D]
            return out.reshape(bsz, h * d)
        if q_pad_index is None:
            q_pad = q
        else:
            q_pad = q.new_zeros(bsz * extend, h, d)
            q_pad[q_pad_index] = q
        q_pad = q_pad.view(bsz, extend, h, d).transpose(1, 2)                  # [B, H, E, D]
        if self.sinks is not None:                                             # gpt-oss (attention/sink_sdpa.py)
            out = sdpa_with_sinks(q_pad, keys, values, mask, self.scale, self.sinks)
        else:
            out = F.scaled_dot_product_attention(q_pad, keys, values, attn_mask=mask, scale=self.scale,
                                                 is_causal=mask is None, enable_gqa=h != kvh)   # [B, H, E, D]
        out = out.transpose(1, 2).reshape(bsz * extend, h * d)
        return out if q_pad_index is None else out[q_pad_index]

    def reads_mask(self, fb: ForwardBatch) -> bool:
        """Whether this layer's attend reads masks (the torch paths); the kernels of a backend
        whose `reads_mask` is False never do."""
        if fb.attention is None:
            return True
        return (self.exact and not getattr(fb.attention, "exact", False)) or fb.attention.reads_mask

    def _exact_grid(self, q: torch.Tensor, slots: torch.Tensor, bsz: int, extend: int,
                    q_pad_index: torch.Tensor | None, mask: torch.Tensor, pool) -> torch.Tensor:
        """_grid's batch-invariant form: each kv head's query rows are the (query token, head of its
        group) pairs, so the keys are not repeated per head; keys gathered whole key tiles wide."""
        n, h, d = q.shape
        kvh = self.num_kv_heads
        grp = h // kvh
        slots, mask = pad_keys_to_tiles(slots, mask, bsz)
        seq = mask.shape[-1]
        kv = pool.kv_buffers[self.layer_id].index_select(0, slots).view(bsz, seq, 2, kvh, d).to(q.dtype)
        keys, values = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)  # [B, kvH, S, D]
        if q_pad_index is not None:
            q = q.new_zeros(bsz * extend, h, d).index_copy_(0, q_pad_index, q)
        rows = q.view(bsz, extend, kvh, grp, d).transpose(1, 2).reshape(bsz, kvh, extend * grp, d)
        # decode: every row of a kv head is the same token, one mask row serves them all
        row_mask = mask if extend == 1 else \
            mask[:, :, :, None].expand(bsz, 1, extend, grp, seq).reshape(bsz, 1, extend * grp, seq)
        sinks = None
        if self.sinks is not None:                                             # one logit per row
            sinks = self.sinks.view(kvh, 1, grp).expand(kvh, extend, grp).reshape(1, kvh, extend * grp)
        out = exact_ops.attention(rows, keys, values, row_mask, self.scale, sinks=sinks)   # [B, kvH, E*G, D]
        out = out.view(bsz, kvh, extend, grp, d).transpose(1, 2).reshape(bsz * extend, h * d)
        return out if q_pad_index is None else out.index_select(0, q_pad_index)

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


def pad_keys_to_tiles(slots: torch.Tensor, mask: torch.Tensor, bsz: int) -> tuple[torch.Tensor, torch.Tensor]:
    """slots [bsz * S] (request-major) and mask [bsz, 1, E, S] widened to S' = S rounded up to
    rollout.exact.K_TILE: the new columns repeat each request's first slot (finite KV) and are
    masked, so rollout.exact.attention gets whole key tiles and pads nothing."""
    seq = mask.shape[-1]
    pad = (-seq) % exact_ops.K_TILE
    if not pad:
        return slots, mask
    per = slots.view(bsz, seq)
    slots = torch.cat((per, per[:, :1].expand(bsz, pad)), 1).reshape(-1)
    return slots, F.pad(mask, (0, pad))
