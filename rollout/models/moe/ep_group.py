"""EPGroup: the DP ranks as one expert-parallel group around each MoE layer (DP attention).

Attention runs per rank on that rank's own tokens. Before each MoE layer the ranks' hidden states
are gathered in the order the step's GatherLayout describes (padded: rank r at r * extent; packed:
prefix sums of the token counts), so the router, the top-k and the capture buffer see every rank's
tokens at the rows the capturer later slices. Each rank computes only its own experts'
contributions for all gathered rows; a reduce-scatter sums them and hands each rank back its rows.

The step's small host values (every rank's batch shape, `exchange`) travel over a CPU (gloo) group,
`meta_group`, as SGLang does for its DP metadata: over the NCCL group they would need a device
tensor and a `.tolist()` that waits for every kernel queued before it, each step. On the CPU the
one gloo group serves both.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from capture.capturer import GatherLayout

# NOTE: torch >= 2.10 names the single-tensor collectives *_single; older ones *_tensor.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def expert_range(num_experts: int, rank: int, size: int) -> tuple[int, int]:
    """[lo, hi) of the experts rank `rank` of `size` holds: contiguous, sizes differ by <= 1."""
    base, extra = divmod(num_experts, size)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (1 if rank < extra else 0)


class EPGroup:
    def __init__(self, *, rank: int, size: int, device: torch.device | str = "cpu",
                 group: Optional[dist.ProcessGroup] = None, meta_group: Optional[dist.ProcessGroup] = None):
        """group: the hidden states' collectives (NCCL on GPUs); meta_group: a gloo group of the same
        ranks for host values (None: group itself, which must then be gloo)."""
        assert 0 <= rank < size, (rank, size)
        self.rank = rank
        self.size = size
        self.device = torch.device(device)
        self.group = group
        self._gloo = dist.get_backend(group) == "gloo"
        self.meta_group = meta_group if meta_group is not None else group
        assert dist.get_backend(self.meta_group) == "gloo", "EPGroup's meta_group must be a gloo (CPU) group"

    def expert_range(self, num_experts: int) -> tuple[int, int]:
        """[lo, hi) of the experts this rank holds and computes."""
        return expert_range(num_experts, self.rank, self.size)

    def exchange(self, values: Sequence[int]) -> list[tuple[int, ...]]:
        """Every rank's `values` (same length on all ranks), in rank order: one small all-gather of
        host tensors over the gloo meta_group (no device sync)."""
        mine = torch.tensor(list(values), dtype=torch.int64)
        out = torch.empty(self.size * mine.numel(), dtype=torch.int64)
        _all_gather(out, mine, group=self.meta_group)
        return [tuple(row) for row in out.view(self.size, -1).tolist()]

    def gather(self, x: torch.Tensor, layout: GatherLayout) -> torch.Tensor:
        """x [this rank's span, H] -> [layout.total_rows, H], rows where the layout says."""
        width = layout.max_span
        start, stop = layout.rank_span(self.rank)
        assert x.shape[0] == stop - start, (x.shape, layout, self.rank)
        if x.shape[0] < width:
            x = torch.cat([x, x.new_zeros(width - x.shape[0], x.shape[1])])
        out = x.new_empty(self.size * width, x.shape[1])
        _all_gather(out, x.contiguous(), group=self.group)
        if layout.padded_extent is not None:
            return out                                                   # [size * extent, H]
        parts = out.view(self.size, width, -1)
        return torch.cat([parts[r, :c] for r, c in enumerate(layout.token_counts)])  # packed [sum, H]

    def reduce_own(self, partial: torch.Tensor, layout: GatherLayout) -> torch.Tensor:
        """partial [layout.total_rows, H] (this rank's experts only) -> the sum over ranks of this
        rank's span [span, H]."""
        width = layout.max_span
        assert partial.shape[0] == layout.total_rows, (partial.shape, layout)
        if layout.padded_extent is not None:
            full = partial
        else:
            full = partial.new_zeros(self.size * width, partial.shape[1])
            for r in range(self.size):
                lo, hi = layout.rank_rows(r)
                full[r * width: r * width + hi - lo] = partial[lo:hi]
        dtype = full.dtype
        if self._gloo and dtype not in (torch.float32, torch.float64):
            full = full.float()  # NOTE: gloo reduces only fp32/fp64 reliably
        own = full.new_empty(width, full.shape[1])
        _reduce_scatter(own, full.contiguous(), group=self.group)
        start, stop = layout.rank_span(self.rank)
        return own[: stop - start].to(dtype)
