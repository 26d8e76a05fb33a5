"""Submission: what one submit() call queued, in output order."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Submission:
    """The request ids of one call in output order (prompt-major: each prompt's n samples together)
    and, for each, the index of its prompt in the call. Built from the request groups the call
    made, so no caller re-derives the order from `n` or from the shape of an id."""

    rids: list[str]
    prompt_index: dict[str, int]

    @staticmethod
    def of(groups: list[list[str]]) -> "Submission":
        """groups[i]: the request ids made for prompt i."""
        return Submission(rids=[r for g in groups for r in g],
                          prompt_index={r: i for i, g in enumerate(groups) for r in g})
