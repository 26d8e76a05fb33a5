"""DraftKV: a drafter's own KV cache (STANDALONE's draft model, NEXTN's MTP layer), by request.

Per request it keeps a DraftSeq: a row of its own ReqToTokenPool and the positions whose KV is
confirmed (fed with the request's real tokens) followed by the positions fed with drafts. A drafter
confirms what holds and truncates the rest before each proposal, feeds its new positions through
`forward_batch`, and gives a finished or retracted request's KV back (`release`). Its KV, rows and
weights are its own (a full copy on every DP rank, no collectives); its forwards carry no capture
buffer, so its MoE layers never write the target's routing rows.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from rollout.batch.forward_batch import ForwardBatch
from rollout.batch.kv_pool import KVPool, ReqToTokenPool


@dataclass
class DraftSeq:
    """One request's draft KV: its row of the draft's ReqToTokenPool, the positions whose KV is
    the request's real tokens (confirmed) and the drafts fed after them."""
    row: int
    confirmed: int = 0
    fed: list[int] = field(default_factory=list)

    @property
    def kv_len(self) -> int:
        return self.confirmed + len(self.fed)


class DraftKV:
    def __init__(self, *, num_slots: int, num_layers: int, num_kv_heads: int, head_dim: int, latent_dim: int,
                 dtype: torch.dtype, device: torch.device, max_requests: int, context_length: int):
        self.device = device
        self.pool = KVPool(num_slots=num_slots, num_layers=num_layers, num_kv_heads=num_kv_heads,
                           head_dim=head_dim, dtype=dtype, device=device, latent_dim=latent_dim)
        self.rows = ReqToTokenPool(num_rows=max_requests, width=context_length, device=device)

    def available(self) -> int:
        return self.pool.available()

    def seq(self, req: Any) -> Optional[DraftSeq]:
        """The request's DraftSeq (a new one at its first proposal); None when no row is left."""
        if req.draft_state is None:
            try:
                req.draft_state = DraftSeq(row=self.rows.alloc())
            except RuntimeError:   # NOTE: every row is taken (cannot happen: one per running request)
                return None
        return req.draft_state

    def truncate(self, seq: DraftSeq, kv_len: int) -> None:
        """Gives back the KV of positions kv_len.. (confirmed ones past it are no longer confirmed)."""
        if kv_len < seq.kv_len:
            self.pool.free(self.rows.slots(seq.row, seq.kv_len)[kv_len:])
            del seq.fed[max(0, kv_len - seq.confirmed):]
            seq.confirmed = min(seq.confirmed, kv_len)

    def release(self, req: Any) -> None:
        """Gives back a request's draft KV and row (it finished or was retracted)."""
        seq = req.draft_state
        if seq is None:
            return
        req.draft_state = None
        if seq.kv_len:
            self.pool.free(self.rows.slots(seq.row, seq.kv_len))
        self.rows.free(seq.row)

    def forward_batch(self, seqs: Sequence[DraftSeq], ids: list[int], pre: list[int],
                      ext: list[int]) -> ForwardBatch:
        """A ForwardBatch over the draft's KV: request b feeds ext[b] tokens (of ids, in order) at
        positions pre[b].., in slots taken now (the caller made sure they are free)."""
        slots = self.pool.alloc(len(ids))
        assert slots is not None, "the draft's KV was reserved"
        off = 0
        for seq, p, e in zip(seqs, pre, ext):
            self.rows.write(seq.row, p, slots[off:off + e])
            off += e
        rows = torch.tensor([seq.row for seq in seqs], dtype=torch.int64)
        kv_indices = self.rows.gather(rows, max(p + e for p, e in zip(pre, ext)))
        return ForwardBatch.build(input_ids=ids, out_cache_loc=slots, prefix_lens=pre, extend_lens=ext,
                                  kv_indices=kv_indices, kv_pool=self.pool, device=self.device,
                                  segment_attention=True)

    def check_integrity(self, held: list[DraftSeq]) -> None:
        """Every used draft slot and row belongs to one running request's DraftSeq."""
        self.pool.check_integrity()
        self.rows.check_integrity([seq.row for seq in held])
        slots = [s for seq in held for s in self.rows.slots(seq.row, seq.kv_len).tolist()]
        assert len(slots) == len(set(slots)) == self.pool.used(), (
            f"draft slot leak: {len(slots)} held by requests, {self.pool.used()} used")

    def tensors(self) -> list[torch.Tensor]:
        """The KV storage (released with the target's KV by release_memory_occupation)."""
        return list(self.pool.kv_buffers)
