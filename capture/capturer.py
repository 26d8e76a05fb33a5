"""Routed-expert capture: where each DP rank's tokens sit in a forward's gathered MoE input
(GatherLayout, invariant 2), the device buffer the MoE top-k op writes each layer's expert ids
into (RoutedExpertsBuffer), the host store of routing rows per KV slot (RoutedExpertsStore), and
the capturer that moves rows from one to the other after each forward and assembles a request's
rows (RoutedExpertsCapturer)."""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Optional

import torch

from capture.buffer_sizing import ForwardShapeLimits, capture_buffer_rows
from capture.codec import narrowest_dtype

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class GatherLayout:
    """Made by the runner that executes a forward; drives both the hidden-state gather and capture.

    padded: rank r's tokens start at r * padded_extent (static-shape runners);
    packed: rank r's tokens start at the prefix sum of the token counts before it (eager).
    """

    runner: str                       # the runner that executed, e.g. "eager", "decode_graph"
    token_counts: tuple[int, ...]     # real tokens per rank
    padded_extent: int | None = None  # per-rank extent when padded; None when packed

    def __post_init__(self) -> None:
        assert len(self.token_counts) >= 1
        if self.padded_extent is not None:
            assert all(c <= self.padded_extent for c in self.token_counts), (self.token_counts, self.padded_extent)

    @staticmethod
    def packed(runner: str, token_counts: tuple[int, ...]) -> "GatherLayout":
        return GatherLayout(runner=runner, token_counts=tuple(token_counts))

    @staticmethod
    def padded(runner: str, token_counts: tuple[int, ...], extent: int) -> "GatherLayout":
        return GatherLayout(runner=runner, token_counts=tuple(token_counts), padded_extent=extent)

    @property
    def dp_size(self) -> int:
        return len(self.token_counts)

    @property
    def total_rows(self) -> int:
        if self.padded_extent is not None:
            return self.padded_extent * self.dp_size
        return sum(self.token_counts)

    def rank_start(self, rank: int) -> int:
        if self.padded_extent is not None:
            return rank * self.padded_extent
        return sum(self.token_counts[:rank])

    def rank_rows(self, rank: int) -> tuple[int, int]:
        """[start, stop) rows of rank's real tokens in the gathered buffer."""
        start = self.rank_start(rank)
        return start, start + self.token_counts[rank]

    def rank_span(self, rank: int) -> tuple[int, int]:
        """[start, stop) rows rank r contributed to the gather: its whole padded extent, or its tokens."""
        start = self.rank_start(rank)
        width = self.padded_extent if self.padded_extent is not None else self.token_counts[rank]
        return start, start + width

    @property
    def max_span(self) -> int:
        """Rows of the widest rank's contribution (padded extent, or the largest token count)."""
        return self.padded_extent if self.padded_extent is not None else max(self.token_counts)


class RoutedExpertsBuffer:
    """[rows, num_hidden_layers, top_k] int32 on the model's device; rows sized by capture_buffer_rows."""

    def __init__(self, *, rows: int, num_layers: int, top_k: int, device: torch.device | str = "cpu"):
        self.rows = rows
        self.num_layers = num_layers
        self.top_k = top_k
        self.buffer = torch.full((rows, num_layers, top_k), -1, dtype=torch.int32, device=device)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def record(self, layer_id: int, topk_ids: torch.Tensor) -> None:
        """topk_ids: [num_tokens, top_k] logical expert ids of layer layer_id, in token order."""
        n = topk_ids.shape[0]
        assert n <= self.rows, f"forward of {n} tokens exceeds the capture buffer ({self.rows} rows)"
        self.buffer[:n, layer_id].copy_(topk_ids)

    def layer_rows(self, layer_id: int, n: int) -> torch.Tensor:
        """The [n, top_k] int32 view of layer layer_id's first n rows (row stride num_layers * top_k):
        where a fused top-k kernel stores the ids itself instead of calling record()."""
        assert n <= self.rows, f"forward of {n} tokens exceeds the capture buffer ({self.rows} rows)"
        return self.buffer[:n, layer_id]

    def rows_view(self, start: int, stop: int) -> torch.Tensor:
        return self.buffer[start:stop]


