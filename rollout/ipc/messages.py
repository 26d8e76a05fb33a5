"""Typed messages between the front end and an engine process (msgpack via msgspec).

Front end -> engine: AddReqs, AbortReqs, Call, Shutdown.
Engine -> front end: Ready once, then one StepOut per step that produced anything (updates of
every request touched, replies to calls), Fatal before an engine dies of an error.
Token ids, logprobs and routing rows travel as raw little-endian bytes, never as pickles.
"""
from __future__ import annotations

from typing import Any, Optional, Union

import msgspec
import numpy as np


class ReqSpec(msgspec.Struct, kw_only=True, array_like=True):
    """One request as the engine needs it (the front end keeps text, stop strings, sinks)."""
    uid: int
    rid: str
    prompt_ids: bytes                    # int32
    params: dict[str, Any]               # SamplingParams fields (stop strings stripped)
    seed: int
    return_logprob: bool
    top_logprobs_num: int
    return_routed_experts: bool
    routed_experts_start_len: int
    emit_interval: int                   # 0: one update when finished; k: deltas every k tokens
    max_total_len: int
    routed_dp_rank: Optional[int] = None
    cache_salt: Optional[str] = None     # prefix-cache isolation (cache_salt / extra_key): None = shared
    prompt_logprob_start: int = -1       # logprob_start_len for prompt logprobs (-1: none)
    arrival_time: float = 0.0            # time.time() when the front end received it (time to first token)


class AddReqs(msgspec.Struct, tag=True, array_like=True):
    reqs: list[ReqSpec]


class AbortReqs(msgspec.Struct, tag=True, array_like=True):
    uids: list[int]
    message: str = "aborted by request"


class Call(msgspec.Struct, tag=True, array_like=True):
    """A control call: the EngineCore method it names (rollout/core/engine_proc.py: CALLS) runs between
    steps and its result comes back as a Reply."""
    call_id: int
    method: str
    args: list[Any]


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    pass


class ReqUpdate(msgspec.Struct, kw_only=True, array_like=True, omit_defaults=True):
    """What one request gained since its previous update (all of it, for a one-shot request)."""
    uid: int
    output_ids: bytes = b""              # int32, new tokens
    logprobs: Optional[bytes] = None     # float32, one per new token
    top_ids: Optional[bytes] = None      # int32 [new tokens, top_n]
    top_logprobs: Optional[bytes] = None  # float32 [new tokens, top_n]
    top_n: int = 0
    routing: Optional[bytes] = None      # int16/int32 [rows, layers, top_k], rows final since last update
    routing_dtype: str = "int16"
    routing_start: int = 0               # absolute position of the first routing row
    finished: bool = False
    finish_type: Optional[str] = None    # "stop" | "length" | "abort"
    finish_matched: Union[int, str, None] = None
    finish_message: Optional[str] = None
    finish_err_type: Optional[str] = None     # a server-side failure's abort (SGLang's FINISH_ABORT fields)
    finish_status_code: Optional[int] = None
    cached_tokens: int = 0
    num_retractions: int = 0
    weight_version: str = ""
    input_logprobs: Optional[bytes] = None      # float32, prompt tokens start+1 .. (final update only)
    input_top_ids: Optional[bytes] = None       # int32 [prompt tokens, top_n]
    input_top_logprobs: Optional[bytes] = None  # float32 [prompt tokens, top_n]
    weight_versions: Optional[list] = None      # [[version, first output index], ...] new since the last update
    spec: Optional[list] = None                 # speculative decoding, final update: [verify steps, drafts proposed, kept]


class Reply(msgspec.Struct, kw_only=True, array_like=True, omit_defaults=True):
    call_id: int
    result: Any = None
    error: Optional[str] = None          # the message of a ValueError (or other error) raised by the call
    error_type: Optional[str] = None


class Ready(msgspec.Struct, tag=True, array_like=True):
    info: dict[str, Any]


class StepOut(msgspec.Struct, tag=True, array_like=True, omit_defaults=True):
    updates: list[ReqUpdate] = []
    replies: list[Reply] = []
    steps: int = 0                       # steps this rank finished so far


class Fatal(msgspec.Struct, tag=True, array_like=True):
    traceback: str


ToEngine = Union[AddReqs, AbortReqs, Call, Shutdown]
FromEngine = Union[Ready, StepOut, Fatal]


def ints(values: Any) -> bytes:
    return np.asarray(values, dtype=np.int32).tobytes()


def floats(values: Any) -> bytes:
    return np.asarray(values, dtype=np.float32).tobytes()


def int_list(data: Optional[bytes]) -> list[int]:
    return np.frombuffer(data, dtype=np.int32).tolist() if data else []


def float_list(data: Optional[bytes]) -> list[float]:
    return np.frombuffer(data, dtype=np.float32).tolist() if data else []


class Codec:
    """msgpack encoder/decoders for both directions (one per thread: msgspec objects are not shared)."""

    def __init__(self) -> None:
        self.encoder = msgspec.msgpack.Encoder()
        self.to_engine = msgspec.msgpack.Decoder(ToEngine)
        self.from_engine = msgspec.msgpack.Decoder(FromEngine)
