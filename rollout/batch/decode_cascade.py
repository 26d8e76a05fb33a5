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

The prefix half carries over between decode steps (CascadePrefix). A group's prefix KV is written
by its prefill and never rewritten while its members hold it, and only forwards write KV; so the
next forward, when it is again a cascade decode step whose groups are the same batch rows over the
same prefix slots, reads the same prefix keys. It then reuses the prefix grids and every layer's
gathered prefix keys and values (ModelRunner keeps the prefix from one such step to the next and
drops it at any other forward). On the benchmark workload about 60% of the decode steps reuse it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
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
class CascadePrefix:
    """The prefix half of a DecodeCascade, which the next cascade step reuses when its groups are
    the same (module doc): the groups' grids, and each layer's gathered prefix keys and values as
    the layers attend (at most KEEP_BYTES of them, all layers together)."""

    groups: tuple                     # ((P, member rows), ...) sorted: the groups it was built for
    held: torch.Tensor                # [num_groups, prefix width] int64: each group's prefix slots, -1 past P
    dtype: torch.dtype
    group_rows: int                   # members per group, padded to the largest group
    q_rows: torch.Tensor              # [num_groups * group_rows] batch row of each prefix query row
    dest: torch.Tensor                # [M] real rows of that padded layout ...
    member_rows: torch.Tensor         # [M] ... and the batch rows they belong to
    runs: tuple[PrefixRun, ...]
    kv: dict = field(default_factory=dict, compare=False)   # layer KV buffer's data_ptr -> [(K, V) per run]

    # NOTE: the gathered prefix keys kept for the next step are bounded: a real checkpoint's
    # layers over long prompts would otherwise hold gigabytes; past it, later layers gather anew.
    KEEP_BYTES = 256 << 20

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def fits(self, groups: tuple, held: torch.Tensor, dtype: torch.dtype) -> bool:
        """Whether a step with these groups and prefix slots may reuse this prefix."""
        return groups == self.groups and dtype == self.dtype and held.shape == self.held.shape \
            and torch.equal(held, self.held)

    @staticmethod
    def make(groups: tuple, prefix_slots: torch.Tensor, held: torch.Tensor, prefix_mask: torch.Tensor,
             dtype: torch.dtype, device: torch.device) -> "CascadePrefix":
        # NOTE: imported here: forward_batch.py builds the cascade (it imports this module)
        from rollout.batch.forward_batch import AttentionSegment  # noqa: PLC0415

        group_rows = max(len(m) for _, m in groups)
        q_rows, dest, member_rows = [], [], []
        for g, (_, members) in enumerate(groups):
            q_rows += members + (members[0],) * (group_rows - len(members))
            dest += range(g * group_rows, g * group_rows + len(members))
            member_rows += members
        shared = [p for p, _ in groups]
        prefix_bias = _bias(prefix_mask, dtype, device)
        # the prefix grid in runs of similar length, as AttentionSegment cuts a batch
        runs = tuple(PrefixRun(lo=lo, hi=hi, slots=prefix_slots[lo:hi, :shared[hi - 1]].reshape(-1).to(device),
                               bias=prefix_bias[lo:hi, :, :, :shared[hi - 1]])
                     for lo, hi in AttentionSegment.runs([group_rows] * len(groups), shared))
        return CascadePrefix(groups=groups, held=held, dtype=dtype, group_rows=group_rows, q_rows=_rows(q_rows, device),
                             dest=_rows(dest, device), member_rows=_rows(member_rows, device), runs=runs)

    def keys_values(self, kv_buffer: torch.Tensor, gather) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each run's prefix keys and values in kv_buffer (one layer's): gathered by gather(slots,
        rows) once, then kept while they fit KEEP_BYTES."""
        kept = self.kv.get(kv_buffer.data_ptr())
        if kept is not None:
            return kept
        kv = [gather(r.slots, r.hi - r.lo) for r in self.runs]
        size = sum(2 * k.numel() * k.element_size() for k, _ in kv)
        if size + sum(2 * k.numel() * k.element_size() for layer in self.kv.values() for k, _ in layer) \
                <= self.KEEP_BYTES:
            self.kv[kv_buffer.data_ptr()] = kv
        return kv


def _bias(mask: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, float("-inf"))[:, None, None, :].to(device)


def _rows(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


@dataclass(frozen=True)
class DecodeCascade:
    prefix: CascadePrefix
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
              dtype: torch.dtype, device: torch.device,
              previous: Optional[CascadePrefix] = None) -> Optional["DecodeCascade"]:
        """groups: (shared length P, batch rows of the members) per group of 2+ requests whose KV
        slots for positions 0 .. P-1 are the same; kv_indices [B, max seq_len]. None when it
        would not pay. previous: the prefix of the forward just before, when it was a cascade
        step (reused when it fits)."""
        groups = tuple(sorted((p, tuple(m)) for p, m in groups if p >= DecodeCascade.MIN_PREFIX and len(m) > 1))
        if sum((len(m) - 1) * p for p, m in groups) < DecodeCascade.MIN_SAVED_CELLS:
            return None
        prefix_width = groups[-1][0]
        first = torch.tensor([m[0] for _, m in groups], dtype=torch.int64)
        prefix_slots = kv_indices.index_select(0, first)[:, :prefix_width]
        prefix_mask = torch.arange(prefix_width)[None, :] < torch.tensor([p for p, _ in groups])[:, None]
        held = prefix_slots.masked_fill(~prefix_mask, -1)
        if previous is not None and previous.fits(groups, held, dtype):
            prefix = previous
        else:
            prefix = CascadePrefix.make(groups, prefix_slots, held, prefix_mask, dtype, device)
        start = [0] * len(seq_lens)                         # first suffix position of each request
        for p, members in groups:
            for r in members:
                start[r] = p
        start_t = torch.tensor(start, dtype=torch.int64)
        suffix_lens = torch.tensor(seq_lens, dtype=torch.int64) - start_t
        suffix_width = int(suffix_lens.max())
        pos = (start_t[:, None] + torch.arange(suffix_width)[None, :]).clamp_(max=kv_indices.shape[1] - 1)
        suffix_slots = kv_indices.gather(1, pos)
        suffix_mask = torch.arange(suffix_width)[None, :] < suffix_lens[:, None]
        return DecodeCascade(prefix=prefix, suffix_slots=suffix_slots.reshape(-1).to(device),
                             suffix_bias=_bias(suffix_mask, dtype, device))

    def attend(self, q: torch.Tensor, kv_buffer: torch.Tensor, scale: float) -> torch.Tensor:
        """q [B, H, D] (one query per request), kv_buffer [slots, 2, kvH, D] -> [B, H*D]."""
        bsz, h, d = q.shape
        kvh = kv_buffer.shape[2]
        gq = h // kvh
        flash = _flash_for_cpu()
        pre = self.prefix
        groups, rows = pre.num_groups, pre.group_rows

        def keys_values(slots: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
            kv = kv_buffer.index_select(0, slots).view(n, -1, 2, kvh, d).to(q.dtype)
            return kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)      # [n, kvH, S, D]

        # prefix: each group's members as query rows over the group's shared keys (GQA: a kv
        # head's query heads are rows too)
        qp = q.index_select(0, pre.q_rows).view(groups, rows, kvh, gq, d).transpose(1, 2)
        parts = [flash(qp[r.lo:r.hi].reshape(r.hi - r.lo, kvh, rows * gq, d), k, v, attn_mask=r.bias, scale=scale)
                 for r, (k, v) in zip(pre.runs, pre.keys_values(kv_buffer, keys_values))]
        o1 = torch.cat([o for o, _ in parts]) if len(parts) > 1 else parts[0][0]
        l1 = torch.cat([lse for _, lse in parts]) if len(parts) > 1 else parts[0][1]
        o1 = o1.view(groups, kvh, rows, gq, d).transpose(1, 2).reshape(groups * rows, kvh, gq, d)
        l1 = l1.view(groups, kvh, rows, gq).transpose(1, 2).reshape(groups * rows, kvh, gq)
        # suffix: every request's own keys (all of them for requests in no group)
        o2, l2 = flash(q.view(bsz, kvh, gq, d), *keys_values(self.suffix_slots, bsz),
                       attn_mask=self.suffix_bias, scale=scale)                  # [B, kvH, G, D]
        # merge the two softmaxes of each member by their log-sum-exps (fp32): the prefix part's
        # share of the whole softmax is exp(l1) / (exp(l1) + exp(l2)) = sigmoid(l1 - l2)
        share = torch.sigmoid(l1.index_select(0, pre.dest) - l2.index_select(0, pre.member_rows))[..., None]
        merged = torch.lerp(o2.index_select(0, pre.member_rows).float(), o1.index_select(0, pre.dest).float(), share)
        return o2.index_copy(0, pre.member_rows, merged.to(o2.dtype)).reshape(bsz, h * d)
