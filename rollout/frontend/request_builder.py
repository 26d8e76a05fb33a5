"""RequestBuilder: validates a generate call and turns it into engine specs and front-end states.

Everything is checked here, in the caller's thread, before anything is queued: SamplingParams
name the field and the range in every ValueError; prompts are checked against the vocabulary,
the context length and the KV pool (a request that could never fit alone is refused, so it can
never wedge the scheduler). Each prompt becomes n requests, one uid each; sample k's seed derives
from the prompt's.
"""
from __future__ import annotations

import dataclasses
import itertools
import random
import time
import uuid
from typing import Any, Optional, Sequence, Union

import numpy as np

from rollout.config import EngineConfig
from rollout.frontend.engine_client import WeightsInconsistentError
from rollout.frontend.request_state import RequestState, RoutingShape
from rollout.generate_io import PER_PROMPT, GenerateArgs
from rollout.ipc.messages import ReqSpec
from rollout.sampling_params import SamplingParams
from rollout.tokenizer import Tokenizer

MAX_TOP_LOGPROBS = 64
ParamsArg = Union[None, dict, SamplingParams, Sequence[Union[dict, SamplingParams]]]
Groups = list[list[tuple[ReqSpec, RequestState]]]


def derive_seed(seed: int, index: int) -> int:
    if index == 0:
        return seed
    x = (seed + index * 0x9E3779B97F4A7C15) & (2**64 - 1)
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return (x ^ (x >> 31)) & (2**63 - 1)


_INT = frozenset({int})


def _all_ints(values: Any) -> bool:
    """Every value an int (bool included, as isinstance says), checked per distinct type."""
    return all(issubclass(t, int) for t in set(map(type, values)))


