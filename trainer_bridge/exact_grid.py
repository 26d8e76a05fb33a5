"""PackedGrid: one packed row of samples laid out as the engine's attention grid, for exact mode.

The trainer packs samples into one row [1, N] (each sample's positions restart at 0); the engine
attends per request over keys counted from the request's first token. PackedGrid places token
i of sample s at grid row s * longest + offset, so every sample is one grid row of keys starting
at key 0 (the key tiles of rollout.exact.attention line up with the engine's), with the causal
mask of each sample over its own tokens only.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["PackedGrid", "packed_segments"]


def packed_segments(position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """position_ids [N] of packed samples (each restarting at 0) -> (segment of each token [N],
    offset of each token in its segment [N], longest segment). A segment starts where the position
    does not continue the previous one; it must start at 0 (its first key is key 0)."""
    n = position_ids.shape[0]
    starts = torch.ones(n, dtype=torch.bool, device=position_ids.device)
    starts[1:] = position_ids[1:] != position_ids[:-1] + 1
    if bool((position_ids[starts] != 0).any()):
        raise ValueError("exact attention: every packed sample must start at position 0 "
                         f"(position_ids of segment starts: {position_ids[starts].tolist()[:8]})")
    seg = torch.cumsum(starts.long(), 0) - 1                                       # [N]
    offset = position_ids.long()
    return seg, offset, int(offset.max()) + 1


@dataclass(frozen=True)
class PackedGrid:
    segments: int            # S samples
    longest: int             # T tokens of the longest
    index: torch.Tensor      # [N] grid row (s * T + offset) of each packed token
    lengths: torch.Tensor    # [S] tokens of each sample

    @classmethod
    def from_position_ids(cls, position_ids: torch.Tensor | None, rows: int) -> "PackedGrid":
        """position_ids [1, N] (or [N]) of one packed row; rows: the batch size the model saw."""
        if position_ids is None or rows != 1:
            raise ValueError("exact attention needs one packed row [1, N] and its position_ids "
                             "(PackedBatch.model_inputs)")
        seg, off, longest = packed_segments(position_ids.reshape(-1))
        segments = int(seg[-1]) + 1
        return cls(segments, longest, seg * longest + off, torch.bincount(seg, minlength=segments))

    def to_grid(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, ...] (packed tokens) -> [S, T, ...], zeros where a sample has no token."""
        g = x.new_zeros(self.segments * self.longest, *x.shape[1:]).index_copy(0, self.index, x)
        return g.view(self.segments, self.longest, *x.shape[1:])

    def from_grid(self, g: torch.Tensor) -> torch.Tensor:
        """g [S, T, ...] -> [N, ...] in packed order."""
        return g.reshape(self.segments * self.longest, *g.shape[2:]).index_select(0, self.index)

    def causal_mask(self, sliding_window: int | None = None) -> torch.Tensor:
        """[S, T, T] bool: query t of sample s may attend key u (u <= t, u inside the sample, and
        u > t - sliding_window when a window is given; 0 / None: no window)."""
        pos = torch.arange(self.longest, device=self.index.device)
        mask = (pos[None, :, None] >= pos[None, None, :]) & (pos[None, None, :] < self.lengths[:, None, None])
        if sliding_window:
            mask &= pos[None, None, :] > pos[None, :, None] - sliding_window
        return mask
