"""Req: the engine-side state of one generation request; WaitQueue: the queue of waiting ones.

WaitQueue order is FIFO for added requests; a retracted request goes to the very front (the last
one pushed to the front comes first). Built from two insertion-ordered dicts, so append, push to
the front, remove and membership are O(1) and abort of n queued requests costs O(n), not O(n^2).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, Iterator, Optional

import torch

from rollout.generate_io import FinishReason
from rollout.sampling_params import SamplingParams


class ReqStatus(enum.Enum):
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
    arrival_time: float = 0.0            # time.time() of its arrival at the front end (0: unknown)

    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    status: ReqStatus = ReqStatus.WAITING
    finish_reason: Optional[FinishReason] = None
    req_to_token_row: Optional[int] = None         # the request's row of the scheduler's ReqToTokenPool (admitted)
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
    sent_weight_versions: int = 0
    # (weight_version, index of the first output token it sampled), one entry per version change
    weight_versions: list[tuple[str, int]] = field(default_factory=list)
    input_logprobs: list[float] = field(default_factory=list)   # of prompt tokens start+1 .. len-1
    input_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    sent_input_logprobs: bool = False    # an update carried the prompt logprobs
    last_token_time: float = 0.0         # time.time() of the step that sampled its latest token (0: none yet)
    # speculative decoding: the drafter's per-request state, and SGLang's meta_info counters
    draft_state: Any = None
    spec_verify_ct: int = 0              # decode (verify) steps the request took
    spec_num_proposed_drafts: int = 0
    spec_num_correct_drafts: int = 0     # drafts kept (equal to the target's own sample)
    spec_cap: int = 1                    # drafts it may take next (rollout/core/drafter.py: pace); starts at one
    spec_backoff: int = 0                # > 0: it drafts only at decode steps that are multiples of this

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


class WaitQueue:
    """The scheduler's queue of waiting requests, with O(1) removal of any member (module doc)."""

    def __init__(self) -> None:
        self._front: dict[Req, None] = {}   # pushed to the front; iterated newest first
        self._back: dict[Req, None] = {}    # appended; iterated oldest first

    def append(self, req: Req) -> None:
        assert req not in self, f"request {req.rid} queued twice"
        self._back[req] = None

    def appendleft(self, req: Req) -> None:
        assert req not in self, f"request {req.rid} queued twice"
        self._front[req] = None

    def remove(self, req: Req) -> None:
        """Takes a queued request out (KeyError if it is not queued)."""
        if req in self._front:
            del self._front[req]
        else:
            del self._back[req]

    def discard_all(self) -> list[Req]:
        """Empties the queue; returns its members in queue order."""
        out = list(self)
        self._front.clear()
        self._back.clear()
        return out

    def __contains__(self, req: object) -> bool:
        return req in self._back or req in self._front

    def __len__(self) -> int:
        return len(self._front) + len(self._back)

    def __bool__(self) -> bool:
        return bool(self._back) or bool(self._front)

    def __iter__(self) -> Iterator[Req]:
        """Queue order. NOTE: do not add or remove while iterating (dicts refuse it)."""
        return chain(reversed(self._front), self._back)
