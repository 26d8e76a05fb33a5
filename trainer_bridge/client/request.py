"""``Request``: one sample to generate, and the ``/generate`` body it is sent as."""
from __future__ import annotations

import hashlib
import uuid
from dataclasses import dataclass, field
from typing import Any


@dataclass(kw_only=True)
class Request:
    """One sample to generate. ``sampling_params`` must be JSON-ready; ``sampling_seed`` is filled in."""
    input_ids: list[int]
    sampling_params: dict
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    group_id: Any = None
    meta: dict = field(default_factory=dict)

    def fill_defaults(self) -> None:
        """A ``sampling_seed`` derived from the rid (so every retry samples the same) and ``n = 1``."""
        sp = self.sampling_params
        sp.setdefault("sampling_seed", int.from_bytes(hashlib.sha256(self.rid.encode()).digest()[:7], "little"))
        sp.setdefault("n", 1)
        if sp["n"] != 1:
            raise ValueError(f"request {self.rid!r}: sampling_params.n must be 1 (one request per sample)")

    def body(self, *, routing_format: str, stream: bool, return_routed_experts: bool) -> dict:
        """The JSON body of ``/generate``."""
        body = {"input_ids": list(self.input_ids), "sampling_params": self.sampling_params, "rid": self.rid,
                "return_logprob": True, "return_routed_experts": return_routed_experts,
                "routed_experts_format": routing_format, "stream": stream}
        if stream:
            body["incremental_streaming_output"] = True  # SGLang ignores it and streams cumulative chunks
        return body
