"""RoutedExpertsBuffer: where the MoE top-k op writes each layer's expert ids during a forward."""
from __future__ import annotations

import torch


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
