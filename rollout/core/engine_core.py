"""EngineCore: model, KV memory, prefix cache, scheduler, sampler and capture, stepped by one loop.

It never builds text or wire formats: each step appends one ReqUpdate (new token ids, logprobs,
routing rows as raw bytes) per request it touched to `outbox`; the engine loop sends them to the
front end, which detokenizes, checks stop strings and encodes (rollout/frontend/).
"""
from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any, Optional

import torch

from capture.buffer_sizing import ForwardShapeLimits, capture_buffer_rows
from capture.capturer import RoutedExpertsCapturer
from rollout.config import EngineConfig
from rollout.core.cpu_threads import CpuThreads
from rollout.core.engine_control import EngineControl
from rollout.host_malloc import tune_glibc_malloc
from rollout.core.host_reads import HostReads
from rollout.batch.host_staging import to_device
from rollout.batch.kv_pool import KVPool
from rollout.ipc.messages import ReqUpdate, floats, ints
from rollout.exec.model_runner import ModelRunner
from rollout.models.attention_backend import make_attention_backend
from rollout.exact import make_exact
from rollout.models.moe import FusedExperts, set_moe_backend
from rollout.models.registry import load_model
from rollout.core.radix_cache import RadixCache
from rollout.exec.runners.capture_profiler import GraphCaptureProfiler
from rollout.exec.runners.runner_plan import RunnerPlan
from rollout.core.request import Req, ReqState
from rollout.generate_io import FinishReason
from rollout.exec.sampler import sample
from rollout.core.scheduler import Scheduler
from rollout.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
DEFAULT_KV_CACHE_BYTES = 512 * 2**20
ABORT_MESSAGE = "aborted by request"
ABORT_BEFORE_PREFILL = "Abort before prefill"   # SGLang's message for a request that computed no KV
CONTROL_BUDGET_S = 0.01  # answers to aborted waiting requests per step; the rest follow next steps


