"""RoutedExpertsStore: routing rows per KV slot on the host, in the narrowest integer dtype."""
from __future__ import annotations

import torch

from capture.codec import narrowest_dtype


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
