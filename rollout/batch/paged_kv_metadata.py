"""PagedKVMetadata: a step's attention as ragged index arrays, FlashInfer's paged-KV layout.

With one KV slot per page (page size 1), a request's "pages" are its KV slots and the last page
always holds one token. Per level: qo_indptr [R+1] (query rows of entry r), kv_indptr [R+1] and
kv_indices [nnz] (its slots in position order), kv_last_page_len [R] (all 1). A plain step has
one level with one entry per request, causal (query i of an entry with qo_len queries and
kv_len keys sits at key position kv_len - qo_len + i: FlashInfer's bottom-right alignment).

A decode step whose requests share cached prefixes (GRPO groups) has two levels, the layout of
FlashInfer's multi-level cascade: level 0 has one entry per group, its members' queries over the
group's shared prefix (read once), level 1 one entry per request over its own keys after that
prefix; the two softmaxes merge by log-sum-exp. Both levels index the same query rows, so the
members of a group must be adjacent: `order` lists the batch row of each query row (None: the
batch order). A request in no group is a group of its own whose prefix is its first key.

paged_kv_metadata is the one function that builds this, for the FlashInfer backend, the Triton
cascade kernel and the CPU reference (models/paged_reference_attention.py) alike.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Optional, Sequence

import torch

from rollout.batch.host_device import to_device


@dataclass(frozen=True)
class PagedKVLevel:
    qo_indptr: torch.Tensor          # [R+1] int32
    kv_indptr: torch.Tensor          # [R+1] int32
    kv_indices: torch.Tensor         # [nnz] int32 KV slots
    kv_last_page_len: torch.Tensor   # [R] int32, all 1 (one slot per page)
    max_qo_len: int                  # most query rows of one entry (a kernel grid dimension)

    @property
    def num_entries(self) -> int:
        return int(self.qo_indptr.shape[0]) - 1


@dataclass(frozen=True)
class PagedKVMetadata:
    levels: tuple[PagedKVLevel, ...]
    order: Optional[torch.Tensor]    # [N] int64 batch row of each query row; None = batch order
    causal: bool                     # level 0 of a plain step; cascade levels are never causal

    @property
    def is_cascade(self) -> bool:
        return len(self.levels) > 1


def _level(qo_lens: Sequence[int], spans: list[tuple[int, int, int]], kv_flat: torch.Tensor, width: int,
           device: torch.device) -> PagedKVLevel:
    """spans[r] = (batch row, lo, hi): entry r's keys are that row's slots at positions lo .. hi-1."""
    def indptr(lens: Sequence[int]) -> torch.Tensor:
        return to_device(torch.tensor([0, *accumulate(lens)], dtype=torch.int32), device)

    kv_lens = [hi - lo for _, lo, hi in spans]
    # NOTE: the cells to read are known on the host (lengths), so the slots are one gather on the
    # table's device: no copy of the table to the host
    flat = torch.cat([torch.arange(lo, hi) + row * width for row, lo, hi in spans]) if spans else \
        torch.zeros(0, dtype=torch.int64)
    indices = kv_flat.index_select(0, to_device(flat, kv_flat.device))
    return PagedKVLevel(qo_indptr=indptr(qo_lens), kv_indptr=indptr(kv_lens),
                        kv_indices=indices.to(device=device, dtype=torch.int32),
                        kv_last_page_len=torch.ones(len(kv_lens), dtype=torch.int32, device=device),
                        max_qo_len=max(qo_lens, default=0))


def paged_kv_metadata(*, extend_lens: Sequence[int], seq_lens: Sequence[int], kv_indices: torch.Tensor,
                      prefix_groups: Sequence[tuple[int, Sequence[int]]] = (),
                      device: torch.device | str = "cpu") -> PagedKVMetadata:
    """extend_lens / seq_lens: per request (host ints); kv_indices [B, >= max seq_len] slots by
    position (host or device); prefix_groups: (shared length P, batch rows) of requests whose
    first P slots are the same, used only when every request has one new token (decode)."""
    dev = torch.device(device)
    width = int(kv_indices.shape[1])
    kv_flat = kv_indices.reshape(-1)                                         # [B * width]
    bsz = len(seq_lens)
    groups = [(int(p), list(m)) for p, m in prefix_groups if len(m) > 1 and p > 0]
    if not groups or any(e != 1 for e in extend_lens):
        spans = [(b, 0, int(seq_lens[b])) for b in range(bsz)]
        return PagedKVMetadata(levels=(_level(list(extend_lens), spans, kv_flat, width, dev),), order=None,
                               causal=True)
    grouped = {r for _, m in groups for r in m}
    assert len(grouped) == sum(len(m) for _, m in groups), "a request is in two prefix groups"
    # NOTE: a request outside every group: its first key is its own "prefix" (no empty level entry)
    groups += [(1, [r]) for r in range(bsz) if r not in grouped]
    order, prefix, shared = [], [], []
    for p, members in groups:
        assert all(p < seq_lens[r] for r in members), "a shared prefix must leave each member its own keys"
        order += members
        prefix.append((members[0], 0, p))
        shared += [p] * len(members)
    own = [(r, p, int(seq_lens[r])) for r, p in zip(order, shared)]
    return PagedKVMetadata(
        levels=(_level([len(m) for _, m in groups], prefix, kv_flat, width, dev),
                _level([1] * bsz, own, kv_flat, width, dev)),
        order=to_device(torch.tensor(order, dtype=torch.int64), dev), causal=False)
