"""Rollout: the Python API. Validates requests, sends them to the engine, hands back outputs.

The engine loop runs in a process of its own (one per DP rank) behind an EngineClient
(rollout/frontend/); this front end owns tokenization, detokenization and stop strings, and
keeps every request's state: one RequestState per sample, in a RequestTable that also finds
them by rid (an n > 1 request's rid and each sample's rid_k).
"""
from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch

from capture.capturer import GatherLayout
from rollout.config import EngineConfig
from rollout.frontend.async_generation import AsyncGeneration, AsyncInbox, LoopFeeders
from rollout.frontend.engine_client import EngineClient, EngineDeadError
from rollout.frontend.request_builder import Groups, ParamsArg, RequestBuilder
from rollout.frontend.request_state import RequestTable, RoutingShape
from rollout.generate_io import GenerateArgs, RolloutOutput, StreamChunk, Submission
from rollout.frontend.weight_control import WeightControl
from rollout.ipc.messages import ReqUpdate
from rollout.models.registry import architecture_of, model_class, quantize_skeleton, read_config, resolve_dtype
from rollout.tokenizer import Tokenizer

__all__ = ["AsyncGeneration", "EngineDeadError", "Rollout"]
logger = logging.getLogger(__name__)


class Rollout(WeightControl):
    """Generation engine for MoE models; `Rollout()` loads the embedded tiny model.

    client: "process" (default: the engine in its own process, one per DP rank) or "inproc" (the
    engine loop on a thread of this process, for tests and debugging; dp_size 1 only).
    """

    CLIENTS = ("process", "inproc")

    def __init__(self, model_path: Optional[str] = None, *, config: Optional[EngineConfig] = None,
                 client: str = "process", **kwargs: Any):
        if config is None:
            if model_path is not None:
                kwargs["model_path"] = model_path
            config = EngineConfig(**kwargs)
        elif model_path is not None or kwargs:
            raise ValueError("pass either config or model_path/keyword settings, not both")
        if client not in self.CLIENTS:
            raise ValueError(f"client must be one of {list(self.CLIENTS)}, got {client!r}")
        self.config = config
        config.check_devices()
        hf_cfg, gen = read_config(config.model_path)
        self._model_cls = model_class(architecture_of(hf_cfg))
        self.info = self._model_cls.spec_from_config(hf_cfg, gen).info
        self.tokenizer = Tokenizer(config.resolved_tokenizer_path)
        self._requests = RequestTable()
        self._feeders = LoopFeeders()
        self._dead_listeners: list[Callable[[str], None]] = []
        self._finish_listeners: list[Callable[[list[RolloutOutput]], None]] = []
        self._meta_model: Optional[torch.nn.Module] = None
        self._stopping = False
        self.paused_mode: Optional[str] = None
        self.weight_version = config.weight_version
        self._weights_lock = threading.Lock()
        if client == "inproc":
            from rollout.frontend.inproc_client import InprocClient  # noqa: PLC0415

            self._client: EngineClient = InprocClient(config, self._on_updates, self._on_dead)
        else:
            from rollout.frontend.process_client import DPClient, ProcessClient  # noqa: PLC0415

            cls = DPClient if config.dp_size > 1 else ProcessClient
            self._client = cls(config, self._on_updates, self._on_dead)
        info = self.info
        routing = RoutingShape(info.num_hidden_layers, info.top_k, info.num_experts, tuple(info.moe_layer_ids)) \
            if config.enable_return_routed_experts else None
        self._builder = RequestBuilder(config=config, info=info, tokenizer=self.tokenizer,
                                       context_length=self._client.context_length,
                                       kv_capacity=self._client.kv_capacity, routing=routing)

    # ---- what the engine sends -----------------------------------------------------------------
    def _on_updates(self, updates: list[ReqUpdate]) -> None:
        """Runs on the client's receiver thread (the engine thread, in-process)."""
        deliveries, stopped, finished = self._requests.apply(updates)
        if stopped:
            self._client.abort(stopped, "stop string matched")
        if finished:
            for fn in self._finish_listeners:
                try:
                    fn(finished)
                except Exception:  # noqa: BLE001 (an observer's bug must not stop the receiver)
                    logger.exception("finish listener failed")
        for sink, items in deliveries:
            for item in items:
                sink(item)

    def _on_dead(self, reason: str) -> None:
        states = self._requests.clear()
        if not self._stopping:
            logger.error("engine stopped: %s", reason)
        err = EngineDeadError(f"engine stopped: {reason}")
        for st in states:
            st.sink(err)
        for fn in list(self._dead_listeners):
            fn(reason)

    def add_dead_listener(self, fn: Callable[[str], None]) -> None:
        """fn(reason) is called once if the engine dies (rollout-serve exits non-zero on it)."""
        self._dead_listeners.append(fn)

    def add_finish_listener(self, fn: Callable[[list[RolloutOutput]], None]) -> None:
        """fn(outputs) is called with the outputs of the requests that finished in one engine message,
        before their callers receive them, on the client's receiver thread (keep it short)."""
        self._finish_listeners.append(fn)

    def _call(self, method: str, *args: Any) -> list[Any]:
        """An engine command (an EngineCore method: rollout/core/engine_proc.py, CALLS) on every rank."""
        return self._client.call(method, *args)

    def debug(self, fn: Callable[[Any], Any]) -> Any:
        """fn(core) on the engine thread between steps (client="inproc" only; tests and debugging)."""
        debug = getattr(self._client, "debug", None)
        if debug is None:
            raise ValueError('debug() needs Rollout(client="inproc")')
        return debug(fn)

    def _check_alive(self) -> None:
        if self._stopping:
            raise EngineDeadError("engine is shut down")
        reason = self._client.dead_reason
        if reason is not None:
            raise EngineDeadError(f"engine stopped: {reason}")

    # ---- submitting ----------------------------------------------------------------------------
    def _submit(self, groups: Groups, sink: Callable[[Any], None]) -> Submission:
        self._check_alive()
        states = [st for group in groups for _, st in group]
        self._requests.add(states, sink)
        try:
            self._client.add([[spec for spec, _ in group] for group in groups])
        except EngineDeadError:
            self._requests.discard(states)
            raise
        return Submission.of([[st.rid for _, st in group] for group in groups])

    # ---- public API ----------------------------------------------------------------------------
    def generate(self, prompts: Any = None, sampling_params: ParamsArg = None,
                 **options: Any) -> Union[list[RolloutOutput], Iterator[StreamChunk]]:
        """Outputs in prompt order (each prompt's n samples together); stream=True yields chunks.
        options: the other fields of GenerateArgs (rollout/generate_io.py), keyword only; prompts
        may instead be a whole GenerateArgs."""
        args = GenerateArgs.of(prompts, sampling_params, options)
        groups = self._builder.build(args)
        q: "queue.Queue[Any]" = queue.Queue()
        rids = self._submit(groups, q.put).rids
        if args.stream:
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

    def async_inbox(self) -> AsyncInbox:
        """An inbox on the running event loop; pass its `sink` to submit(). Items of one engine step
        reach the loop in one wake-up (LoopFeeder)."""
        return self._feeders.inbox()

    def async_generate(self, prompts: Any = None, sampling_params: ParamsArg = None,
                       **options: Any) -> AsyncGeneration:
        """`await engine.async_generate(...)` -> outputs; `async for c in engine.async_generate(..., stream=True)`."""
        args = GenerateArgs.of(prompts, sampling_params, options)
        groups = self._builder.build(args)
        return AsyncGeneration(lambda sink: self._submit(groups, sink), self.async_inbox, args.stream)

    def submit(self, sink: Callable[[Any], None], prompts: Any = None, sampling_params: ParamsArg = None,
               **options: Any) -> Submission:
        """Validates and queues like generate(); sink(item) is then called on the client's receiver
        thread with each StreamChunk (stream) or RolloutOutput, or an exception. Returns the
        request ids in output order (prompt-major) with each one's prompt index."""
        return self._submit(self._builder.build(GenerateArgs.of(prompts, sampling_params, options)), sink)

    def abort(self, rid: str) -> bool:
        """Aborts a request (or every sample of an n>1 request) at any stage; its output says abort.
        False when no such request is in flight."""
        self._check_alive()
        uids = self._requests.uids_of([rid])
        self._client.abort(uids)
        return bool(uids)

    def abort_nowait(self, rids: Sequence[str]) -> None:
        """Queues aborts without waiting (safe from an event loop); unknown or finished ids are ignored."""
        if self._client.dead_reason is None:
            self._client.abort(self._requests.uids_of(rids))

    def abort_in_flight(self, message: str, done: Sequence[int] = ()) -> list[int]:
        """Aborts every request in flight without waiting (safe from an event loop), but those in `done`
        (the ids an earlier call returned); their outputs say abort with `message` (partial outputs and
        routing as any abort). Returns the ids aborted now."""
        skip = set(done)
        uids = [u for u in self._requests.uids() if u not in skip]
        if uids and self._client.dead_reason is None:
            self._client.abort(uids, message)
        return uids

    def abort_all(self) -> int:
        return sum(self._call("abort_all"))

    def flush_cache(self) -> bool:
        return all(self._call("flush_cache"))

    def check_integrity(self) -> None:
        self._call("check_integrity")

    def stats(self) -> dict[str, Any]:
        per_rank = self._call("stats_report")
        if len(per_rank) == 1:
            return per_rank[0]
        merged: dict[str, Any] = {}
        for stats in per_rank:
            for key, value in stats.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    merged[key] = merged.get(key, 0) + value
        merged["dp_ranks"] = per_rank
        return merged

    def recent_layouts(self) -> list[list[GatherLayout]]:
        """Per rank: the GatherLayouts of its latest forwards, oldest first (tests and debugging)."""
        return [[GatherLayout(runner=r, token_counts=tuple(c), padded_extent=e) for r, c, e in rank]
                for rank in self._call("recent_layouts")]

    def runner_report(self) -> list[dict]:
        """Per rank: what the static-shape runners captured (tests and debugging)."""
        return self._call("runner_report")

    def engine_pids(self) -> list[int]:
        """The engine processes (one per DP rank); empty for client="inproc"."""
        return self._client.pids()

    def shutdown(self) -> None:
        if self._stopping:
            return
        if self._client.dead_reason is None:
            try:
                self._call("abort_all")
            except EngineDeadError:
                pass
        self._stopping = True
        self._client.close()

    def __enter__(self) -> "Rollout":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # ---- server support ------------------------------------------------------------------------
    @property
    def model(self) -> torch.nn.Module:
        """The model's structure on the meta device (names, shapes, dtypes); weights live in the engine."""
        if self._meta_model is None:
            hf_cfg, gen = read_config(self.config.model_path)
            with torch.device("meta"):
                model = self._model_cls(self._model_cls.spec_from_config(hf_cfg, gen)).to(
                    resolve_dtype(self.config.dtype, hf_cfg))
                quantize_skeleton(model, self.config.model_path, hf_cfg, self.config.quantization)
            self._meta_model = model
        return self._meta_model

    def pause_generation(self, mode: str = "abort") -> int:
        """See EngineCore.pause; returns how many requests were aborted/retracted/held."""
        count = sum(self._call("pause", mode))
        self.paused_mode = mode
        return count

    def continue_generation(self) -> bool:
        was = any(self._call("resume"))
        self.paused_mode = None
        return was

    def set_weight_version(self, version: str, *, abort_all_requests: bool = False) -> int:
        """Relabels the weights (outputs finished from now on carry it); returns the requests aborted."""
        aborted = sum(self._call("set_weight_version", version, abort_all_requests))
        self.weight_version = version
        return aborted

    @property
    def released_memory(self) -> tuple[str, ...]:
        """Memory tags released by release_memory_occupation (no request runs while any is)."""
        return self._builder.released_memory

    def release_memory_occupation(self, tags: Any = None) -> list[str]:
        """Frees the KV pool ("kv_cache") and/or the weights' storage ("weights"; kept in a temporary
        file) for a colocated trainer; tags None: both. Returns the tags released now."""
        if self.config.dp_size > 1:
            raise ValueError("release_memory_occupation is not supported with dp_size > 1")
        return self._memory_call("release_memory", tags)

    def resume_memory_occupation(self, tags: Any = None) -> list[str]:
        return self._memory_call("resume_memory", tags) if self.config.dp_size == 1 else []

    def _memory_call(self, command: str, tags: Any) -> list[str]:
        """release_memory / resume_memory on the (one) rank; the tags it acted on."""
        from rollout.ipc.control_values import parse_tags  # noqa: PLC0415

        done = self._call(command, list(parse_tags(tags)))[0]
        self._builder.released_memory = tuple(self._call("released_memory")[0])
        return done

    def loads(self) -> list[dict]:
        out = []
        for rank, rows in enumerate(self._call("load_report")):
            out += [dict(row, dp_rank=rank) for row in rows]
        return out

    def read_weight(self, hf_name: str, truncate_size: int = 100) -> Optional[list]:
        """The weight stored under checkpoint name hf_name (fp32 lists, the first truncate_size entries
        along dim 0), from the first DP rank that holds it; None when no rank does."""
        return next((w for w in self._call("read_weight", hf_name, truncate_size) if w is not None), None)

    @property
    def context_length(self) -> int:
        return self._client.context_length

    @property
    def kv_capacity(self) -> int:
        """KV slots in the pool: a request's prompt + max_new_tokens must fit in it."""
        return self._client.kv_capacity

    @property
    def is_alive(self) -> bool:
        return self._client.dead_reason is None and not self._stopping

    @property
    def steps_done(self) -> int:
        """Engine steps finished (reported after every step)."""
        return self._client.steps_done

    @property
    def num_in_flight(self) -> int:
        """Requests submitted and not yet answered."""
        return len(self._requests)