class EngineCore(EngineControl):
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
        self.model, _ = load_model(cfg.model_path, cfg.dtype, self.device,
                                   expert_shard=(ep_group.rank, ep_group.size) if ep_group is not None else None)
        set_moe_backend(self.model, cfg.resolved_moe_backend)
        if cfg.enable_deterministic_inference:
            make_exact(self.model)
        self.info = self.model.info
        experts = [m for m in self.model.modules() if isinstance(m, FusedExperts)]
        self._expert_report = {  # what this rank holds of the routed experts (expert parallel)
            "experts_held": [experts[0].expert_lo, experts[0].expert_hi] if experts else [],
            "expert_weight_bytes": sum(p.numel() * p.element_size() for m in experts for p in m.parameters())}
        self.eos_ids = Tokenizer.eos_token_ids(cfg.model_path)
        self._eos_set = frozenset(self.eos_ids)
        self.context_length = cfg.context_length or self.info.max_position_embeddings
        self.weight_version = cfg.weight_version
        kv_dtype = next(self.model.parameters()).dtype
        per_slot = KVPool.bytes_per_slot(num_layers=self.info.num_hidden_layers, num_kv_heads=self.info.num_kv_heads,
                                         head_dim=self.info.head_dim, dtype=kv_dtype,
                                         latent_dim=self.info.kv_latent_dim)
        num_slots = cfg.max_total_tokens or max(2, (cfg.kv_cache_bytes or DEFAULT_KV_CACHE_BYTES) // per_slot)
        self.kv_pool = KVPool(num_slots=num_slots, num_layers=self.info.num_hidden_layers,
                              num_kv_heads=self.info.num_kv_heads, head_dim=self.info.head_dim,
                              dtype=kv_dtype, device=self.device, latent_dim=self.info.kv_latent_dim)
        self.cache = RadixCache(self.kv_pool, enabled=cfg.enable_prefix_caching)
        self.prefill_token_budget = cfg.chunked_prefill_size or self.context_length
        self.scheduler = Scheduler(kv_pool=self.kv_pool, cache=self.cache,
                                   max_running_requests=cfg.max_running_requests,
                                   prefill_token_budget=self.prefill_token_budget,
                                   context_length=self.context_length, on_retract=self._save_routing)
        # NOTE: one ForwardShapeLimits sizes the capture buffer and builds the runners (invariant 1).
        limits = self.forward_shape_limits
        self.capturer: Optional[RoutedExpertsCapturer] = None
        if cfg.enable_return_routed_experts:
            RunnerPlan(limits).check_capture_fits(capture_buffer_rows(limits), cfg.max_capture_buffer_rows)
            self.capturer = RoutedExpertsCapturer(
                limits=limits, num_slots=num_slots + 1,
                num_layers=self.info.num_hidden_layers, top_k=self.info.top_k,
                num_experts=self.info.num_experts, moe_layer_ids=self.info.moe_layer_ids,
                dp_rank=self.dp_rank, device=self.device)
        self.runner = ModelRunner(model=self.model, kv_pool=self.kv_pool, device=self.device, limits=limits,
                                  capture_buffer=self.capturer.buffer if self.capturer else None,
                                  seq_capacity=self.context_length, ep_group=ep_group,
                                  variant_axes=cfg.graph_variant_axes,
                                  attention_backend=make_attention_backend(
                                      cfg.resolved_attention_backend, device=self.device, model=self.model,
                                      exact=cfg.enable_deterministic_inference))
        if self.capturer is not None:
            self.runner.plan.check_capture_fits(self.capturer.buffer.rows)
        self.runner.capture(GraphCaptureProfiler(cfg.resolved_profile_graph_capture_dir))
        # NOTE: routing rows travel as int16 (logical ids and -1) unless the expert count needs int32
        self._routing_dtype = torch.int16 if self.info.num_experts < 2**15 else torch.int32
        self.outbox: list[ReqUpdate] = []
        self.host_reads = HostReads()   # the step's one read of its device results (counted)
        self._backlog: deque[tuple[Req, str]] = deque()   # aborted waiting requests (and messages) not answered yet
        self._budget_end: Optional[float] = None   # perf_counter deadline of this step's control work
        self.stats = {"num_forwards": 0, "num_prefill_forwards": 0, "num_decode_forwards": 0,
                      "prompt_tokens": 0, "generated_tokens": 0, "finished_requests": 0,
                      "aborted_requests": 0, "nonfinite_logits_aborts": 0}

    @property
    def forward_shape_limits(self) -> ForwardShapeLimits:
        return ForwardShapeLimits(dp_size=self.cfg.dp_size, max_running_requests=self.cfg.max_running_requests,
                                  chunked_prefill_tokens=self.prefill_token_budget,
                                  decode_graph_batch_sizes=self.cfg.decode_graph_batch_sizes,
                                  prefill_graph_token_sizes=self.cfg.prefill_graph_token_sizes)

    # ---- commands ------------------------------------------------------------------------------
    def add_request(self, req: Req) -> None:
        self.stats["prompt_tokens"] += len(req.prompt_ids)
        self.scheduler.add(req)

    def has_work(self) -> bool:
        return bool(self._backlog) or self._may_schedule()

    def _may_schedule(self) -> bool:
        return self.scheduler.has_work() and self._may_step()

    def abort(self, uid: int, message: str = ABORT_MESSAGE) -> bool:
        """Aborts one request by uid (an index lookup). A waiting request leaves the queue at once;
        its answer may follow a step later when this step's control work used its time budget."""
        req = self.scheduler.find(uid)
        if req is None:
            return False
        self.stats["aborted_requests"] += 1
        if req.state is ReqState.RUNNING:
            self._finish(req, FinishReason("abort", message=message))
        else:
            self.scheduler.remove(req)
            self._answer_later(req, message)
        return True

    def abort_all(self, message: str = ABORT_MESSAGE) -> int:
        """Aborts every request in one pass: running ones answer now, waiting ones (no KV) leave
        the queue now and answer within this step's time budget or the next steps'."""
        running = list(self.scheduler.running)
        for req in running:
            self._finish(req, FinishReason("abort", message=message))
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
                self._finish(req, FinishReason("abort", message=message))

    def take_updates(self) -> list[ReqUpdate]:
        """The updates produced since the last call (the engine loop sends them after each step)."""
        out, self.outbox = self.outbox, []
        return out

    def flush_cache(self) -> bool:
        """Drops every cached prefix (and so its routing); refused while requests hold KV (waiting
        and retracted requests hold none)."""
        if self.scheduler.running:
            return False
        return self.cache.flush()

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

    @property
    def kv_capacity(self) -> int:
        """KV slots of this rank (a request's prompt + max_new_tokens must fit them)."""
        return self.kv_pool.num_slots

    @property
    def capture_enabled(self) -> bool:
        return self.capturer is not None

    # ---- stepping ------------------------------------------------------------------------------
    def step(self) -> None:
        self._budget_end = None   # NOTE: a new control budget for the answers before this forward
        if self._backlog:
            self._answer_backlog()
            self._budget_end = None
        if self.ep_group is None:
            batch = self.scheduler.schedule() if self._may_schedule() else None
            if batch is None:
                return
        else:
            # NOTE: DP: every rank steps together and runs a forward (empty when it has nothing),
            # since the forward's collectives need every rank.
            batch = self.scheduler.schedule() if self._may_schedule() else None
        out = self.runner.forward(batch)
        if batch is None or out is None:
            return
        self.stats[f"forwards_{out.runner}"] = self.stats.get(f"forwards_{out.runner}", 0) + 1
        if self.capturer is not None:
            self.capturer.commit(out.layout, batch.out_cache_loc)
        if batch.is_prefill:
            for req in batch.reqs:
                self.scheduler.cache_unfinished(req)
        if out.token_logits is not None:
            self._record_prompt_logprobs(batch, out.token_logits)
        self.stats["num_forwards"] += 1
        self.stats["num_prefill_forwards" if batch.is_prefill else "num_decode_forwards"] += 1
        if batch.is_prefill or not all(r.output_ids for r in batch.reqs):
            to_sample = []
            for i, req in enumerate(batch.reqs):
                if batch.completes(i):
                    if req.params.max_new_tokens > len(req.output_ids):
                        to_sample.append(i)
                    else:
                        self._finish(req, FinishReason("length"))
            if not to_sample:
                return
            reqs = [batch.reqs[i] for i in to_sample]
        else:
            # NOTE: a decode step completes every request, and one that has sampled before is
            # below max_new_tokens (_check_finish finished it otherwise). A prompt's last token can
            # come through a decode step too (chunked prefill): the general path above sees it.
            to_sample = range(len(batch.reqs))
            reqs = batch.reqs
        logits = out.logits
        if len(to_sample) != logits.shape[0]:
            logits = logits.index_select(0, to_device(torch.tensor(list(to_sample), dtype=torch.int64), logits.device))
        banned = None
        if any(len(r.output_ids) < r.params.min_new_tokens for r in reqs):
            banned = [self._banned_ids(r) for r in reqs]
        # NOTE: every row is sampled, finite or not (rows are independent), so that the step reads
        # its results once: ids, logprobs, finiteness (and top logprobs) in one transfer.
        result = sample(
            logits, [r.params for r in reqs], [r.seed for r in reqs], [r.seq_len for r in reqs],
            [r.output_ids for r in reqs], banned, [r.top_logprobs_num for r in reqs])
        columns = [result.next_ids, result.logprobs, torch.isfinite(logits).all(dim=-1)]   # [B] each
        if result.top_ids is not None:
            columns += [result.top_logprobs, result.top_ids]                                # [B, k] each
        next_ids, logprobs, finite, *top = self.host_reads.read(columns)
        eos = self._eos_set
        for j, req in enumerate(reqs):
            if not finite[j]:
                self._fail_nonfinite(req, "the forward produced non-finite logits (NaN or inf)")
                continue
            self.stats["generated_tokens"] += 1
            if logprobs[j] != logprobs[j]:   # NaN: no finite distribution to sample from
                self._fail_nonfinite(req, "sampling produced a NaN logprob (no finite distribution)")
                continue
            tok = next_ids[j]
            out_ids = req.output_ids
            out_ids.append(tok)
            req.output_logprobs.append(logprobs[j])
            if req.top_logprobs_num:
                n = req.top_logprobs_num
                req.output_top_logprobs.append(list(zip(top[0][j][:n], top[1][j][:n])))
            p = req.params
            # NOTE: the usual token ends nothing; only a token that could (_check_finish) pays for
            # the full check. Stop strings are the front end's (it sees the text and aborts).
            if ((tok in eos and not p.ignore_eos) or p.stop_token_ids or len(out_ids) >= p.max_new_tokens
                    or len(req.prompt_ids) + len(out_ids) >= req.max_total_len):
                reason = self._check_finish(req, tok)
            else:
                reason = None
            if reason is not None:
                self._finish(req, reason)
            elif req.emit_interval and len(out_ids) - req.sent_tokens >= req.emit_interval:
                self._update(req)

    @staticmethod
    def _record_prompt_logprobs(batch: Any, token_logits: torch.Tensor) -> None:
        """Input logprobs of the prompt tokens this prefill's logits predict (raw log-softmax)."""
        offset = 0
        for req, pre, ext in zip(batch.reqs, batch.prefix_lens, batch.extend_lens):
            nxt = req.prompt_logprob_start + len(req.input_logprobs)   # position whose logits come next
            hi = min(pre + ext, len(req.prompt_ids) - 1)
            if req.needs_prompt_logprobs and pre <= nxt < hi:
                lp = torch.log_softmax(token_logits[offset + nxt - pre:offset + hi - pre], dim=-1)  # [n, vocab]
                toks = torch.tensor(req.prompt_ids[nxt + 1:hi + 1], device=lp.device)
                req.input_logprobs.extend(lp.gather(1, toks[:, None]).squeeze(1).tolist())
                if req.top_logprobs_num:
                    val, idx = lp.topk(req.top_logprobs_num, dim=-1)
                    req.input_top_logprobs.extend(list(zip(v, i)) for v, i in zip(val.tolist(), idx.tolist()))
            offset += ext

    def _banned_ids(self, req: Req) -> list[int]:
        if len(req.output_ids) >= req.params.min_new_tokens:
            return []
        banned = list(req.params.stop_token_ids) + ([] if req.params.ignore_eos else self.eos_ids)
        if len(set(banned)) >= self.info.vocab_size:
            return []   # NOTE: every token would end the request: min_new_tokens cannot hold; ban none
        return banned

    def _fail_nonfinite(self, req: Req, why: str) -> None:
        """Ends a request whose next token has no finite distribution: abort, with what it has."""
        logger.warning("request %s: %s; aborted", req.rid, why)
        self.stats["nonfinite_logits_aborts"] += 1
        self.stats["aborted_requests"] += 1
        self._finish(req, FinishReason("abort", message=why + "; the request was aborted",
                                       err_type="NonFiniteLogits", status_code=500))

    def _check_finish(self, req: Req, tok: int) -> Optional[FinishReason]:
        p = req.params
        if not p.ignore_eos and tok in self.eos_ids:
            return FinishReason("stop", matched=tok)
        if tok in p.stop_token_ids:
            return FinishReason("stop", matched=tok)
        if len(req.output_ids) >= p.max_new_tokens or req.seq_len >= req.max_total_len:
            return FinishReason("length")
        return None

    # ---- outputs -------------------------------------------------------------------------------
    def _routing_hi(self, req: Req) -> int:
        if req.kv_len:
            # NOTE: a step that failed mid-forward (a DP peer died) had counted the position it was
            # feeding; its row never finished. A request never has more than seq_len - 1 rows.
            return min(req.kv_len, req.seq_len - 1)
        if req.saved_routing is not None:
            return req.routed_experts_start_len + req.saved_routing.shape[0]
        return req.routed_experts_start_len

    def _routing_rows(self, req: Req, lo: int, hi: int) -> torch.Tensor:
        return self.capturer.rows(self.scheduler.kv_slots(req), lo, hi, req.saved_routing,
                                  req.routed_experts_start_len)

    def _save_routing(self, req: Req) -> None:
        if self.capturer is not None and req.return_routed_experts and req.kv_len:
            start = req.routed_experts_start_len
            req.saved_routing = self._routing_rows(req, start, max(start, req.kv_len)).clone()

    def _update(self, req: Req, reason: Optional[FinishReason] = None) -> None:
        """Appends what req gained since its previous update (tokens, logprobs, final routing rows)."""
        lo = req.sent_tokens
        upd = ReqUpdate(uid=req.uid, output_ids=ints(req.output_ids[lo:]), cached_tokens=req.cached_tokens,
                        num_retractions=req.num_retractions, weight_version=self.weight_version)
        if req.return_logprob:
            upd.logprobs = floats(req.output_logprobs[lo:])
        if req.top_logprobs_num:
            rows = req.output_top_logprobs[lo:]
            upd.top_n = req.top_logprobs_num
            upd.top_logprobs = floats([[lp for lp, _ in row] for row in rows])
            upd.top_ids = ints([[t for _, t in row] for row in rows])
        if self.capturer is not None and req.return_routed_experts and req.scheduled_once:
            start = max(req.sent_routing_rows, req.routed_experts_start_len)
            hi = max(start, self._routing_hi(req))
            upd.routing = self._routing_rows(req, start, hi).to(self._routing_dtype).numpy().tobytes()
            upd.routing_dtype = "int16" if self._routing_dtype == torch.int16 else "int32"
            upd.routing_start = start
            req.sent_routing_rows = hi
        req.sent_tokens = len(req.output_ids)
        if (req.prompt_logprob_start >= 0 and not req.sent_input_logprobs
                and (reason is not None or not req.needs_prompt_logprobs)):
            req.sent_input_logprobs = True   # NOTE: once complete (the front end may stop the request early)
            upd.input_logprobs = floats(req.input_logprobs)
            if req.top_logprobs_num:
                upd.input_top_logprobs = floats([[lp for lp, _ in row] for row in req.input_top_logprobs])
                upd.input_top_ids = ints([[t for _, t in row] for row in req.input_top_logprobs])
        if reason is not None:
            upd.finished = True
            upd.finish_type, upd.finish_matched, upd.finish_message = reason.type, reason.matched, reason.message
            upd.finish_err_type, upd.finish_status_code = reason.err_type, reason.status_code
        self.outbox.append(upd)

    def _finish(self, req: Req, reason: FinishReason) -> None:
        if not req.scheduled_once and reason.type == "abort":
            # NOTE: no KV (so no routing row) was ever computed: SGLang's message, no routing field
            reason = FinishReason("abort", message=ABORT_BEFORE_PREFILL)
        self._update(req, reason)  # NOTE: before remove(): the routing rows live at the request's KV slots
        self.scheduler.remove(req)
        req.state = ReqState.FINISHED
        req.finish_reason = reason
        self.stats["finished_requests"] += 1
