"""RoutedExpertsCapturer: device buffer -> host store after each forward; per-request row assembly."""
from __future__ import annotations

import logging
from typing import Optional

import torch

from capture.buffer_sizing import ForwardShapeLimits, capture_buffer_rows
from capture.device_buffer import RoutedExpertsBuffer
from capture.gather_layout import GatherLayout
from capture.host_store import RoutedExpertsStore

logger = logging.getLogger(__name__)


class RoutedExpertsCapturer:
    def __init__(self, *, limits: ForwardShapeLimits, num_slots: int, num_layers: int, top_k: int,
                 num_experts: int, moe_layer_ids: tuple[int, ...], dp_rank: int = 0,
                 device: torch.device | str = "cpu"):
        self.limits = limits
        self.dp_rank = dp_rank
        self.num_experts = num_experts
        self.moe_layer_ids = tuple(moe_layer_ids)
        self.buffer = RoutedExpertsBuffer(rows=capture_buffer_rows(limits), num_layers=num_layers,
                                          top_k=top_k, device=device)
        self._pending: Optional[tuple[torch.Tensor, torch.Tensor, Optional[torch.cuda.Event]]] = None
        self.store = RoutedExpertsStore(num_slots=num_slots, num_layers=num_layers, top_k=top_k,
                                        num_experts=num_experts, moe_layer_ids=moe_layer_ids)
        logger.info("routed-expert capture: device buffer %d rows = %d bytes; host store %d slots x %d bytes "
                    "= %d bytes (%s)", self.buffer.rows, self.buffer.nbytes, num_slots, self.store.bytes_per_slot,
                    self.store.nbytes, self.store.dtype)

    def commit(self, layout: GatherLayout, out_cache_loc: torch.Tensor) -> None:
        """Starts copying this rank's rows of the forward just run to the host; they land at the
        KV slots of its tokens (out_cache_loc, host) when read (rows) or at the next commit.

        NOTE: on CUDA a non_blocking copy into pinned memory with an event: the step's host work
        (sampling's one read of the results, which follows the copy on the stream) never waits
        for it separately. The copy is taken now because the next forward overwrites the buffer."""
        self.flush()
        start, stop = layout.rank_rows(self.dp_rank)
        assert stop - start == out_cache_loc.numel(), (layout, out_cache_loc.numel())
        if stop > start:
            rows = self.buffer.rows_view(start, stop)                           # [n, num_layers, top_k] int32
            host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=rows.is_cuda)
            host.copy_(rows, non_blocking=True)
            event = None
            if rows.is_cuda:
                event = torch.cuda.Event()
                event.record()
            self._pending = (out_cache_loc, host, event)

    def flush(self) -> None:
        """Writes the rows of the last commit into the host store (waiting for their copy)."""
        if self._pending is None:
            return
        slots, host, event = self._pending
        self._pending = None
        if event is not None:
            event.synchronize()
        self.store.write(slots, host)

    def rows(self, kv_slots: torch.Tensor, lo: int, hi: int, saved: Optional[torch.Tensor] = None,
             saved_start: int = 0) -> torch.Tensor:
        """Rows for positions [lo, hi) of a sequence whose position p's KV is at kv_slots[p].

        saved: rows for positions [saved_start, saved_start + len(saved)) kept from before a
        retraction; they win over the store, so they stay paired with the logprobs already returned.
        """
        self.flush()
        parts = []
        pos = lo
        if saved is not None and saved.shape[0] > 0:
            saved_end = saved_start + saved.shape[0]
            assert lo >= saved_start
            if pos < min(hi, saved_end):
                parts.append(saved[pos - saved_start: min(hi, saved_end) - saved_start])
                pos = min(hi, saved_end)
        if pos < hi:
            parts.append(self.store.gather(kv_slots[pos:hi]))
        if not parts:
            return torch.empty((0, self.store.num_layers, self.store.top_k), dtype=torch.int32)
        return parts[0] if len(parts) == 1 else torch.cat(parts)
