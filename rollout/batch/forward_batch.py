"""ForwardBatch: everything one model forward needs (token ids, positions, KV slots, lengths)."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Optional, Sequence

import torch

from rollout.batch.attention_segment import AttentionSegment
from rollout.batch.decode_cascade import DecodeCascade
from rollout.batch.host_staging import stage, to_device
from rollout.batch.kv_pool import SINK_SLOT, KVPool


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
    # seq_lens / extend_lens as host ints (build has them): a backend planning on the host reads
    # these, not the device tensors (no sync)
    host_seq_lens: tuple = ()
    host_extend_lens: tuple = ()

    @cached_property
    def attn_mask(self) -> torch.Tensor:
        """[B, 1, max_extend, max_seq_len] bool, True = attend: made on first read, on the device,
        from seq_lens and extend_lens (no host work, no sync; inside a CUDA graph it is part of the
        graph). Only the torch paths read it (torch_attend, exact mode, MLA); the Triton and
        FlashInfer backends never do, so their steps never make it."""
        return self.grid_mask(0, self.batch_size, self.max_extend, self.kv_indices.shape[1], keep=True)

    @property
    def mask_built(self) -> bool:
        """Whether this forward holds a mask (attn_mask or a kept segment mask)."""
        return "attn_mask" in self.__dict__ or bool(self.__dict__.get("_kept_masks"))

    def grid_mask(self, lo: int, hi: int, extend: int, width: int, q_lo: int = 0, *, keep: bool = False) -> torch.Tensor:
        """attn_mask[lo:hi, :, q_lo:q_lo+extend, :width] made on its own (an AttentionSegment's
        grid, or a block of its query rows: never the whole batch's) -> [hi-lo, 1, extend, width].
        keep: made once for this forward (every layer reads the same); blocks of a long chunk are
        not kept (that would hold the whole grid again)."""
        if not keep:
            return self._make_mask(lo, hi, extend, width, q_lo)
        kept = self.__dict__.setdefault("_kept_masks", {})
        key = (lo, hi, extend, width, q_lo)
        if key not in kept:
            kept[key] = self._make_mask(lo, hi, extend, width, q_lo)
        return kept[key]

    def _make_mask(self, lo: int, hi: int, extend: int, width: int, q_lo: int) -> torch.Tensor:
        seq = self.seq_lens[lo:hi]
        key_pos = torch.arange(width, device=seq.device)
        if self.max_extend == 1:
            # decode: one query per request, at position seq_len - 1, seeing keys 0 .. seq_len - 1
            return (key_pos[None, :] < seq[:, None])[:, None, None, :]               # [b, 1, 1, S]
        # query i of request b sits at position prefix_lens[b] + i and sees keys 0 .. that position
        q_idx = torch.arange(q_lo, q_lo + extend, device=seq.device)
        q_pos = (seq - self.extend_lens[lo:hi])[:, None] + q_idx[None, :]
        mask = key_pos[None, None, :] <= q_pos[:, :, None]                              # [b, E, S]
        mask &= key_pos[None, None, :] < seq[:, None, None]
        # NOTE: padded query rows (i >= extend_lens[b]) must still see one key, else softmax is NaN.
        mask[:, :, 0] = True
        return mask[:, None]

    def segment_mask(self, g: AttentionSegment, attn_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The mask of segment g: its own grid (made alone), or its part of attn_mask (a sliding
        window's) -> [g.hi - g.lo, 1, g.extend, g.width]."""
        if attn_mask is None:
            return self.grid_mask(g.lo, g.hi, g.extend, g.width, keep=True)
        return attn_mask[g.lo:g.hi, :, :g.extend, :g.width]

    def lens_on_host(self) -> tuple[list[int], list[int]]:
        """(seq_lens, extend_lens) as host ints: the ones build kept, else read from the device."""
        if len(self.host_seq_lens) == self.batch_size:
            return list(self.host_seq_lens), list(self.host_extend_lens)
        return self.seq_lens.tolist(), self.extend_lens.tolist()

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
            kv_indices=torch.zeros((0, 1), dtype=torch.int64, device=dev), q_pad_index=none, logits_indices=none,
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
        if max_ext == 1:
            rows = torch.arange(bsz)
            positions, q_pad_index, logits_indices = seq_t - 1, rows, rows
            ext = torch.ones(bsz, dtype=torch.int64)
        else:
            ext = torch.tensor(extend_lens, dtype=torch.int64)
            pre = torch.tensor(prefix_lens, dtype=torch.int64)
            req_of_token = torch.repeat_interleave(torch.arange(bsz), ext)              # [N]
            starts = torch.cumsum(ext, 0) - ext                                          # [B]
            idx_in_req = torch.arange(int(ext.sum())) - starts[req_of_token]            # [N]
            positions = pre[req_of_token] + idx_in_req
            q_pad_index = req_of_token * max_ext + idx_in_req
            logits_indices = starts + ext - 1
        segments: tuple[AttentionSegment, ...] = ()
        cascade = None
        if segment_attention and max_ext == 1 and prefix_groups and DecodeCascade.available(dev):
            cascade = DecodeCascade.build(prefix_groups, seq_lens, kv_indices, kv_pool.dtype, dev)
        if segment_attention and cascade is None:
            segments = AttentionSegment.split(extend_lens, seq_lens, kv_indices, dev)
        # NOTE: the per-step vectors travel as one (pinned, non_blocking on CUDA) copy
        ids_d, pos_d, loc_d, seq_d, ext_d, qpad_d, logit_d = stage(
            (torch.tensor(input_ids, dtype=torch.int64), positions, out_cache_loc, seq_t, ext, q_pad_index,
             logits_indices), dev)
        return ForwardBatch(
            input_ids=ids_d, positions=pos_d, out_cache_loc=loc_d, seq_lens=seq_d, extend_lens=ext_d,
            kv_indices=to_device(kv_indices, dev), q_pad_index=qpad_d, logits_indices=logit_d,
            max_extend=max_ext,
            kv_pool=kv_pool,
            capture=capture,
            segments=segments,
            cascade=cascade,
            prefix_groups=tuple(prefix_groups) if segment_attention and max_ext == 1 else (),
            host_seq_lens=tuple(seq_lens), host_extend_lens=tuple(extend_lens),
        )
