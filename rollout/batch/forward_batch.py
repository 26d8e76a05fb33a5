"""The batch one forward runs on, and what it returns.

ScheduledBatch is one step's work as the scheduler picked it; ForwardBatch is everything one
model forward needs (token ids, positions, KV slots, lengths), made from it (padded for the
static-shape runners), with the AttentionSegments its requests are attended in; ForwardOutput is
what the forward produced and which runner (with which layout) produced it.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from itertools import accumulate
from operator import mul
from typing import Any, Optional, Sequence

import torch

from capture.capturer import GatherLayout
from rollout.batch.decode_cascade import DecodeCascade
from rollout.batch.host_device import stage, to_device
from rollout.batch.kv_pool import SINK_SLOT, KVPool


@dataclass(frozen=True)
class ScheduledBatch:
    reqs: list[Any]                  # rollout.core.request.Req (the layer above)
    extend_lens: list[int]
    prefix_lens: list[int]
    out_cache_loc: torch.Tensor      # [sum(extend_lens)] new slots, request-major
    is_prefill: bool
    kv_indices: torch.Tensor         # [B, max(prefix+extend)] int64 KV slots by position (stale past each length), on the device
    # decode: (P, batch rows) of requests whose slots for positions 0 .. P-1 are the same (DecodeCascade)
    prefix_groups: tuple = ()
    # speculative decoding: each request's draft tokens (a list, maybe empty), fed after its last
    # token in this decode (verify) step, every one of those positions giving logits; () = a
    # plain decode step (speculation off)
    drafts: tuple = ()
    # the overlap schedule: per request, whether its last token is the sample of the forward still
    # running when this batch was scheduled (the host does not have it yet); () = none is
    pending: tuple = ()
    # each request's last token, filled in by the forward stage for a batch with pending tokens
    # (from the previous forward's samples); () = read from the requests
    last_ids: tuple = ()

    @property
    def logit_lens(self) -> Optional[list[int]]:
        """Logits rows per request (its last new tokens'): None = one each; a verify step's
        requests have one per token fed (the last token and each draft)."""
        return list(self.extend_lens) if self.drafts else None

    @property
    def num_logit_rows(self) -> int:
        return sum(self.extend_lens) if self.drafts else len(self.reqs)

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)

    def completes(self, i: int) -> bool:
        """Whether request i's forward reaches its last token (its logits pick the next token)."""
        req = self.reqs[i]
        return self.prefix_lens[i] + self.extend_lens[i] == req.seq_len


@dataclass(frozen=True)
class AttentionSegment:
    """Requests lo .. hi-1 (tokens tok_lo .. tok_hi-1) attended as one grid of their own:
    [hi - lo, extend] queries over [hi - lo, width] keys, instead of the batch's
    [B, max_extend] x [B, max_seq].

    One grid for a whole batch pads every request to the longest one in both directions. Two
    batch shapes waste most of it: a decode batch with very different context lengths, and a
    prefill step where the n samples of a GRPO prompt each compute only their last prompt token
    (the rest is a prefix-cache hit) next to requests computing whole prompts. With requests
    ordered by shape (the scheduler sorts decode batches by length and prefill batches by new
    tokens), cutting the batch into runs skips those padded cells, at the price of one more
    gather and SDPA call per layer per run.
    """

    lo: int
    hi: int
    tok_lo: int
    tok_hi: int
    extend: int                           # the run's most new tokens
    width: int                            # the run's longest KV length
    kv_flat: torch.Tensor                 # [(hi - lo) * width] int64 slots, request-major
    q_pad_index: Optional[torch.Tensor]   # [tok_hi - tok_lo] flat index in the run's grid; None: no padding

    # NOTE: a cut must skip at least this many padded (query, key) cells: one more gather + SDPA
    # per layer costs about as much as ~600 cells of decode attention on CPU.
    MIN_SAVED_CELLS = 2048

    @staticmethod
    def runs(extend_lens: Sequence[int], seq_lens: Sequence[int]) -> list[tuple[int, int]]:
        """(lo, hi) runs covering 0 .. B-1 in order, cut greedily from the end wherever a cut
        saves MIN_SAVED_CELLS of extend x seq_len cells; one run when no cut pays (any order is
        correct, a sorted one cuts)."""
        bsz = len(seq_lens)
        pre_e, pre_s = list(accumulate(extend_lens, max)), list(accumulate(seq_lens, max))  # maxima over 0 .. j
        cuts = [bsz]
        hi, top_e, top_s = bsz, 0, 0
        padded = bsz * pre_e[-1] * pre_s[-1] - sum(map(mul, extend_lens, seq_lens))
        for j in range(bsz - 1, 0, -1) if padded >= AttentionSegment.MIN_SAVED_CELLS else ():
            # top run j .. hi-1, bottom run 0 .. j-1, against one run 0 .. hi-1
            top_e, top_s = max(top_e, extend_lens[j]), max(top_s, seq_lens[j])
            saved = hi * pre_e[hi - 1] * pre_s[hi - 1] - j * pre_e[j - 1] * pre_s[j - 1] - (hi - j) * top_e * top_s
            if saved >= AttentionSegment.MIN_SAVED_CELLS:
                cuts.append(j)
                hi, top_e, top_s = j, 0, 0
        cuts.append(0)
        return [(lo, hi) for hi, lo in reversed(list(zip(cuts, cuts[1:])))]

    @staticmethod
    def split(extend_lens: list[int], seq_lens: list[int], kv_indices: torch.Tensor,
              device: torch.device) -> tuple["AttentionSegment", ...]:
        """The batch's runs (see runs) as segments."""
        starts = [0, *accumulate(extend_lens)]
        out = []
        for lo, hi in AttentionSegment.runs(extend_lens, seq_lens):
            ext = max(extend_lens[lo:hi])
            width = max(seq_lens[lo:hi])
            q_pad_index = None
            if any(e != ext for e in extend_lens[lo:hi]):
                q_pad_index = to_device(torch.cat([torch.arange(e) + i * ext for i, e in enumerate(extend_lens[lo:hi])]),
                                        device)
            out.append(AttentionSegment(lo=lo, hi=hi, tok_lo=starts[lo], tok_hi=starts[hi], extend=ext, width=width,
                                        kv_flat=to_device(kv_indices[lo:hi, :width].reshape(-1), device),
                                        q_pad_index=q_pad_index))
        return tuple(out)


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
    # a compiled forward's OpaqueStep (rollout/models/opaque_step.py): attention and the MoE layers
    # run through its opaque ops; None: eager
    opaque: Optional[Any] = None
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
              extend_lens: list[int], kv_indices: torch.Tensor, kv_pool: KVPool,
              capture: Optional[Any] = None, device: torch.device | str = "cpu",
              segment_attention: bool = False, prefix_groups: Sequence = (),
              logit_lens: Optional[Sequence[int]] = None) -> "ForwardBatch":
        """kv_indices [B, >= max seq_len]: request b's KV slots by position (cells past its
        length are never read unmasked). segment_attention: attend in AttentionSegments (runs of
        requests of similar shape; the scheduler orders batches by shape), or a decode batch with
        prefix_groups (requests sharing the slots of a prefix) as a DecodeCascade. logit_lens:
        logits rows of the first len(logit_lens) requests' last new tokens (a verify step's); None:
        one per request."""
        bsz = len(extend_lens)
        assert bsz == len(prefix_lens) and bsz > 0
        seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
        max_seq, max_ext = max(seq_lens), max(extend_lens)
        assert kv_indices.shape[0] == bsz and kv_indices.shape[1] >= max_seq
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
            if logit_lens is not None:
                m = torch.tensor(list(logit_lens) + [1] * (bsz - len(logit_lens)), dtype=torch.int64)
                req_of_row = torch.repeat_interleave(torch.arange(bsz), m)
                logits_indices = (starts + ext - m)[req_of_row] + torch.arange(int(m.sum())) - (
                    torch.cumsum(m, 0) - m)[req_of_row]
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

    @staticmethod
    def from_scheduled(batch: Optional[ScheduledBatch], *, kv_pool: KVPool, device: torch.device,
                       capture: Optional[Any] = None, pad_to: int = 0, pad_chunk: int = 1,
                       segment_attention: bool = False) -> ForwardBatch:
        """batch: None for an idle rank -> the batch as a ForwardBatch, padded to pad_to tokens
        in total (0 = none).

        Padding tokens form extra requests of at most `pad_chunk` tokens each (token id 0,
        positions from 0). Their KV slots are all SINK_SLOT, so their KV writes land in the sink,
        and their attention rows see only sink keys; no real request's row ever sees a sink column
        (kv_indices beyond a request's length are masked). Real requests keep their order and come
        first, so logits row b is request b."""
        input_ids: list[int] = []
        prefix_lens: list[int] = []
        extend_lens: list[int] = []
        locs: list[torch.Tensor] = []
        if batch is not None:
            if batch.is_prefill:
                for req, pre, ext in zip(batch.reqs, batch.prefix_lens, batch.extend_lens):
                    input_ids += req.token_span(pre, pre + ext)
            elif batch.drafts:
                # verify: each request's last token, then its drafts
                for req, drafts in zip(batch.reqs, batch.drafts):
                    input_ids.append((req.output_ids or req.prompt_ids)[-1])
                    input_ids += drafts
            else:
                # decode: each request's last token (a prompt's own last one after a chunked prefill)
                input_ids = list(batch.last_ids) if batch.last_ids else [
                    (req.output_ids or req.prompt_ids)[-1] for req in batch.reqs]
            prefix_lens += list(batch.prefix_lens)
            extend_lens += list(batch.extend_lens)
            locs.append(batch.out_cache_loc)
        real = len(extend_lens)
        pad = pad_to - len(input_ids)
        assert pad_to == 0 or pad >= 0, (pad_to, len(input_ids))
        chunk = max(1, pad_chunk)
        while pad > 0:
            c = min(chunk, pad)
            input_ids += [0] * c
            prefix_lens.append(0)
            extend_lens.append(c)
            locs.append(torch.full((c,), SINK_SLOT, dtype=torch.int64))
            pad -= c
        if not extend_lens:
            return ForwardBatch.empty(kv_pool=kv_pool, capture=capture, device=device)
        if real == len(extend_lens):
            kv_indices = batch.kv_indices
        else:
            # padding requests read and write only the sink slot
            width = max(p + e for p, e in zip(prefix_lens, extend_lens))
            kv_indices = torch.full((len(extend_lens), width), SINK_SLOT, dtype=torch.int64,
                                    device=batch.kv_indices.device if real else device)
            if real:
                kv_indices[:real, :batch.kv_indices.shape[1]] = batch.kv_indices
        return ForwardBatch.build(input_ids=input_ids, out_cache_loc=locs[0] if len(locs) == 1 else torch.cat(locs),
                                  prefix_lens=prefix_lens, extend_lens=extend_lens, kv_indices=kv_indices,
                                  kv_pool=kv_pool, capture=capture, device=device, segment_attention=segment_attention,
                                  prefix_groups=batch.prefix_groups if real == len(extend_lens) else (),
                                  logit_lens=batch.logit_lens if batch is not None else None)


@dataclass(frozen=True)
class ForwardOutput:
    logits: torch.Tensor     # [B, vocab] fp32, one row per request (its last new token); a verify step: [N, vocab]
    layout: GatherLayout     # the executing runner's layout; capture reads only this
    token_logits: Optional[torch.Tensor] = None  # [N, vocab] fp32, every token's (prompt logprobs asked)

    @property
    def runner(self) -> str:
        """The runner that executed ("eager", "decode_graph", "prefill_graph")."""
        return self.layout.runner
