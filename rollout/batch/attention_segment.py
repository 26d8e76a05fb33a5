"""AttentionSegment: a run of a batch's requests attended as one grid of their own."""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from operator import mul
from typing import Optional, Sequence

import torch

from rollout.batch.host_staging import to_device


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
