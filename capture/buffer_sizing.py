"""Capture buffer sizing (DESIGN invariant 1): one function, fed by the values that build the runners."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class ForwardShapeLimits:
    """The largest per-rank token counts each kind of forward the engine can issue."""

    dp_size: int
    max_running_requests: int
    chunked_prefill_tokens: int               # most tokens one prefill forward carries on a rank
    decode_graph_batch_sizes: tuple[int, ...] = ()
    prefill_graph_token_sizes: tuple[int, ...] = ()
    # tokens one request feeds a decode step: 1, or with speculative decoding its last token and
    # its drafts (speculative_num_draft_tokens)
    verify_tokens_per_request: int = 1

    @property
    def max_decode_tokens(self) -> int:
        """Most tokens one decode (or verify) forward carries on a rank."""
        return self.max_running_requests * self.verify_tokens_per_request

    @property
    def max_tokens_per_rank(self) -> int:
        return max(
            max(self.decode_graph_batch_sizes, default=0),
            max(self.prefill_graph_token_sizes, default=0),
            self.chunked_prefill_tokens,
            self.max_decode_tokens,
        )


def capture_buffer_rows(limits: ForwardShapeLimits) -> int:
    """Rows of the device capture buffer: every rank's tokens of any forward the engine can issue.

    NOTE: under DP attention the MoE sees all ranks' tokens gathered (padded to the runner's extent
    when a graph runner runs), so the buffer holds dp_size times the largest per-rank extent.
    """
    for name in ("dp_size", "max_running_requests", "chunked_prefill_tokens", "verify_tokens_per_request"):
        value = getattr(limits, name)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1 to size the capture buffer, got {value!r}")
    return limits.dp_size * limits.max_tokens_per_rank
