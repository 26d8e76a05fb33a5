"""``StreamAssembler``: reads a ``/generate`` SSE stream line by line and assembles the response
one non-streamed ``/generate`` would have given (tokens, logprobs, text, and the routing rows
that became final in each chunk, decoded as they arrive)."""
from __future__ import annotations

import json
from typing import Callable, Optional

import torch

from .errors import SampleError, _ServerFailed


class StreamAssembler:
    """Feed it the stream's lines (``feed``); ``result()`` is the assembled response.

    Args:
        decode_routing: a chunk's ``routed_experts`` string -> ``[rows, num_layers, top_k]`` int32.
        rid / url: named in errors.

    ``feed`` raises ``json.JSONDecodeError`` for a malformed event, ``_ServerFailed`` for an
    ``error`` event and ``SampleError`` for routing rows out of order.
    """

    def __init__(self, decode_routing: Callable[[str], torch.Tensor], rid: str, url: str):
        self._decode_routing = decode_routing
        self._rid, self._url = rid, url
        self.out_ids: list[int] = []
        self.lps: list[float] = []
        self.rows: list[torch.Tensor] = []
        self.next_row = 0
        self.final: Optional[dict] = None
        self.text_parts: list[str] = []
        self.nbytes = 0

    def feed(self, line: str) -> bool:
        """One line of the stream; False once the stream says ``[DONE]``."""
        self.nbytes += len(line) + 1
        if not line.startswith("data: "):
            return True
        data = line[6:]
        if data == "[DONE]":
            return False
        ev = json.loads(data)
        if "error" in ev:
            raise _ServerFailed(f"stream error: {str(ev['error'])[:200]}", dead=True)
        meta = ev["meta_info"]
        ids = ev.get("output_ids") or []
        # NOTE: a cumulative chunk (SGLang's default) holds every token so far; an
        # incremental one only the new ones (fewer than completion_tokens after the first)
        if len(ids) == meta.get("completion_tokens", -1):
            self.out_ids, self.lps, self.text_parts = [], [], []
        self.out_ids.extend(ids)
        self.text_parts.append(ev.get("text") or "")
        self.lps.extend(lp for lp, _t, _x in meta.get("output_token_logprobs") or [])
        if meta.get("routed_experts") is not None:
            if "routed_experts_start" not in meta:  # the whole routing (cumulative streaming)
                self.rows, self.next_row = [], 0
            start = int(meta.get("routed_experts_start", self.next_row))
            chunk = self._decode_routing(meta["routed_experts"])
            if start != self.next_row:
                raise SampleError(f"request {self._rid!r}: {self._url} streamed routing rows from "
                                  f"{start}, expected {self.next_row}")
            self.rows.append(chunk)
            self.next_row += chunk.shape[0]
        if meta.get("finish_reason") is not None:
            self.final = ev
        return True

    def result(self) -> dict:
        """The assembled response (``_routing``: the routing rows, already decoded)."""
        if self.final is None:
            raise _ServerFailed("stream ended without a finished event", dead=False)
        meta = dict(self.final["meta_info"])
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(self.lps, self.out_ids)]
        meta.pop("routed_experts", None)
        out = {"text": "".join(self.text_parts), "output_ids": self.out_ids, "meta_info": meta}
        if self.rows:
            out["_routing"] = torch.cat(self.rows)
        return out
