"""ForwardBatch: everything one model forward needs (token ids, positions, KV slots, lengths)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from rollout.exec.attention_segment import AttentionSegment
from rollout.exec.decode_cascade import DecodeCascade
from rollout.core.kv_pool import SINK_SLOT, KVPool


@dataclass(frozen=True, kw_only=True)
class ForwardBatch:
    """A packed batch of B requests' new tokens (N in total).

    Request b contributes extend_lens[b] new tokens at positions prefix_lens[b] .. seq_lens[b]-1;
    its keys/values for positions 0 .. seq_lens[b]-1 live at kv_indices[b, :seq_lens[b]].
    """

    input_ids: torch.Tensor          # [N] int64
    positions: torch.Tensor          # [N] int64
    out_cache_loc: torch.Tensor      # [N] int64, KV slot each new token writes
    seq_lens: torch.Tensor           # [B] int64, KV length after this forward
    extend_lens: torch.Tensor        # [B] int64, new tokens per request
    kv_indices: torch.Tensor         # [B, max_seq_len] int64; past a request's length: sink or stale slots (masked)
    q_pad_index: torch.Tensor        # [N] int64, flat index of each token in [B * max_extend]
    attn_mask: torch.Tensor          # [B, 1, max_extend, max_seq_len] bool, True = attend
    logits_indices: torch.Tensor     # [B] int64, row of each request's last new token
    max_extend: int
    kv_pool: KVPool
    capture: Optional[Any] = None    # capture target with .record(layer_id, topk_ids), or None
    # DP attention: the executing runner's GatherLayout and the expert-parallel group that gathers
    # hidden states by it before each MoE layer (both None on a single rank).
    layout: Optional[Any] = None
    ep_group: Optional[Any] = None
    graph_safe: bool = False         # no host syncs (CUDA graph capture): see FusedExperts.choose_impl
    segments: tuple = ()             # AttentionSegments of an eager batch, () = the grid above
    cascade: Optional[Any] = None    # DecodeCascade of an eager decode batch (then no segments)
    prefix_groups: tuple = ()        # eager decode: (shared length, batch rows) of requests sharing a prefix
    attention: Optional[Any] = None  # the engine's attention backend (None: PagedAttention's torch path)
    attention_plan: Optional[Any] = None   # what that backend prepared for this forward (bind)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def batch_size(self) -> int:
        return int(self.seq_lens.shape[0])

    @staticmethod
    def empty(*, kv_pool: KVPool, capture: Optional[Any] = None,
              device: torch.device | str = "cpu") -> "ForwardBatch":
        """No tokens at all: an idle DP rank's part in a step (it still joins every collective)."""
        dev = torch.device(device)
        none = torch.zeros(0, dtype=torch.int64, device=dev)
        return ForwardBatch(
            input_ids=none, positions=none, out_cache_loc=none, seq_lens=none, extend_lens=none,
            kv_indices=torch.zeros((0, 1), dtype=torch.int64, device=dev), q_pad_index=none,
            attn_mask=torch.ones((0, 1, 1, 1), dtype=torch.bool, device=dev), logits_indices=none,
            max_extend=1, kv_pool=kv_pool, capture=capture)

    @staticmethod
    def build(*, input_ids: list[int], out_cache_loc: torch.Tensor, prefix_lens: list[int],
              extend_lens: list[int], kv_indices: Optional[torch.Tensor] = None,
              req_slots: Optional[Sequence[torch.Tensor]] = None, kv_pool: KVPool,
              capture: Optional[Any] = None, device: torch.device | str = "cpu",
              segment_attention: bool = False, prefix_groups: Sequence = ()) -> "ForwardBatch":
        """KV slots by position, one of: kv_indices [B, >= max seq_len] (cells past a request's
        length are never read unmasked), or req_slots[b], request b's slots for positions
        0 .. prefix+extend-1 (new ones included). segment_attention: attend in AttentionSegments
        (runs of requests of similar shape; the scheduler orders batches by shape), or a decode
        batch with prefix_groups (requests sharing the slots of a prefix) as a DecodeCascade."""
        bsz = len(extend_lens)
        assert bsz == len(prefix_lens) and bsz > 0
        seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
        max_seq, max_ext = max(seq_lens), max(extend_lens)
        if req_slots is not None:
            assert kv_indices is None and len(req_slots) == bsz
            assert all(slots.numel() == n for slots, n in zip(req_slots, seq_lens))
            kv_indices = torch.nn.utils.rnn.pad_sequence(list(req_slots), batch_first=True, padding_value=SINK_SLOT)
        assert kv_indices is not None and kv_indices.shape[0] == bsz and kv_indices.shape[1] >= max_seq
        kv_indices = kv_indices[:, :max_seq]
        dev = torch.device(device)
        seq_t = torch.tensor(seq_lens, dtype=torch.int64)
        key_pos = torch.arange(max_seq)
        if max_ext == 1:
            # decode: one query per request, at position seq_len - 1, seeing keys 0 .. seq_len - 1
            rows = torch.arange(bsz)
            positions, q_pad_index, logits_indices = seq_t - 1, rows, rows
            ext = torch.ones(bsz, dtype=torch.int64)
            mask = (key_pos[None, :] < seq_t[:, None])[:, None, None, :]             # [B, 1, 1, S]
        else:
            ext = torch.tensor(extend_lens, dtype=torch.int64)
            pre = torch.tensor(prefix_lens, dtype=torch.int64)
            req_of_token = torch.repeat_interleave(torch.arange(bsz), ext)              # [N]
            starts = torch.cumsum(ext, 0) - ext                                          # [B]
            idx_in_req = torch.arange(int(ext.sum())) - starts[req_of_token]            # [N]
            positions = pre[req_of_token] + idx_in_req
            q_pad_index = req_of_token * max_ext + idx_in_req
            # query i of request b sits at position prefix_lens[b] + i and sees keys 0 .. that position
            q_pos = pre[:, None] + torch.arange(max_ext)[None, :]                        # [B, max_ext]
            mask = key_pos[None, None, :] <= q_pos[:, :, None]                           # [B, max_ext, max_seq]
            mask &= key_pos[None, None, :] < seq_t[:, None, None]
            # NOTE: padded query rows (i >= extend_lens[b]) must still see one key, else softmax is NaN.
            mask[:, :, 0] = True
            mask = mask[:, None]
            logits_indices = starts + ext - 1
        segments: tuple[AttentionSegment, ...] = ()
        cascade = None
        if segment_attention and max_ext == 1 and prefix_groups and DecodeCascade.available(dev):
            cascade = DecodeCascade.build(prefix_groups, seq_lens, kv_indices, kv_pool.dtype, dev)
        if segment_attention and cascade is None:
            segments = AttentionSegment.split(extend_lens, seq_lens, kv_indices, dev)
        return ForwardBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=dev),
            positions=positions.to(dev),
            out_cache_loc=out_cache_loc.to(dev),
            seq_lens=seq_t.to(dev),
            extend_lens=ext.to(dev),
            kv_indices=kv_indices.to(dev),
            q_pad_index=q_pad_index.to(dev),
            attn_mask=mask.to(dev),
            logits_indices=logits_indices.to(dev),
            max_extend=max_ext,
            kv_pool=kv_pool,
            capture=capture,
            segments=segments,
            cascade=cascade,
            prefix_groups=tuple(prefix_groups) if segment_attention and max_ext == 1 else (),
        )