class RoutedExpertsStore:
    """[kv_slots, num_hidden_layers, top_k]; the sentinel marks "no routing" (dense layers).

    Indexed by KV slot, so a prefix-cache hit reads the rows recorded when that KV was computed.
    """

    def __init__(self, *, num_slots: int, num_layers: int, top_k: int, num_experts: int,
                 moe_layer_ids: tuple[int, ...]):
        self.dtype = narrowest_dtype(num_experts)
        self.sentinel = 255 if self.dtype == torch.uint8 else -1
        self.num_layers = num_layers
        self.top_k = top_k
        self.moe_layer_ids = tuple(moe_layer_ids)
        self._all_moe = self.moe_layer_ids == tuple(range(num_layers))
        self._moe_index = torch.tensor(self.moe_layer_ids, dtype=torch.int64)
        self.store = torch.full((num_slots, num_layers, top_k), self.sentinel, dtype=self.dtype)

    @property
    def nbytes(self) -> int:
        return self.store.numel() * self.store.element_size()

    @property
    def bytes_per_slot(self) -> int:
        return self.num_layers * self.top_k * self.store.element_size()

    def write(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """slots: [N] KV slots; rows: [N, num_layers, top_k] int32 from the device buffer."""
        rows = rows.to("cpu", non_blocking=False)
        if self._all_moe:
            self.store[slots] = rows.to(self.dtype)
        else:
            # NOTE: dense layers keep the sentinel; only MoE layers' entries are written.
            sel = self.store[slots]
            sel[:, self._moe_index] = rows[:, self._moe_index].to(self.dtype)
            self.store[slots] = sel

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        """[len(slots), num_layers, top_k] int32 with -1 for "no routing"."""
        rows = self.store[slots].to(torch.int32)
        if self.sentinel != -1:
            rows[rows == self.sentinel] = -1
        return rows


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
        # NOTE: the overlap schedule commits on the forward thread while the scheduling thread reads rows
        self._lock = threading.Lock()
        self.store = RoutedExpertsStore(num_slots=num_slots, num_layers=num_layers, top_k=top_k,
                                        num_experts=num_experts, moe_layer_ids=moe_layer_ids)
        logger.info("routed-expert capture: device buffer %d rows = %d bytes; host store %d slots x %d bytes "
                    "= %d bytes (%s)", self.buffer.rows, self.buffer.nbytes, num_slots, self.store.bytes_per_slot,
                    self.store.nbytes, self.store.dtype)

    def commit(self, layout: GatherLayout, out_cache_loc: torch.Tensor, keep: Optional[list[int]] = None) -> None:
        """Starts copying this rank's rows of the forward just run to the host; they land at the
        KV slots of its tokens (out_cache_loc, host) when read (rows) or at the next commit.
        keep: only these of the rank's rows (a verify step's kept positions; the rows of rejected
        drafts never reach the store); None: all.

        NOTE: on CUDA a non_blocking copy into pinned memory with an event: the step's host work
        (sampling's one read of the results, which follows the copy on the stream) never waits
        for it separately. The copy is taken now because the next forward overwrites the buffer."""
        with self._lock:
            self._commit(layout, out_cache_loc, keep)

    def _commit(self, layout: GatherLayout, out_cache_loc: torch.Tensor, keep: Optional[list[int]]) -> None:
        self._flush()
        start, stop = layout.rank_rows(self.dp_rank)
        assert stop - start == out_cache_loc.numel(), (layout, out_cache_loc.numel())
        if keep is not None:
            index = torch.tensor(keep, dtype=torch.int64)
            out_cache_loc = out_cache_loc[index]
            rows = self.buffer.rows_view(start, stop).index_select(0, index.to(self.buffer.buffer.device))
            start, stop = 0, len(keep)
        else:
            rows = self.buffer.rows_view(start, stop)                           # [n, num_layers, top_k] int32
        if stop > start:
            host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=rows.is_cuda)
            host.copy_(rows, non_blocking=True)
            event = None
            if rows.is_cuda:
                event = torch.cuda.Event()
                event.record()
            self._pending = (out_cache_loc, host, event)

    def flush(self) -> None:
        """Writes the rows of the last commit into the host store (waiting for their copy)."""
        with self._lock:
            self._flush()

    def _flush(self) -> None:
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
