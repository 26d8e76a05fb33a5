"""DecodeCascade: decode attention that reads a prefix shared by several requests once.

The n samples of a GRPO prompt decode side by side, and the prefix cache gives them the very
same KV slots for the whole prompt. One padded grid gathers and attends those prompt keys once
per sample. The cascade splits each request's keys at its group's shared length P: the prefix
part is one grid per group, with every member's queries as rows over the group's P keys
(gathered once); the suffix part is each request's own keys P .. seq_len-1. The two partial
softmaxes are merged exactly through their log-sum-exps (as FlashInfer's cascade attention
does on GPUs). On the benchmark workload (16 prompts x 8 samples) this halves the keys a decode
step gathers.

CPU only: it needs SDPA's log-sum-exp, which torch exposes there through
`aten._scaled_dot_product_flash_attention_for_cpu` (the kernel `F.scaled_dot_product_attention`
runs on CPU).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch


def _flash_for_cpu():
    return getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


@dataclass(frozen=True)
class PrefixRun:
    """Groups lo .. hi-1 (shortest shared prefix first) attended over their own longest prefix."""

    lo: int
    hi: int
    slots: torch.Tensor               # [(hi - lo) * width] int64, group-major
    bias: torch.Tensor                # [hi - lo, 1, 1, width] 0 / -inf


@dataclass(frozen=True)
class DecodeCascade:
    num_groups: int
    group_rows: int                   # members per group, padded to the largest group
    q_rows: torch.Tensor              # [num_groups * group_rows] batch row of each prefix query row
    dest: torch.Tensor                # [M] real rows of that padded layout ...
    member_rows: torch.Tensor         # [M] ... and the batch rows they belong to
    prefix_runs: tuple[PrefixRun, ...]
    suffix_slots: torch.Tensor        # [B * suffix_width] int64, request-major
    suffix_bias: torch.Tensor         # [B, 1, 1, suffix_width] 0 / -inf

    # NOTE: a shared prefix must be this long to count, and the cascade must skip at least this
    # many key cells (the same bar as an AttentionSegment cut: it adds a gather and an SDPA).
    MIN_PREFIX = 16
    MIN_SAVED_CELLS = 2048

    @staticmethod
    def available(device: torch.device) -> bool:
        return device.type == "cpu" and _flash_for_cpu() is not None

    @staticmethod
    def build(groups: Sequence[tuple[int, Sequence[int]]], seq_lens: list[int], kv_indices: torch.Tensor,
              dtype: torch.dtype, device: torch.device) -> Optional["DecodeCascade"]:
        """groups: (shared length P, batch rows of the members) per group of 2+ requests whose KV
        slots for positions 0 .. P-1 are the same; kv_indices [B, max seq_len]. None when it
        would not pay."""
        # NOTE: imported here: forward_batch.py builds the cascade (it imports this module)
        from rollout.batch.forward_batch import AttentionSegment  # noqa: PLC0415

        groups = sorted((p, list(m)) for p, m in groups if p >= DecodeCascade.MIN_PREFIX and len(m) > 1)
        if sum((len(m) - 1) * p for p, m in groups) < DecodeCascade.MIN_SAVED_CELLS:
            return None
        bsz = len(seq_lens)
        group_rows = max(len(m) for _, m in groups)
        prefix_width = groups[-1][0]
        q_rows, dest, member_rows = [], [], []
        start = [0] * bsz                                   # first suffix position of each request
        for g, (p, members) in enumerate(groups):
            q_rows += members + [members[0]] * (group_rows - len(members))
            dest += range(g * group_rows, g * group_rows + len(members))
            member_rows += members
            for r in members:
                start[r] = p
        first = torch.tensor([m[0] for _, m in groups], dtype=torch.int64)
        shared = [p for p, _ in groups]
        prefix_slots = kv_indices.index_select(0, first)[:, :prefix_width]
        prefix_mask = torch.arange(prefix_width)[None, :] < torch.tensor(shared)[:, None]
        start_t = torch.tensor(start, dtype=torch.int64)
        suffix_lens = torch.tensor(seq_lens, dtype=torch.int64) - start_t
        suffix_width = int(suffix_lens.max())
        pos = (start_t[:, None] + torch.arange(suffix_width)[None, :]).clamp_(max=kv_indices.shape[1] - 1)
        suffix_slots = kv_indices.gather(1, pos)
        suffix_mask = torch.arange(suffix_width)[None, :] < suffix_lens[:, None]

        def bias(mask: torch.Tensor) -> torch.Tensor:
            return torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, float("-inf"))[:, None, None, :].to(device)

        def rows(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        prefix_bias = bias(prefix_mask)
        # the prefix grid in runs of similar length, as AttentionSegment cuts a batch
        runs = tuple(PrefixRun(lo=lo, hi=hi, slots=prefix_slots[lo:hi, :shared[hi - 1]].reshape(-1).to(device),
                               bias=prefix_bias[lo:hi, :, :, :shared[hi - 1]])
                     for lo, hi in AttentionSegment.runs([group_rows] * len(groups), shared))
        return DecodeCascade(
            num_groups=len(groups), group_rows=group_rows, q_rows=rows(q_rows), dest=rows(dest),
            member_rows=rows(member_rows), prefix_runs=runs, suffix_slots=suffix_slots.reshape(-1).to(device),
            suffix_bias=bias(suffix_mask))

    def attend(self, q: torch.Tensor, kv_buffer: torch.Tensor, scale: float) -> torch.Tensor:
        """q [B, H, D] (one query per request), kv_buffer [slots, 2, kvH, D] -> [B, H*D]."""
        bsz, h, d = q.shape
        kvh = kv_buffer.shape[2]
        gq = h // kvh
        flash = _flash_for_cpu()
        groups, rows = self.num_groups, self.group_rows

        def keys_values(slots: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
            kv = kv_buffer.index_select(0, slots).view(n, -1, 2, kvh, d).to(q.dtype)
            return kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)      # [n, kvH, S, D]

        # prefix: each group's members as query rows over the group's shared keys (GQA: a kv
        # head's query heads are rows too)
        qp = q.index_select(0, self.q_rows).view(groups, rows, kvh, gq, d).transpose(1, 2)
        parts = [flash(qp[r.lo:r.hi].reshape(r.hi - r.lo, kvh, rows * gq, d), *keys_values(r.slots, r.hi - r.lo),
                       attn_mask=r.bias, scale=scale) for r in self.prefix_runs]
        o1 = torch.cat([o for o, _ in parts]) if len(parts) > 1 else parts[0][0]
        l1 = torch.cat([lse for _, lse in parts]) if len(parts) > 1 else parts[0][1]
        o1 = o1.view(groups, kvh, rows, gq, d).transpose(1, 2).reshape(groups * rows, kvh, gq, d)
        l1 = l1.view(groups, kvh, rows, gq).transpose(1, 2).reshape(groups * rows, kvh, gq)
        # suffix: every request's own keys (all of them for requests in no group)
        o2, l2 = flash(q.view(bsz, kvh, gq, d), *keys_values(self.suffix_slots, bsz),
                       attn_mask=self.suffix_bias, scale=scale)                  # [B, kvH, G, D]
        # merge the two softmaxes of each member by their log-sum-exps (fp32): the prefix part's
        # share of the whole softmax is exp(l1) / (exp(l1) + exp(l2)) = sigmoid(l1 - l2)
        share = torch.sigmoid(l1.index_select(0, self.dest) - l2.index_select(0, self.member_rows))[..., None]
        merged = torch.lerp(o2.index_select(0, self.member_rows).float(), o1.index_select(0, self.dest).float(), share)
        return o2.index_copy(0, self.member_rows, merged.to(o2.dtype)).reshape(bsz, h * d)
