"""Rollout: the Python API. Validates requests, feeds the engine thread, hands back outputs."""
from __future__ import annotations

import asyncio
import logging
import queue
import random
import threading
import time
import uuid
from concurrent.futures import Future
from typing import Any, AsyncIterator, Callable, Iterator, Optional, Sequence, Union

from rollout.config import EngineConfig
from rollout.detokenizer import IncrementalDetokenizer
from rollout.engine_core import EngineCore
from rollout.output import RolloutOutput
from rollout.request import Req
from rollout.sampling_params import SamplingParams
from rollout.stream_chunk import StreamChunk

logger = logging.getLogger(__name__)
MAX_TOP_LOGPROBS = 64
ParamsArg = Union[None, dict, SamplingParams, Sequence[Union[dict, SamplingParams]]]


class EngineDeadError(RuntimeError):
    """The engine thread stopped on an error; every pending request receives this."""


def cache_namespace(salt: Optional[str]) -> int:
    """The prefix-cache namespace of a cache_salt: 0 (shared) for None, else a 64-bit hash shifted
    above every token id, so keys of different salts never compare equal."""
    if salt is None:
        return 0
    import hashlib  # noqa: PLC0415

    digest = hashlib.blake2b(salt.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return (int.from_bytes(digest, "little") | 1) << 32


def _derive_seed(seed: int, index: int) -> int:
    if index == 0:
        return seed
    x = (seed + index * 0x9E3779B97F4A7C15) & (2**64 - 1)
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return (x ^ (x >> 31)) & (2**63 - 1)


class AsyncGeneration:
    """`await` it for the list of outputs, or `async for` over it for chunks (stream) / outputs."""

    def __init__(self, start: Callable[[Callable[[Any], None]], list[str]], stream: bool):
        self._start = start
        self._stream = stream

    def __await__(self):
        return self._collect().__await__()

    async def _collect(self) -> list[RolloutOutput]:
        finals: dict[str, RolloutOutput] = {}
        order: list[str] = []
        async for item in self._iterate(final_only=True, order_out=order):
            finals[item.rid] = item
        return [finals[rid] for rid in order]

    def __aiter__(self) -> AsyncIterator[Union[StreamChunk, RolloutOutput]]:
        return self._iterate(final_only=not self._stream, order_out=[])

    async def _iterate(self, final_only: bool, order_out: list[str]):
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        rids = self._start(lambda item: loop.call_soon_threadsafe(q.put_nowait, item))
        order_out.extend(rids)
        pending = set(rids)
        while pending:
            item = await q.get()
            if isinstance(item, BaseException):
                raise item
            done = isinstance(item, RolloutOutput) or item.finished
            if done:
                pending.discard(item.rid)
            if isinstance(item, StreamChunk) and final_only:
                if item.finished:
                    yield item.output
                continue
            yield item


class Rollout:
    """Generation engine for MoE models; `Rollout()` loads the embedded tiny model."""

    def __init__(self, model_path: Optional[str] = None, *, config: Optional[EngineConfig] = None, **kwargs: Any):
        if config is None:
            if model_path is not None:
                kwargs["model_path"] = model_path
            config = EngineConfig(**kwargs)
        elif model_path is not None or kwargs:
            raise ValueError("pass either config or model_path/keyword settings, not both")
        self.config = config
        config.check_devices()
        self._lock = threading.Lock()
        self._inflight: dict[str, Callable[[Any], None]] = {}
        self._groups: dict[str, list[str]] = {}
        self._cmds: "queue.Queue[Callable[[], None]]" = queue.Queue()
        self._stopping = False
        self._error: Optional[BaseException] = None
        self.steps_done = 0   # engine steps finished (read by /health_generate from other threads)
        self._core: Any = None
        ready: Future = Future()
        self._thread = threading.Thread(target=self._run, args=(ready,), name="rollout-engine", daemon=True)
        self._thread.start()
        ready.result()  # NOTE: a failed start raises its error here (a ValueError names the field)
        self.info = self._core.info
        self.tokenizer = self._core.tokenizer
        self._rng = random.Random(config.seed)

    # ---- engine thread -------------------------------------------------------------------------
    def _run(self, ready: Future) -> None:
        """The engine thread: builds the engine, then steps it until shutdown.

        NOTE: the engine is built here, not in the caller's thread. libgomp (torch's OpenMP on
        Linux) throttles its spin-waits in every thread pool once more OpenMP threads exist than
        CPUs; a model loaded in the caller's thread leaves an OpenMP pool there for good, and a
        forward stepped in this thread then ran ~3x slower on a 2-core machine.
        """
        try:
            if self.config.dp_size > 1:
                from rollout.dp_coordinator import DPCoordinator  # noqa: PLC0415 (imports this module)

                self._core = DPCoordinator(self.config)
            else:
                self._core = EngineCore(self.config)
        except BaseException as exc:  # noqa: BLE001 (raised in the caller by ready.result())
            ready.set_exception(exc)
            return
        ready.set_result(None)
        self._loop()

    def _loop(self) -> None:
        core = self._core
        try:
            while not self._stopping:
                if not core.has_work():
                    try:
                        self._cmds.get(timeout=0.05)()
                    except queue.Empty:
                        continue
                while True:
                    try:
                        self._cmds.get_nowait()()
                    except queue.Empty:
                        break
                if not self._stopping and core.has_work():
                    core.step()
                    self.steps_done += 1
        except BaseException as exc:  # noqa: BLE001 (report to every waiter, then stop)
            logger.exception("engine thread failed")
            self._error = exc
            self._fail_all(exc)

    def _fail_all(self, exc: BaseException) -> None:
        err = EngineDeadError(f"engine stopped: {exc!r}")
        with self._lock:
            sinks = list(self._inflight.values())
            self._inflight.clear()
        for sink in sinks:
            sink(err)
        while True:
            try:
                self._cmds.get_nowait()
            except queue.Empty:
                break

    def _call(self, fn: Callable[[EngineCore], Any]) -> Any:
        """Runs fn(core) on the engine thread between steps; returns its result."""
        self._check_alive()
        fut: Future = Future()

        def cmd() -> None:
            try:
                fut.set_result(fn(self._core))
            except BaseException as exc:  # noqa: BLE001
                fut.set_exception(exc)

        self._cmds.put(cmd)
        while True:
            try:
                return fut.result(timeout=0.5)
            except TimeoutError:
                self._check_alive()

    def _check_alive(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"engine stopped: {self._error!r}")
        if self._stopping or not self._thread.is_alive():
            raise EngineDeadError("engine is shut down")

    # ---- request building ----------------------------------------------------------------------
    def _prompt_ids(self, prompts: Any, input_ids: Any) -> list[list[int]]:
        if (prompts is None) == (input_ids is None):
            raise ValueError("give exactly one of prompts (text) or input_ids (token ids)")
        if prompts is not None:
            if isinstance(prompts, str):
                prompts = [prompts]
            if not isinstance(prompts, (list, tuple)) or not all(isinstance(p, str) for p in prompts):
                raise ValueError("prompts must be a string or a list of strings")
            batch = [self.tokenizer.encode(p) for p in prompts]
            name = "prompts"
        else:
            if isinstance(input_ids, (list, tuple)) and input_ids and all(isinstance(t, int) for t in input_ids):
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
            for t in ids:
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                    raise ValueError(f"input_ids[{i}] holds {t!r}; token ids must be integers in [0, {vocab})")
            if len(ids) >= self._core.context_length:
                raise ValueError(f"{name}[{i}] has {len(ids)} tokens; the context limit is "
                                 f"{self._core.context_length} (context_length), prompt must be shorter")
        return batch

    @staticmethod
    def _per_prompt(name: str, value: Any, count: int, scalar_types: tuple) -> list:
        if isinstance(value, (list, tuple)) and not isinstance(value, scalar_types):
            if len(value) != count:
                raise ValueError(f"{name} has {len(value)} entries for {count} prompts")
            return list(value)
        return [value] * count

    def _build(self, prompts: Any, input_ids: Any, sampling_params: ParamsArg, return_logprob: Any,
               top_logprobs_num: Any, return_routed_experts: Any, routed_experts_start_len: Any, rid: Any,
               stream: bool, routed_dp_rank: Any = None, cache_salt: Any = None,
               logprob_start_len: Any = -1) -> list[Req]:
        """return_logprob, top_logprobs_num, return_routed_experts, routed_experts_start_len, rid,
        routed_dp_rank, cache_salt and logprob_start_len: one value for every prompt or a list with
        one per prompt. logprob_start_len >= 0 (with return_logprob): the output's input_logprobs hold
        the raw logprobs of prompt tokens logprob_start_len+1 .. len-1."""
        if self.released_memory:
            raise ValueError(f"the server's memory is released ({', '.join(self.released_memory)}): call "
                             f"resume_memory_occupation first")
        batch = self._prompt_ids(prompts, input_ids)
        n_prompts = len(batch)
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != n_prompts:
                raise ValueError(f"sampling_params has {len(sampling_params)} entries for {n_prompts} prompts")
            params = [SamplingParams.from_any(p) for p in sampling_params]
        else:
            params = [SamplingParams.from_any(sampling_params)] * n_prompts
        want_lp = self._per_prompt("return_logprob", return_logprob, n_prompts, ())
        tops = self._per_prompt("top_logprobs_num", top_logprobs_num, n_prompts, ())
        want_routes = self._per_prompt("return_routed_experts", return_routed_experts, n_prompts, ())
        salts = self._per_prompt("cache_salt", cache_salt, n_prompts, (str,))
        lp_starts = self._per_prompt("logprob_start_len", logprob_start_len, n_prompts, ())
        top_max = min(MAX_TOP_LOGPROBS, self.info.vocab_size)
        for lp, top, route, salt in zip(want_lp, tops, want_routes, salts):
            if not isinstance(lp, bool):
                raise ValueError(f"return_logprob must be a boolean, got {lp!r}")
            if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= top_max:
                raise ValueError(f"top_logprobs_num must be an integer in [0, {top_max}], got {top!r}")
            if not isinstance(route, bool):
                raise ValueError(f"return_routed_experts must be a boolean, got {route!r}")
            if route and not self._core.capture_enabled:
                raise ValueError("return_routed_experts=True needs an engine started with "
                                 "enable_return_routed_experts=True")
            if salt is not None and (not isinstance(salt, str) or len(salt) > 1024):
                raise ValueError(f"cache_salt must be a string of at most 1024 characters, got {salt!r}"[:300])
        starts = self._per_prompt("routed_experts_start_len", routed_experts_start_len, n_prompts, ())
        rids = self._per_prompt("rid", rid, n_prompts, (str,))
        capacity = self._core.kv_capacity
        dp_ranks = self._per_prompt("routed_dp_rank", routed_dp_rank, n_prompts, ())
        reqs: list[Req] = []
        for i, (ids, p, start, r, dp_rank, lp, top, route, salt, lp_start) in enumerate(
                zip(batch, params, starts, rids, dp_ranks, want_lp, tops, want_routes, salts, lp_starts)):
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
            if len(ids) + p.max_new_tokens > capacity:
                raise ValueError(f"max_new_tokens={p.max_new_tokens} with a {len(ids)}-token prompt needs more KV "
                                 f"than the pool holds; prompt + max_new_tokens must be <= {capacity} (max_total_tokens)")
            if r is not None and (not isinstance(r, str) or not r):
                raise ValueError(f"rid must be a non-empty string, got {r!r}")
            base_rid = r or uuid.uuid4().hex
            seed = p.sampling_seed if p.sampling_seed is not None else self._rng.getrandbits(63)
            for k in range(p.n):
                child = base_rid if p.n == 1 else f"{base_rid}_{k}"
                detok = None
                if stream or p.stop or p.stop_regex:
                    detok = IncrementalDetokenizer(
                        lambda t, s=p.skip_special_tokens: self.tokenizer.decode(t, skip_special_tokens=s))
                reqs.append(Req(
                    rid=child, prompt_ids=list(ids), params=p, seed=_derive_seed(seed, k),
                    return_logprob=lp, top_logprobs_num=top, return_routed_experts=route,
                    routed_experts_start_len=start, stream=stream, max_total_len=self._core.context_length,
                    detokenizer=detok, routed_dp_rank=dp_rank, cache_ns=cache_namespace(salt),
                    prompt_logprob_start=lp_start))
        seen = [r.rid for r in reqs]
        if len(set(seen)) != len(seen):
            raise ValueError("rid values must be unique within a call")
        return reqs

    def _submit(self, reqs: list[Req], sink: Callable[[Any], None], group_rid: Optional[str] = None) -> list[str]:
        self._check_alive()
        with self._lock:
            clash = [r.rid for r in reqs if r.rid in self._inflight]
            if clash:
                raise ValueError(f"rid {clash[0]!r} is already in flight; rids must be unique")
            for req in reqs:
                self._inflight[req.rid] = sink
                req.sink = self._wrap_sink(req.rid, sink)
            for req in reqs:
                base = req.rid.rsplit("_", 1)[0] if req.params.n > 1 else None
                if base is not None:
                    self._groups.setdefault(base, []).append(req.rid)

        def add() -> None:
            for req in reqs:
                self._core.add_request(req)

        self._cmds.put(add)
        return [r.rid for r in reqs]

    def _wrap_sink(self, rid: str, sink: Callable[[Any], None]) -> Callable[[Any], None]:
        def deliver(item: Any) -> None:
            if isinstance(item, RolloutOutput) or (isinstance(item, StreamChunk) and item.finished):
                base = rid.rsplit("_", 1)[0]
                with self._lock:
                    self._inflight.pop(rid, None)
                    members = self._groups.get(base)
                    if members is not None and rid in members:
                        members.remove(rid)
                        if not members:
                            del self._groups[base]
            sink(item)
        return deliver

    # ---- public API ----------------------------------------------------------------------------
    def generate(self, prompts: Any = None, sampling_params: ParamsArg = None, *, input_ids: Any = None,
                 return_logprob: bool = False, top_logprobs_num: int = 0, return_routed_experts: bool = False,
                 routed_experts_start_len: Any = 0, rid: Any = None, stream: bool = False,
                 routed_dp_rank: Any = None, cache_salt: Any = None,
                 logprob_start_len: Any = -1) -> Union[list[RolloutOutput], Iterator[StreamChunk]]:
        """Outputs in prompt order (each prompt's n samples together); stream=True yields chunks.

        routed_dp_rank (dp_size > 1): pin the requests (or each prompt, given a list) to one DP rank;
        None lets the engine pick the least loaded rank. cache_salt: requests share prefix-cache
        entries (KV and routing rows) only with requests of the same salt (None: the shared space)."""
        reqs = self._build(prompts, input_ids, sampling_params, return_logprob, top_logprobs_num,
                           return_routed_experts, routed_experts_start_len, rid, stream, routed_dp_rank, cache_salt,
                           logprob_start_len)
        q: "queue.Queue[Any]" = queue.Queue()
        rids = self._submit(reqs, q.put)
        if stream:
            return self._iter_chunks(q, set(rids))
        finals: dict[str, RolloutOutput] = {}
        while len(finals) < len(rids):
            item = self._get(q)
            finals[item.rid] = item
        return [finals[r] for r in rids]

    def _get(self, q: "queue.Queue[Any]") -> Any:
        while True:
            try:
                item = q.get(timeout=0.5)
            except queue.Empty:
                self._check_alive()
                continue
            if isinstance(item, BaseException):
                raise item
            return item

    def _iter_chunks(self, q: "queue.Queue[Any]", pending: set[str]) -> Iterator[StreamChunk]:
        while pending:
            chunk = self._get(q)
            if chunk.finished:
                pending.discard(chunk.rid)
            yield chunk

    def async_generate(self, prompts: Any = None, sampling_params: ParamsArg = None, *, input_ids: Any = None,
                       return_logprob: bool = False, top_logprobs_num: int = 0, return_routed_experts: bool = False,
                       routed_experts_start_len: Any = 0, rid: Any = None, stream: bool = False,
                       routed_dp_rank: Any = None, cache_salt: Any = None,
                       logprob_start_len: Any = -1) -> AsyncGeneration:
        """`await engine.async_generate(...)` -> outputs; `async for c in engine.async_generate(..., stream=True)`."""
        reqs = self._build(prompts, input_ids, sampling_params, return_logprob, top_logprobs_num,
                           return_routed_experts, routed_experts_start_len, rid, stream, routed_dp_rank, cache_salt,
                           logprob_start_len)
        return AsyncGeneration(lambda sink: self._submit(reqs, sink), stream)

    def abort(self, rid: str) -> bool:
        """Aborts a request (or every sample of an n>1 request) at any stage; its output says abort."""
        with self._lock:
            targets = list(self._groups.get(rid, [])) or [rid]
        return any(self._call(lambda core: [core.abort(t) for t in targets]))

    def abort_all(self) -> int:
        return self._call(lambda core: core.abort_all())

    def flush_cache(self) -> bool:
        return self._call(lambda core: core.flush_cache())

    def check_integrity(self) -> None:
        self._call(lambda core: core.check_integrity())

    def stats(self) -> dict[str, Any]:
        return self._call(lambda core: core.stats_report())

    def shutdown(self) -> None:
        if self._thread.is_alive() and not self._stopping and self._error is None:
            try:
                self._call(lambda core: core.abort_all())
            except EngineDeadError:
                pass
        self._stopping = True
        self._thread.join(timeout=30)
        self._core.close()

    def __enter__(self) -> "Rollout":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # ---- server support ----
    @property
    def model(self) -> Any:
        """The model module; read its names/shapes/dtypes freely, change weights only via swap_weights."""
        return self._core.model

    @property
    def weight_version(self) -> str:
        return self._core.weight_version

    @property
    def paused_mode(self) -> Optional[str]:
        return self._core.paused_mode

    def submit(self, sink: Callable[[Any], None], prompts: Any = None, sampling_params: ParamsArg = None, *,
               input_ids: Any = None, return_logprob: bool = False, top_logprobs_num: int = 0,
               return_routed_experts: bool = False, routed_experts_start_len: Any = 0, rid: Any = None,
               stream: bool = False, routed_dp_rank: Any = None, cache_salt: Any = None,
               logprob_start_len: Any = -1) -> list[str]:
        """Validates and queues like generate(); sink(item) is then called on the engine thread with
        each StreamChunk (stream) or RolloutOutput, or an exception. Returns the request ids in
        output order (prompt-major)."""
        reqs = self._build(prompts, input_ids, sampling_params, return_logprob, top_logprobs_num,
                           return_routed_experts, routed_experts_start_len, rid, stream, routed_dp_rank, cache_salt,
                           logprob_start_len)
        return self._submit(reqs, sink)

    def abort_nowait(self, rids: Sequence[str]) -> None:
        """Queues aborts without waiting (safe from an event loop); unknown or finished ids are ignored."""
        if self._error is None and not self._stopping:
            rids = list(rids)
            self._cmds.put(lambda: [self._core.abort(r) for r in rids])

    def pause_generation(self, mode: str = "abort") -> int:
        """See EngineCore.pause; returns how many requests were aborted/retracted/held."""
        return self._call(lambda core: core.pause(mode))

    def continue_generation(self) -> bool:
        return self._call(lambda core: core.resume())

    def set_weight_version(self, version: str, *, abort_all_requests: bool = False) -> int:
        """Relabels the weights (outputs finished from now on carry it); returns the requests aborted."""
        def relabel(core: EngineCore) -> int:
            aborted = core.abort_all() if abort_all_requests else 0
            core.set_weight_version(version)
            return aborted
        return self._call(relabel)

    @property
    def released_memory(self) -> tuple[str, ...]:
        """Memory tags released by release_memory_occupation (no request runs while any is)."""
        return self._core.released_memory if self.config.dp_size == 1 else ()

    def release_memory_occupation(self, tags: Any = None) -> list[str]:
        """Frees the KV pool ("kv_cache") and/or the weights' storage ("weights"; kept in a temporary
        file) for a colocated trainer; tags None: both. Returns the tags released now."""
        from rollout.memory_saver import parse_tags  # noqa: PLC0415

        if self.config.dp_size > 1:
            raise ValueError("release_memory_occupation is not supported with dp_size > 1")
        parsed = parse_tags(tags)
        return self._call(lambda core: core.release_memory(parsed))

    def resume_memory_occupation(self, tags: Any = None) -> list[str]:
        from rollout.memory_saver import parse_tags  # noqa: PLC0415

        parsed = parse_tags(tags)
        return self._call(lambda core: core.resume_memory(parsed)) if self.config.dp_size == 1 else []

    def loads(self) -> list[dict]:
        return self._call(lambda core: core.load_report())

    def swap_weights(self, staged: dict, *, weight_version: Optional[str] = None,
                     abort_all_requests: bool = False, poll_s: float = 0.005) -> int:
        """Installs already validated and staged HF-named tensors, all at once, between steps.

        With abort_all_requests every request in flight is aborted first (partial outputs).
        Otherwise the swap waits for every request that arrived before it (running or queued) to
        finish on the current weights, as SGLang does; requests that arrive meanwhile queue and run
        on the new weights. Paused, the running requests are retracted instead. The prefix cache is flushed and weight_version set (when given). Blocks the
        calling thread; returns the tensors copied.
        """
        def begin(core: EngineCore) -> None:
            if abort_all_requests:
                core.abort_all()
            core.hold_admission()

        def ready(core: EngineCore) -> bool:
            # NOTE: a cheap check first, so the staged tensors go to try_swap_weights (to every DP
            # rank) only once the running requests are done (or paused, when they get retracted).
            return core.paused_mode is not None or not any(ld["update_waits"] for ld in core.load_report())

        self._call(begin)
        try:
            while True:
                if self._call(ready):
                    count = self._call(lambda core: core.try_swap_weights(staged, weight_version))
                    if count is not None:
                        return count
                time.sleep(poll_s)
        finally:
            if self._error is None and not self._stopping:
                self._call(lambda core: core.release_admission())

    @property
    def context_length(self) -> int:
        return self._core.context_length

    @property
    def kv_capacity(self) -> int:
        """KV slots in the pool: a request's prompt + max_new_tokens must fit in it."""
        return self._core.kv_capacity

    @property
    def num_in_flight(self) -> int:
        """Requests submitted and not yet answered."""
        return len(self._inflight)

    @property
    def is_alive(self) -> bool:
        return self._error is None and not self._stopping and self._thread.is_alive()
