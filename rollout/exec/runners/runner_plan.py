"""RunnerPlan: which runner (and bucket) runs a step, chosen from every DP rank's batch shape.

Pure: no model, no tensors. All ranks feed it the same exchanged shapes, so they all pick the same
runner and bucket, hence the same GatherLayout. It also knows the largest gathered forward every
runner can produce, which the engine checks against the capture buffer at startup (invariant 1).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from capture.buffer_sizing import ForwardShapeLimits, capture_buffer_rows
from capture.capturer import GatherLayout

DECODE = "decode_graph"
PREFILL = "prefill_graph"
EAGER = "eager"


@dataclass(frozen=True)
class RankShape:
    """What one rank's scheduler issued for a step."""

    num_tokens: int
    batch_size: int
    all_single: bool    # every request adds exactly one token (decode-shaped); True when idle

    @staticmethod
    def of(batch: Optional[Any]) -> "RankShape":
        """batch: a ScheduledBatch or None (idle rank)."""
        if batch is None:
            return RankShape(0, 0, True)
        return RankShape(sum(batch.extend_lens), len(batch.extend_lens), all(e == 1 for e in batch.extend_lens))

    def encode(self) -> tuple[int, int, int]:
        return self.num_tokens, self.batch_size, int(self.all_single)

    @staticmethod
    def decode(values: Sequence[int]) -> "RankShape":
        return RankShape(int(values[0]), int(values[1]), bool(values[2]))


@dataclass(frozen=True)
class RunnerChoice:
    runner: str                # DECODE | PREFILL | EAGER
    size: Optional[int]        # the bucket: batch size (decode) or tokens (prefill); None for eager
    extent: Optional[int]      # rows per rank in the gathered MoE input when padded; None = packed


def _smallest_at_least(sizes: tuple[int, ...], n: int) -> Optional[int]:
    for s in sizes:  # sorted ascending
        if s >= n:
            return s
    return None


class RunnerPlan:
    def __init__(self, limits: ForwardShapeLimits):
        self.limits = limits
        self.decode_sizes = tuple(sorted(limits.decode_graph_batch_sizes))
        self.prefill_sizes = tuple(sorted(limits.prefill_graph_token_sizes))

    def choose(self, shapes: Sequence[RankShape]) -> Optional[RunnerChoice]:
        """The runner for a step whose ranks issued `shapes` (rank order); None when no rank has tokens.

        Decode buckets take steps where every rank is decode-shaped (or idle) and the largest batch
        fits; prefill buckets take any step whose largest per-rank token count fits; eager the rest.
        """
        assert len(shapes) == self.limits.dp_size, (shapes, self.limits.dp_size)
        max_tokens = max(s.num_tokens for s in shapes)
        if max_tokens == 0:
            return None
        if self.decode_sizes and all(s.all_single for s in shapes):
            size = _smallest_at_least(self.decode_sizes, max(s.batch_size for s in shapes))
            if size is not None:
                return RunnerChoice(DECODE, size, size * self.limits.tokens_per_decode_step)
        size = _smallest_at_least(self.prefill_sizes, max_tokens)
        if size is not None:
            return RunnerChoice(PREFILL, size, size)
        return RunnerChoice(EAGER, None, None)

    @staticmethod
    def layout(choice: RunnerChoice, shapes: Sequence[RankShape]) -> GatherLayout:
        counts = tuple(s.num_tokens for s in shapes)
        if choice.extent is None:
            return GatherLayout.packed(choice.runner, counts)
        return GatherLayout.padded(choice.runner, counts, extent=choice.extent)

    def max_gathered_rows(self) -> dict[str, int]:
        """The most rows each runner can put in the gathered MoE input (all ranks together)."""
        lim = self.limits
        rows = {EAGER: lim.dp_size * max(lim.chunked_prefill_tokens,
                                         lim.max_running_requests * lim.tokens_per_decode_step)}
        if self.decode_sizes:
            rows[DECODE] = lim.dp_size * self.decode_sizes[-1] * lim.tokens_per_decode_step
        if self.prefill_sizes:
            rows[PREFILL] = lim.dp_size * self.prefill_sizes[-1]
        return rows

    def check_capture_fits(self, buffer_rows: int, max_rows: Optional[int] = None) -> None:
        """Startup check (invariant 1): every forward any runner can issue fits the capture buffer,
        and the buffer fits max_rows when one is configured. ValueError naming the values if not."""
        need = self.max_gathered_rows()
        worst = max(need.values())
        sized = capture_buffer_rows(self.limits)
        if worst > buffer_rows or (max_rows is not None and sized > max_rows):
            lim = self.limits
            detail = ", ".join(f"{k} {v}" for k, v in sorted(need.items()))
            limit = (f"the capture buffer has {buffer_rows} rows" if worst > buffer_rows
                     else f"max_capture_buffer_rows={max_rows}")
            raise ValueError(
                f"routed-expert capture buffer cannot hold every forward this config can issue: "
                f"it needs {max(worst, sized)} rows = dp_size={lim.dp_size} x max(decode_graph_batch_sizes max "
                f"{max(self.decode_sizes, default=0)} x tokens_per_decode_step={lim.tokens_per_decode_step}, "
                f"prefill_graph_token_sizes max {max(self.prefill_sizes, default=0)}, chunked prefill tokens "
                f"per rank {lim.chunked_prefill_tokens} (chunked_prefill_size), max_running_requests="
                f"{lim.max_running_requests} x {lim.tokens_per_decode_step}) [gathered rows per runner: {detail}], "
                f"but {limit}; lower one of these values or raise max_capture_buffer_rows")
