"""FinishReason: why a request ended, as the engine decides it and the outputs report it (SGLang's
`meta_info.finish_reason` shape)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class FinishReason:
    type: str                       # "stop" | "length" | "abort"
    matched: Any = None             # the token id or stop string that matched
    message: Optional[str] = None
    err_type: Optional[str] = None      # abort by a server-side failure (SGLang's FINISH_ABORT fields)
    status_code: Optional[int] = None

    def to_dict(self, completion_tokens: int) -> dict:
        out: dict = {"type": self.type}
        if self.type == "stop":
            out["matched"] = self.matched
        elif self.type == "length":
            out["length"] = completion_tokens
        if self.message:
            out["message"] = self.message
        if self.err_type:
            out["err_type"] = self.err_type
            out["status_code"] = self.status_code
        return out
