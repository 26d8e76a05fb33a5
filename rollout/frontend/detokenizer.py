"""IncrementalDetokenizer: turns a growing list of token ids into text deltas."""
from __future__ import annotations

from typing import Callable


class IncrementalDetokenizer:
    """Decodes only a short window per step; holds back text ending in an incomplete UTF-8 char."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self._decode = decode
        self._prefix_offset = 0
        self._read_offset = 0
        self.text = ""

    def step(self, ids: list[int]) -> str:
        """ids: all output ids so far. Returns the new text since the previous call."""
        prefix = self._decode(ids[self._prefix_offset:self._read_offset])
        full = self._decode(ids[self._prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix):]
            self._prefix_offset = self._read_offset
            self._read_offset = len(ids)
            self.text += delta
            return delta
        return ""

    def flush(self, ids: list[int]) -> str:
        """At the end: whatever is still held back (a trailing replacement char included)."""
        rest = self._decode(ids[self._prefix_offset:])[len(self._decode(ids[self._prefix_offset:self._read_offset])):]
        self._prefix_offset = self._read_offset = len(ids)
        self.text += rest
        return rest
