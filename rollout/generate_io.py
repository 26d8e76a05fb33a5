"""What a generation call gives back: RolloutOutput (the finished result of one request, with
SGLang's `{text, output_ids, meta_info}` view), StreamChunk (what one streamed step adds),
FinishReason (why a request ended, as the engine decides it and the outputs report it: SGLang's
`meta_info.finish_reason` shape) and Submission (the request ids one call queued, in output order).
SGLang keeps these types together in io_struct.py."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

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


@dataclass(frozen=True, kw_only=True)
class RolloutOutput:
    rid: str
    prompt_ids: list[int]
    output_ids: list[int]
    text: str
    finish_reason: str                     # "stop" | "length" | "abort"
    finish_info: dict = field(default_factory=dict)   # SGLang's finish_reason object
    output_logprobs: Optional[list[float]] = None
    output_top_logprobs: Optional[list[list[tuple[float, int]]]] = None
    cached_tokens: int = 0
    weight_version: str = "default"
    routed_experts: Optional[torch.Tensor] = None     # [rows, num_hidden_layers, top_k] int32, -1 = dense
    routed_experts_start_len: int = 0
    num_experts: int = 0                              # for the compact wire format's dtype
    moe_layer_ids: tuple[int, ...] = ()
    num_retractions: int = 0
    input_logprobs: Optional[list[float]] = None      # prompt tokens logprob_start_len+1 .. (logprob_start_len >= 0)
    input_top_logprobs: Optional[list[list[tuple[float, int]]]] = None

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def completion_tokens(self) -> int:
        return len(self.output_ids)

    def meta_info(self, routed_experts_format: str = "int32", routed_experts_dtype: str = "int32") -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": dict(self.finish_info),
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "weight_version": self.weight_version,
        }
        if self.output_logprobs is not None:
            meta["output_token_logprobs"] = [[lp, tid, None] for lp, tid in zip(self.output_logprobs, self.output_ids)]
        if self.output_top_logprobs is not None:
            meta["output_top_logprobs"] = [[[lp, tid, None] for lp, tid in row] for row in self.output_top_logprobs]
        if self.routed_experts is not None:
            from capture.codec import encode_engine_rows  # noqa: PLC0415 (capture is optional)

            meta["routed_experts"] = encode_engine_rows(
                self.routed_experts, routed_experts_format, num_experts=self.num_experts,
                start=self.routed_experts_start_len, layer_ids=self.moe_layer_ids, dtype=routed_experts_dtype)
            meta["routed_experts_start_len"] = self.routed_experts_start_len
        return meta

    def to_dict(self, routed_experts_format: str = "int32") -> dict[str, Any]:
        return {"text": self.text, "output_ids": list(self.output_ids),
                "meta_info": self.meta_info(routed_experts_format)}


@dataclass(frozen=True, kw_only=True)
class StreamChunk:
    rid: str
    output_ids: list[int]                          # new tokens since the previous chunk
    text: str                                      # new text since the previous chunk
    output_logprobs: Optional[list[float]] = None
    output_top_logprobs: Optional[list[list[tuple[float, int]]]] = None
    routed_experts: Optional[torch.Tensor] = None  # [rows, L, K] rows final since the previous chunk
    routed_experts_start: int = 0                  # absolute position of routed_experts[0]
    finished: bool = False
    output: Optional[RolloutOutput] = None         # the whole result, on the last chunk


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