class RequestBuilder:
    def __init__(self, *, config: EngineConfig, info: Any, tokenizer: Tokenizer, context_length: int,
                 kv_capacity: int, routing: Optional[RoutingShape]):
        self.config, self.info, self.tokenizer = config, info, tokenizer
        self.context_length, self.kv_capacity, self.routing = context_length, kv_capacity, routing
        self._rng = random.Random(config.seed)
        self._uids = itertools.count(1)
        self.released_memory: tuple[str, ...] = ()   # set by Rollout.release/resume_memory_occupation
        self.weights_inconsistent = ""               # set by Rollout's weight updates (weight_control.py)

    def _decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def _prompt_ids(self, prompts: Any, input_ids: Any) -> list[list[int]]:
        if (prompts is None) == (input_ids is None):
            raise ValueError("give exactly one of prompts (text) or input_ids (token ids)")
        if prompts is not None:
            if isinstance(prompts, str):
                prompts = [prompts]
            if not isinstance(prompts, (list, tuple)) or not all(isinstance(p, str) for p in prompts):
                raise ValueError("prompts must be a string or a list of strings")
            for i, p in enumerate(prompts):
                # NOTE: before any tokenizing: a text that cannot fit is refused without encoding it
                self.tokenizer.check_length(len(p), f"prompts[{i}]", self.context_length)
            batch = [self.tokenizer.encode(p) for p in prompts]
            name = "prompts"
        else:
            if isinstance(input_ids, (list, tuple)) and input_ids and _all_ints(input_ids):
                input_ids = [input_ids]
            if not isinstance(input_ids, (list, tuple)) or not all(isinstance(p, (list, tuple)) for p in input_ids):
                raise ValueError("input_ids must be a list of token ids or a list of such lists")
            batch = [list(p) for p in input_ids]
            name = "input_ids"
        if not batch:
            raise ValueError(f"{name} must not be empty")
        vocab = self.info.vocab_size
        for i, ids in enumerate(batch):
            if not ids:
                raise ValueError(f"{name}[{i}] is empty: a prompt needs at least one token")
            # NOTE: the loop (~0.2 us a token) only when the C-level checks find something wrong
            if not (set(map(type, ids)) <= _INT and 0 <= min(ids) and max(ids) < vocab):
                for t in ids:
                    if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                        raise ValueError(f"input_ids[{i}] holds {t!r}; token ids must be integers in [0, {vocab})")
            if len(ids) >= self.context_length:
                raise ValueError(f"{name}[{i}] has {len(ids)} tokens; the context limit is "
                                 f"{self.context_length} (context_length), prompt must be shorter")
        return batch

    def build(self, args: GenerateArgs) -> Groups:
        """Every field of args checked (each per-prompt field: one value for every prompt or a list with
        one per prompt); per prompt, its group of (ReqSpec, RequestState), one per sample."""
        arrival = time.time()   # NOTE: wall clock: the engine process measures time to first token from it
        self._check_serving()
        batch = self._prompt_ids(args.prompts, args.input_ids)
        count = len(batch)
        params, explicit = self._sampling_params(args.sampling_params, count)
        fields = {name: args.per_prompt(name, count) for name in PER_PROMPT}
        for lp, top, route, salt in zip(*(fields[n] for n in PER_PROMPT[:4])):
            self._check_flags(lp, top, route, salt)
        groups: Groups = []
        seen: set[str] = set()
        for i, (ids, p, given) in enumerate(zip(batch, params, explicit)):
            lp, top, route, salt, lp_start, start, rid, dp_rank = (fields[n][i] for n in PER_PROMPT)
            lp_start = self._check_prompt(ids, p, given, lp=lp, lp_start=lp_start, start=start, rid=rid,
                                          dp_rank=dp_rank)
            base_rid = rid or uuid.uuid4().hex
            seed = p.sampling_seed if p.sampling_seed is not None else self._rng.getrandbits(63)
            children = self._children(base_rid, p.n, seen)
            groups.append(self._group(ids, p, base_rid, children, seed, args.stream, lp=lp, top=top, route=route, salt=salt,
                                      lp_start=lp_start, start=start, dp_rank=dp_rank, arrival=arrival))
        return groups

    def _check_serving(self) -> None:
        if self.released_memory:
            raise ValueError(f"the server's memory is released ({', '.join(self.released_memory)}): call "
                             f"resume_memory_occupation first")
        if self.weights_inconsistent:
            raise WeightsInconsistentError(f"the weights are half-updated ({self.weights_inconsistent}); no request "
                                           f"runs until a weight update rewrites them")

    @staticmethod
    def _sampling_params(sampling_params: ParamsArg, count: int) -> tuple[list[SamplingParams], list[bool]]:
        """Each prompt's SamplingParams, and whether its max_new_tokens was given."""
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != count:
                raise ValueError(f"sampling_params has {len(sampling_params)} entries for {count} prompts")
            params = [SamplingParams.from_any(p) for p in sampling_params]
            raw = list(sampling_params)
        else:
            params = [SamplingParams.from_any(sampling_params)] * count
            raw = [sampling_params] * count
        # NOTE: as SGLang, only a max_new_tokens the caller gave (in a dict) is checked against the context
        return params, [isinstance(r, dict) and r.get("max_new_tokens") is not None for r in raw]

    def _check_flags(self, lp: Any, top: Any, route: Any, salt: Any) -> None:
        top_max = min(MAX_TOP_LOGPROBS, self.info.vocab_size)
        if not isinstance(lp, bool):
            raise ValueError(f"return_logprob must be a boolean, got {lp!r}")
        if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= top_max:
            raise ValueError(f"top_logprobs_num must be an integer in [0, {top_max}], got {top!r}")
        if not isinstance(route, bool):
            raise ValueError(f"return_routed_experts must be a boolean, got {route!r}")
        if route and not self.config.enable_return_routed_experts:
            raise ValueError("return_routed_experts=True needs an engine started with "
                             "enable_return_routed_experts=True")
        if salt is not None and (not isinstance(salt, str) or len(salt) > 1024):
            raise ValueError(f"cache_salt must be a string of at most 1024 characters, got {salt!r}"[:300])

    def _check_prompt(self, ids: list[int], p: SamplingParams, given: bool, *, lp: bool, lp_start: Any, start: Any,
                      rid: Any, dp_rank: Any) -> int:
        """The prompt's other fields checked; its prompt-logprob start (-1: none)."""
        if isinstance(lp_start, bool) or not isinstance(lp_start, int) or lp_start < -1:
            raise ValueError(f"logprob_start_len must be -1 or an integer >= 0, got {lp_start!r}")
        lp_start = lp_start if lp and 0 <= lp_start < len(ids) - 1 else -1
        if lp_start >= 0 and self.config.dp_size > 1:
            raise ValueError("logprob_start_len below the prompt length (prompt logprobs) is not supported "
                             "with dp_size > 1")
        if dp_rank is not None and (isinstance(dp_rank, bool) or not isinstance(dp_rank, int)
                                    or not 0 <= dp_rank < self.config.dp_size):
            raise ValueError(f"routed_dp_rank must be None or an integer in [0, {self.config.dp_size}) "
                             f"(dp_size), got {dp_rank!r}")
        p.check_vocab(self.info.vocab_size)
        if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start <= len(ids):
            raise ValueError(f"routed_experts_start_len must be an integer in [0, {len(ids)}] "
                             f"(the prompt length), got {start!r}")
        if given and len(ids) + p.max_new_tokens > self.context_length and not self.config.allow_auto_truncate:
            raise ValueError(context_overflow(self.context_length, len(ids), p.max_new_tokens))
        if len(ids) + p.max_new_tokens > self.kv_capacity:
            raise ValueError(f"max_new_tokens={p.max_new_tokens} with a {len(ids)}-token prompt needs more KV "
                             f"than the pool holds; prompt + max_new_tokens must be <= {self.kv_capacity} "
                             f"(max_total_tokens)")
        if rid is not None and (not isinstance(rid, str) or not rid):
            raise ValueError(f"rid must be a non-empty string, got {rid!r}")
        return lp_start

    @staticmethod
    def _children(base_rid: str, n: int, seen: set[str]) -> list[str]:
        """The prompt's request ids (one per sample), unique within the call."""
        # NOTE: sample k of an n > 1 request is `<rid>_<k>`: no id may name both a sample and a prompt
        children = [base_rid] if n == 1 else [f"{base_rid}_{k}" for k in range(n)]
        clash = next((c for c in [base_rid, *children] if c in seen), None)
        if clash is not None:
            raise ValueError(f"rid values must be unique within a call: {clash!r} names two requests (sample k "
                             f"of an n > 1 request is named <rid>_<k>)")
        seen.update(children + [base_rid])
        return children

    def _group(self, ids: list[int], p: SamplingParams, base_rid: str, children: list[str], seed: int, stream: bool,
               *, lp: bool, top: int, route: bool, salt: Optional[str], lp_start: int, start: int,
               dp_rank: Optional[int], arrival: float) -> list[tuple[ReqSpec, RequestState]]:
        engine_params = {f.name: getattr(p, f.name) for f in dataclasses.fields(p)}
        # NOTE: stop strings and patterns are the front end's (RequestState)
        engine_params["stop"], engine_params["stop_regex"] = (), ()
        prompt = np.asarray(ids, dtype=np.int32).tobytes()
        interval = p.stream_interval or self.config.stream_interval
        group = []
        for k, child in enumerate(children):
            st = RequestState(
                uid=next(self._uids), rid=child, group_rid=base_rid,
                prompt_ids=list(ids), params=p, stream=stream, stream_interval=interval, return_logprob=lp,
                top_logprobs_num=top, return_routed_experts=route, routed_experts_start_len=start,
                decode=self._decode, routing=self.routing, prompt_logprob_start=lp_start, arrival=arrival)
            spec = ReqSpec(uid=st.uid, rid=child, prompt_ids=prompt, params=engine_params,
                           seed=derive_seed(seed, k), return_logprob=lp, top_logprobs_num=top,
                           return_routed_experts=route, routed_experts_start_len=start,
                           emit_interval=st.emit_interval, max_total_len=self.context_length,
                           routed_dp_rank=dp_rank, cache_salt=salt, prompt_logprob_start=lp_start,
                           arrival_time=arrival)
            group.append((spec, st))
        return group


def context_overflow(context_length: int, prompt_tokens: int, max_new_tokens: int) -> str:
    """SGLang's words (tokenizer_manager), so clients that match on them keep working."""
    return (f"Requested token count exceeds the model's maximum context length of {context_length} tokens. "
            f"You requested a total of {prompt_tokens + max_new_tokens} tokens: {prompt_tokens} tokens from the "
            f"input messages and {max_new_tokens} tokens for the completion (max_new_tokens). Please reduce the "
            f"number of tokens in the input messages or the completion to fit within the limit "
            f"(or start the server with --allow-auto-truncate).")
