"""Req: the engine-side state of one generation request."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from rollout.generate_io import FinishReason
from rollout.sampling_params import SamplingParams


class ReqState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


def cache_namespace(salt: Optional[str]) -> int:
    """The prefix-cache namespace of a cache_salt: 0 (shared) for None, else a 64-bit hash shifted
    above every token id, so keys of different salts never compare equal."""
    if salt is None:
        return 0
    import hashlib  # noqa: PLC0415

    digest = hashlib.blake2b(salt.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return (int.from_bytes(digest, "little") | 1) << 32


@dataclass(eq=False)
class Req:
    uid: int                             # the engine's key (unique per engine; the front end assigns it)
    rid: str                             # the caller's request id (logs, error messages)
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    return_logprob: bool = False
    top_logprobs_num: int = 0
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    emit_interval: int = 0               # 0: one update when finished; k: an update every k new tokens
    max_total_len: int = 0               # prompt + output never exceed this (context limit)
    routed_dp_rank: Optional[int] = None  # DP attention: the rank this request must run on (None = any)
    cache_ns: int = 0                    # prefix-cache namespace (cache_salt / extra_key): 0 = shared
    prompt_logprob_start: int = -1       # logprob_start_len: input logprobs for positions start+1.. (-1: none)

    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    state: ReqState = ReqState.WAITING
    finish_reason: Optional[FinishReason] = None
    kv_row: Optional[int] = None         # the request's row of the scheduler's ReqToTokenPool (admitted)
    kv_len: int = 0                      # positions whose KV slot is in that row (computed or this step's)
    cache_len: int = 0                   # leading slots owned by the prefix cache
    last_node: Any = None                # locked prefix-cache node
    cached_tokens: int = 0
    scheduled_once: bool = False
    admit_seq: int = 0                   # admission order; retraction picks the newest
    queue_seq: int = 0                   # arrival order at the scheduler (weight updates wait on earlier ones)
    num_retractions: int = 0
    saved_routing: Optional[torch.Tensor] = None  # [n, L, K] rows for positions start.. saved at retraction
    sent_tokens: int = 0                 # update cursors: what earlier updates carried
    sent_routing_rows: int = 0
    input_logprobs: list[float] = field(default_factory=list)   # of prompt tokens start+1 .. len-1
    input_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    sent_input_logprobs: bool = False    # an update carried the prompt logprobs

    @property
    def fill_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_span(self, start: int, stop: int) -> list[int]:
        """fill_ids[start:stop] without building fill_ids (one decode token: no list copy)."""
        n = len(self.prompt_ids)
        if start >= n:
            return self.output_ids[start - n:stop - n]
        if stop <= n:
            return self.prompt_ids[start:stop]
        return self.prompt_ids[start:] + self.output_ids[:stop - n]

    def cache_key(self, n: int) -> list[int]:
        """fill_ids[:n] as the prefix cache's key: a salted request's key space never meets another's."""
        ids = self.token_span(0, n)
        if not self.cache_ns:
            return ids
        ns = self.cache_ns
        return [t + ns for t in ids]

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs asked and not all computed yet (their logits come from a prefill)."""
        return (self.prompt_logprob_start >= 0
                and len(self.input_logprobs) < len(self.prompt_ids) - 1 - self.prompt_logprob_start)

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def is_finished(self) -> bool:
        return self.state is ReqState.FINISHED
