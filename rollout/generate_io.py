"""What a generation call takes and gives back: GenerateArgs (its request fields), RolloutOutput
(the finished result of one request, with SGLang's `{text, output_ids, meta_info}` view),
StreamChunk (what one streamed step adds), FinishReason (why a request ended, as the engine
decides it and the outputs report it: SGLang's `meta_info.finish_reason` shape) and Submission
(the request ids one call queued, in output order). SGLang keeps these types together in
io_struct.py."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

# the fields that take one value for every prompt or a list with one per prompt (RequestBuilder's order)
PER_PROMPT = ("return_logprob", "top_logprobs_num", "return_routed_experts", "cache_salt", "logprob_start_len",
              "routed_experts_start_len", "rid", "routed_dp_rank")


@dataclass(frozen=True, kw_only=True)
class GenerateArgs:
    """The request fields of one Rollout.generate / async_generate / submit call (the Python API and
    the server's /generate fill it; the front end's RequestBuilder checks every value).

    Exactly one of prompts (a text or a list of texts) and input_ids (token ids, or a list of such
    lists). sampling_params: a dict / SamplingParams / None, or a list with one per prompt. The
    PER_PROMPT fields take one value for every prompt or a list with one per prompt.
    routed_dp_rank (dp_size > 1): pin the requests to one DP rank; None lets the engine pick the
    least loaded rank. cache_salt: requests share prefix-cache entries (KV and routing rows) only
    with requests of the same salt (None: the shared space). logprob_start_len >= 0 (with
    return_logprob): the outputs' input_logprobs hold the raw logprobs of prompt tokens
    logprob_start_len+1 .. len-1. stream: StreamChunks instead of RolloutOutputs."""

    prompts: Any = None
    input_ids: Any = None
    sampling_params: Any = None
    return_logprob: Any = False
    top_logprobs_num: Any = 0
    return_routed_experts: Any = False
    routed_experts_start_len: Any = 0
    rid: Any = None
    stream: bool = False
    routed_dp_rank: Any = None
    cache_salt: Any = None
    logprob_start_len: Any = -1

    @staticmethod
    def of(prompts: Any, sampling_params: Any, options: dict[str, Any]) -> "GenerateArgs":
        """A public method's arguments (prompts may be a whole GenerateArgs, given alone)."""
        if isinstance(prompts, GenerateArgs):
            if sampling_params is not None or options:
                raise ValueError("a GenerateArgs holds every field: pass it alone")
            return prompts
        return GenerateArgs(prompts=prompts, sampling_params=sampling_params, **options)

    def per_prompt(self, name: str, count: int) -> list:
        """Field `name`'s value for each of count prompts."""
        return per_prompt(name, getattr(self, name), count)


def per_prompt(name: str, value: Any, count: int) -> list:
    """A value given once for every prompt, or a list with one per prompt, as one per prompt."""
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise ValueError(f"{name} has {len(value)} entries for {count} prompts")
        return list(value)
    return [value] * count


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
    # [[version, first output index], ...]: which weight version sampled which output tokens (one
    # entry unless the request lived across a weight update: paused in place or retracted, resumed)
    weight_versions: list = field(default_factory=list)
    routed_experts: Optional[torch.Tensor] = None     # [rows, num_hidden_layers, top_k] int32, -1 = dense
    routed_experts_start_len: int = 0
    num_experts: int = 0                              # for the compact wire format's dtype
    moe_layer_ids: tuple[int, ...] = ()
    num_retractions: int = 0
    input_logprobs: Optional[list[float]] = None      # prompt tokens logprob_start_len+1 .. (logprob_start_len >= 0)
    input_top_logprobs: Optional[list[list[tuple[float, int]]]] = None
    e2e_latency: float = field(default=0.0, compare=False)   # seconds from the call's arrival to this output
    # speculative decoding (SGLang's meta_info counters; never part of an output's equality: the
    # tokens, logprobs and routing are those without speculation): decode (verify) steps taken,
    # drafts proposed, drafts kept
    spec_verify_ct: int = field(default=0, compare=False)
    spec_num_proposed_drafts: int = field(default=0, compare=False)
    spec_num_correct_drafts: int = field(default=0, compare=False)

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def completion_tokens(self) -> int:
        return len(self.output_ids)

    def meta_info(self, routed_experts_format: str = "int32", routed_experts_dtype: str = "int32", *,
                  token_entry: Optional[Callable[[Any, int], list]] = None) -> dict[str, Any]:
        """SGLang's meta_info of this output: the one builder the Python API, `/generate` and the
        streams' last chunks use. token_entry(logprob, id): a logprob list's entry ([logprob, id,
        None] unless given: the server's adds the token's text when asked)."""
        entry = token_entry or _plain_entry
        meta = progress_meta(self.rid, self.prompt_tokens, self.completion_tokens, self.weight_version,
                             dict(self.finish_info), self.cached_tokens)
        meta["weight_versions"] = [list(e) for e in self.weight_versions]
        if self.spec_verify_ct:
            meta.update(spec_verify_ct=self.spec_verify_ct,
                        spec_accept_length=self.completion_tokens / self.spec_verify_ct,
                        spec_accept_rate=(self.spec_num_correct_drafts / self.spec_num_proposed_drafts
                                          if self.spec_num_proposed_drafts else 0.0),
                        spec_num_correct_drafts=self.spec_num_correct_drafts,
                        spec_num_proposed_drafts=self.spec_num_proposed_drafts)
        if self.output_logprobs is not None:
            meta["output_token_logprobs"] = [entry(lp, tid) for lp, tid in zip(self.output_logprobs, self.output_ids)]
        if self.output_top_logprobs is not None:
            meta["output_top_logprobs"] = [[entry(lp, tid) for lp, tid in row] for row in self.output_top_logprobs]
        if self.routed_experts is not None:
            meta["routed_experts"] = self.encode_routing(routed_experts_format, routed_experts_dtype)
            meta["routed_experts_start_len"] = self.routed_experts_start_len
        return meta

    def encode_routing(self, fmt: str = "int32", dtype: str = "int32") -> str:
        """The routing rows in a wire format (capture.codec.encode_engine_rows: the one encoder of
        the engine's rows, for outputs and stream chunks alike)."""
        from capture.codec import encode_engine_rows  # noqa: PLC0415 (capture is optional)

        return encode_engine_rows(self.routed_experts, fmt, num_experts=self.num_experts,
                                  start=self.routed_experts_start_len, layer_ids=self.moe_layer_ids, dtype=dtype)

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


def progress_meta(rid: str, prompt_tokens: int, completion_tokens: int, weight_version: str,
                  finish_reason: Optional[dict] = None, cached_tokens: Optional[int] = None) -> dict[str, Any]:
    """The head of every meta_info (a stream's unfinished chunks carry only this, finish_reason None)."""
    meta: dict[str, Any] = {"id": rid, "finish_reason": finish_reason, "prompt_tokens": prompt_tokens,
                            "completion_tokens": completion_tokens}
    if cached_tokens is not None:
        meta["cached_tokens"] = cached_tokens
    meta["weight_version"] = weight_version
    return meta


def _plain_entry(logprob: Any, token_id: int) -> list:
    return [logprob, token_id, None]
