"""GatherLayout: where each DP rank's tokens sit in a forward's gathered MoE input (invariant 2)."""
from __future__ import annotations

from dataclasses import dataclass


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
