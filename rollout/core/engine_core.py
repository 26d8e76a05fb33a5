"""EngineCore: model, KV memory, prefix cache, scheduler, sampler and capture, stepped by one loop.

A step schedules a batch, runs its forward and hands the results to the OutputProcessor
(rollout/core/output_processor.py), which appends one ReqUpdate (new token ids, logprobs, routing
rows as raw bytes) per request it touched to its outbox; the engine loop sends them to the front
end, which detokenizes, checks stop strings and encodes (rollout/frontend/). Between steps the
loop runs the control calls (rollout/core/control_calls.py).
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from typing import Any, Callable, Optional

import torch

from capture.buffer_sizing import ForwardShapeLimits, capture_buffer_rows
from capture.capturer import RoutedExpertsCapturer
from rollout.batch.host_device import HostReads
from rollout.batch.kv_pool import KVPool
from rollout.config import EngineConfig
from rollout.core.control_calls import ControlCalls
from rollout.core.cpu_threads import CpuThreads
from rollout.core.drafter import make_drafter
from rollout.core.forward_worker import ForwardJob, ForwardWorker
from rollout.core.kv_budget import KVBudget
from rollout.core.output_processor import OutputProcessor
from rollout.core.radix_cache import RadixCache
from rollout.core.request import Req, ReqStatus
from rollout.core.schedule_policy import SchedulePolicy
from rollout.core.scheduler import Scheduler
from rollout.exact import make_exact
from rollout.exec.model_runner import ModelRunner, RunnerPlan
from rollout.exec.runners.capture_profiler import GraphCaptureProfiler
from rollout.generate_io import FinishReason
from rollout.host_malloc import tune_glibc_malloc
from rollout.ipc.messages import ReqUpdate
from rollout.models.attention.backend import make_attention_backend
from rollout.models.moe.block import set_moe_backend
from rollout.models.moe.experts import FusedExperts
from rollout.models.registry import load_model, model_info
from rollout.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
ABORT_MESSAGE = "aborted by request"
CONTROL_BUDGET_S = 0.01  # answers to aborted waiting requests per step; the rest follow next steps


class EngineCore(ControlCalls):
    def __init__(self, cfg: EngineConfig, *, ep_group: Optional[Any] = None, cpu_threads: Optional[CpuThreads] = None):
        """One DP rank's engine. ep_group: this rank's EPGroup when dp_size > 1 (a DP worker builds
        it: rollout/core/engine_proc.py, one process per rank). cpu_threads: the process's torch
        threads, when the engine owns its process (EngineLoop sets them per forward)."""
        if cfg.dp_size > 1 and ep_group is None:
            raise ValueError(f"dp_size={cfg.dp_size}: EngineCore runs one DP rank and needs its ep_group; "
                             f"use Rollout for dp_size > 1")
        self.cfg = cfg
        self.ep_group = ep_group
        self.cpu_threads = cpu_threads
        self.dp_rank = ep_group.rank if ep_group is not None else 0
        self.device = torch.device(cfg.device)
        if self.device.type == "cpu":
            tune_glibc_malloc()  # NOTE: CPU forwards in a fresh process ran ~2x slower without it
        # the overlap schedule (rollout/core/forward_worker.py): the forward thread runs every
        # forward and every heavy torch call (the model's load and capture, control calls); this
        # thread schedules and processes outputs. NOTE: on CPU this thread then runs torch on one
        # thread: libgomp gives each thread that starts parallel regions a pool of its own, and
        # once more OpenMP threads exist than CPUs it stops spinning between regions; a forward
        # thread beside a second pool ran ~2x slower on 2 CPUs.
        self.worker: Optional[ForwardWorker] = None
        self.forward_threads = 0   # CPU, the overlap schedule: the forward thread's torch threads
        if cfg.enable_overlap_schedule:
            if self.device.type == "cpu":
                self.forward_threads = cpu_threads.quiet if cpu_threads is not None else torch.get_num_threads()
                torch.set_num_threads(1)
            self.worker = ForwardWorker(self._forward, self.device, threads=self.forward_threads)
        self._inflight: Optional[ForwardJob] = None   # the step whose forward runs, not processed yet
        self._last_sampled: dict[int, int] = {}        # the last forward's sampled token by request uid
        try:
            self.kv_budget = KVBudget.before_load(cfg, self.device)   # NOTE: measured before the weights load
            self.on_forward_thread(self._load_model)
            self.eos_ids = Tokenizer.eos_token_ids(cfg.model_path)
            self.context_length = cfg.context_length or self.info.max_position_embeddings
            self.on_forward_thread(self._build_memory)
            self.on_forward_thread(self._build_runner)
        except BaseException:
            if self.worker is not None:
                self.worker.close()   # NOTE: no thread outlives an engine that failed to start
            raise
        self.stats = {"num_forwards": 0, "num_prefill_forwards": 0, "num_decode_forwards": 0,
                      "prompt_tokens": 0, "generated_tokens": 0, "finished_requests": 0,
                      "aborted_requests": 0, "nonfinite_logits_aborts": 0}
        self.host_reads = HostReads()   # the step's one read of its device results (counted)
        self.outputs = OutputProcessor(scheduler=self.scheduler, capturer=self.capturer, host_reads=self.host_reads,
                                       stats=self.stats, eos_ids=self.eos_ids, vocab_size=self.info.vocab_size,
                                       num_experts=self.info.num_experts, weight_version=cfg.weight_version)
        self.scheduler.on_retract = self._save_routing   # NOTE: before the slots can be reused
        self._backlog: deque[tuple[Req, str]] = deque()   # aborted waiting requests (and messages) not answered yet
        self._budget_end: Optional[float] = None   # perf_counter deadline of this step's control work
        # the control calls' state (rollout/core/control_calls.py)
        self.paused_mode: Optional[str] = None     # None (running) | "abort" | "retract" | "in_place"
        self._admission_holds = 0                   # > 0 while weight updates wait for earlier requests
        self._weight_receiver: Any = None           # Optional[WeightReceiver], made by the first group call
        self._memory_saver: Any = None              # Optional[MemorySaver], made by the first release

    def _load_model(self) -> None:
        cfg, ep_group = self.cfg, self.ep_group
        self.model, _ = load_model(cfg.model_path, cfg.dtype, self.device,
                                   expert_shard=(ep_group.rank, ep_group.size) if ep_group is not None else None,
                                   quantization=cfg.quantization, mtp=cfg.speculative_algorithm == "NEXTN")
        set_moe_backend(self.model, cfg.resolved_moe_backend)
        if cfg.enable_deterministic_inference:
            make_exact(self.model)
        self.info = self.model.info
        experts = [m for m in self.model.modules() if isinstance(m, FusedExperts)]
        self._expert_report = {  # what this rank holds of the routed experts (expert parallel)
            "experts_held": [experts[0].expert_lo, experts[0].expert_hi] if experts else [],
            "expert_weight_bytes": sum(p.numel() * p.element_size() for m in experts for p in m.parameters()),
            "weight_bytes": sum(p.numel() * p.element_size() for p in self.model.parameters())}

    def _build_memory(self) -> None:
        """The KV pool, the prefix cache over it and the scheduler that hands both out."""
        cfg, info = self.cfg, self.info
        kv_dtype = next(self.model.parameters()).dtype
        # NOTE: NEXTN keeps every token's hidden state beside its KV, and its MTP layer's own KV;
        # a STANDALONE draft keeps a KV of its own with as many slots
        mtp = cfg.speculative_algorithm == "NEXTN"
        hidden_size = info.hidden_size if mtp else 0
        per_slot = KVPool.bytes_per_slot(num_layers=info.num_hidden_layers + mtp, num_kv_heads=info.num_kv_heads,
                                         head_dim=info.head_dim, dtype=kv_dtype, latent_dim=info.kv_latent_dim,
                                         hidden_size=hidden_size)
        if cfg.speculative_algorithm == "STANDALONE":
            draft = model_info(cfg.speculative_draft_model_path)
            per_slot += KVPool.bytes_per_slot(num_layers=draft.num_hidden_layers, num_kv_heads=draft.num_kv_heads,
                                              head_dim=draft.head_dim, dtype=kv_dtype, latent_dim=draft.kv_latent_dim)
        num_slots = cfg.max_total_tokens or max(2, self.kv_budget.bytes_after_load(self.model, per_slot) // per_slot)
        self.kv_pool = KVPool(num_slots=num_slots, num_layers=info.num_hidden_layers,
                              num_kv_heads=info.num_kv_heads, head_dim=info.head_dim,
                              dtype=kv_dtype, device=self.device, latent_dim=info.kv_latent_dim,
                              hidden_size=hidden_size)
        self.cache = RadixCache(self.kv_pool, enabled=cfg.enable_prefix_caching)
        self.prefill_token_budget = cfg.chunked_prefill_size or self.context_length
        self.scheduler = Scheduler(kv_pool=self.kv_pool, cache=self.cache,
                                   max_running_requests=cfg.max_running_requests,
                                   prefill_token_budget=self.prefill_token_budget,
                                   context_length=self.context_length,
                                   policy=SchedulePolicy(cfg.schedule_policy, seed=cfg.seed),
                                   drafter=make_drafter(cfg, target=self.model, device=self.device,
                                                        num_slots=num_slots, context_length=self.context_length,
                                                        hidden=self.kv_pool.hidden,
                                                        target_slots=lambda req: self.scheduler.kv_slots(req)))

    def _build_runner(self) -> None:
        """The routed-experts capturer (when enabled) and the model runner that fills it."""
        cfg, info = self.cfg, self.info
        # NOTE: one ForwardShapeLimits sizes the capture buffer and builds the runners (invariant 1).
        limits = self.forward_shape_limits
        self.capturer: Optional[RoutedExpertsCapturer] = None
        if cfg.enable_return_routed_experts:
            RunnerPlan(limits).check_capture_fits(capture_buffer_rows(limits), cfg.max_capture_buffer_rows)
            self.capturer = RoutedExpertsCapturer(
                limits=limits, num_slots=self.kv_pool.num_slots + 1,
                num_layers=info.num_hidden_layers, top_k=info.top_k,
                num_experts=info.num_experts, moe_layer_ids=info.moe_layer_ids,
                dp_rank=self.dp_rank, device=self.device)
        self.runner = ModelRunner(model=self.model, kv_pool=self.kv_pool, device=self.device, limits=limits,
                                  capture_buffer=self.capturer.buffer if self.capturer else None,
                                  seq_capacity=self.context_length, ep_group=self.ep_group,
                                  attention_backend=make_attention_backend(
                                      cfg.resolved_attention_backend, device=self.device, model=self.model,
                                      exact=cfg.enable_deterministic_inference),
                                  torch_compile_max_bs=cfg.torch_compile_max_bs if cfg.enable_torch_compile else None)
        if self.capturer is not None:
            self.runner.plan.check_capture_fits(self.capturer.buffer.rows)
        self.runner.capture(GraphCaptureProfiler(cfg.resolved_profile_graph_capture_dir))

    @property
    def forward_shape_limits(self) -> ForwardShapeLimits:
        return self.cfg.shape_limits(self.context_length)

    @property
    def kv_capacity(self) -> int:
        """KV slots of this rank (a request's prompt + max_new_tokens must fit them)."""
        return self.kv_pool.num_slots

    @property
    def weight_version(self) -> str:
        """The weights' label; every update carries it (kept by the OutputProcessor)."""
        return self.outputs.weight_version

    @weight_version.setter
    def weight_version(self, version: str) -> None:
        self.outputs.weight_version = version

    # ---- requests ------------------------------------------------------------------------------
    def add_request(self, req: Req) -> None:
        self.stats["prompt_tokens"] += len(req.prompt_ids)
        self.scheduler.add(req)

    def has_work(self) -> bool:
        return bool(self._backlog) or self._inflight is not None or self._has_schedulable_work()

    def _has_schedulable_work(self) -> bool:
        return self.scheduler.has_work() and self._scheduling_open()

    def _scheduling_open(self) -> bool:
        """Whether requests may be scheduled: never while paused, with memory released or with
        half-updated weights; while a weight update holds admission, only for the requests that
        arrived before it (an idle queue never spins)."""
        if self.paused_mode is not None or self.released_memory() or self.weights_inconsistent():
            return False
        return not self._admission_holds or self.scheduler.has_admissible()

    def released_memory(self) -> tuple[str, ...]:
        """The memory tags now released ("weights", "kv_cache"); nothing steps while any is."""
        return self._memory_saver.released if self._memory_saver is not None else ()

    def weights_inconsistent(self) -> str:
        """Why the weights are half-updated (a failed distributed update), or "" when they are not.
        Nothing is scheduled while they are."""
        r = self._weight_receiver
        return (r.inconsistent_reason or "a failed update") if r is not None and r.inconsistent else ""

    def abort(self, uid: int, message: str = ABORT_MESSAGE) -> bool:
        """Aborts one request by uid (an index lookup). A waiting request leaves the queue at once;
        its answer may follow a step later when this step's control work used its time budget."""
        self.drain()
        req = self.scheduler.find(uid)
        if req is None:
            return False
        self.stats["aborted_requests"] += 1
        if req.status is ReqStatus.RUNNING:
            self.outputs.finish(req, FinishReason("abort", message=message))
        else:
            self.scheduler.remove(req)
            self._answer_later(req, message)
        return True

    def abort_all(self, message: str = ABORT_MESSAGE) -> int:
        """Aborts every request in one pass: running ones answer now, waiting ones (no KV) leave
        the queue now and answer within this step's time budget or the next steps'."""
        self.drain(quiet=True)
        running = list(self.scheduler.running)
        for req in running:
            self.outputs.finish(req, FinishReason("abort", message=message))
        waiting = self.scheduler.remove_all_waiting()
        self._backlog.extend((req, message) for req in waiting)
        self._answer_backlog()
        self.stats["aborted_requests"] += len(running) + len(waiting)
        return len(running) + len(waiting)

    def _answer_later(self, req: Req, message: str) -> None:
        self._backlog.append((req, message))
        self._answer_backlog()

    def _answer_backlog(self) -> None:
        """Answers aborted waiting requests until this step's control budget is spent."""
        backlog = self._backlog
        if self._budget_end is None:
            self._budget_end = time.perf_counter() + CONTROL_BUDGET_S
        end = self._budget_end
        while backlog and time.perf_counter() < end:
            for _ in range(min(64, len(backlog))):
                req, message = backlog.popleft()
                self.outputs.finish(req, FinishReason("abort", message=message))

    def take_updates(self) -> list[ReqUpdate]:
        """The updates produced since the last call (the engine loop sends them after each step)."""
        return self.outputs.take()

    def flush_cache(self) -> bool:
        """Drops every cached prefix (and so its routing); refused while requests hold KV (waiting
        and retracted requests hold none)."""
        if self.scheduler.running:
            return False
        return self.cache.flush()

    def check_integrity(self) -> bool:
        """Asserts that every used KV slot has exactly one owner (AssertionError otherwise)."""
        self.drain()
        self.scheduler.check_integrity()
        return True

    # ---- stepping ------------------------------------------------------------------------------
    def step(self) -> None:
        """Schedule, forward, process the results."""
        self._budget_end = None   # NOTE: a new control budget for the answers before this forward
        if self._backlog:
            self._answer_backlog()
            self._budget_end = None
        batch = self.scheduler.schedule() if self._has_schedulable_work() else None
        if batch is None and self.ep_group is None:
            self.drain()
            return
        # NOTE: DP: every rank steps together and runs a forward (empty when it has nothing),
        # since the forward's collectives need every rank.
        job = ForwardJob(batch=batch, shapes=self.runner.rank_shapes(batch), plan=self.outputs.plan(batch),
                         threads=self.forward_threads)
        previous, self._inflight = self._inflight, job
        if self.worker is not None:
            self.worker.submit(job)
            if previous is not None:
                self._process(previous)   # NOTE: while this step's forward runs
        else:
            job.run(self._forward)
            self.drain()

    def on_forward_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) where forwards run: on the forward thread with the overlap schedule (after the
        running step's forward; call drain() first for the state between steps), else here."""
        return fn(*args) if self.worker is None else self.worker.call(fn, *args)

    def use_threads(self, n: int) -> None:
        """CPU: the torch threads of the next forwards (rollout/core/cpu_threads.py)."""
        if self.worker is not None:
            self.forward_threads = n
        elif torch.get_num_threads() != n:
            torch.set_num_threads(n)

    def _forward(self, job: ForwardJob) -> None:
        """The forward stage of a step (on the forward thread with the overlap schedule): the
        forward, its routing rows committed, its next tokens sampled and read to the host."""
        batch = job.batch
        if batch is not None and batch.pending:
            last = self._last_sampled
            batch = dataclasses.replace(batch, last_ids=tuple(
                last[r.uid] if p else (r.output_ids or r.prompt_ids)[-1] for r, p in zip(batch.reqs, batch.pending)))
        out = job.out = self.runner.forward(batch, job.shapes)
        if batch is None or out is None:
            return
        if self.capturer is not None and not batch.drafts:
            self.capturer.commit(out.layout, batch.out_cache_loc)
        plan = job.plan
        if plan is not None and plan.rows:
            job.drawn = self.outputs.draw(plan, out.logits, self._last_sampled)
            if self.worker is not None:   # NOTE: only a step scheduled before these are processed reads them
                self._last_sampled = dict(zip((r.uid for r in plan.reqs), job.drawn[0]))
        if self.capturer is not None:
            self.capturer.flush()   # NOTE: after the read above, which waited for the copy

    def _process(self, job: ForwardJob) -> None:
        job.wait()
        if job.batch is not None and job.out is not None:
            self.outputs.process(job.batch, job.out, job.plan, job.drawn)

    def drain(self, quiet: bool = False) -> None:
        """Processes the step whose forward is running (the overlap schedule), so that the engine's
        state is what a sequential loop leaves between steps: every control call and abort comes
        after it. quiet: a failed forward's error is dropped (everything is being aborted)."""
        job, self._inflight = self._inflight, None
        if job is None:
            return
        try:
            self._process(job)
        except Exception:  # noqa: BLE001
            if not quiet:
                raise
            logger.exception("the forward in flight failed; its step is dropped (every request is being aborted)")

    def _save_routing(self, req: Req) -> None:
        """A retraction's hook: the running forward's rows are committed before the request's are kept."""
        if self._inflight is not None:
            self._inflight.done.wait()
        self.outputs.save_routing(req)
