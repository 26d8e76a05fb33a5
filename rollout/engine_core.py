"""EngineCore: model, KV memory, prefix cache, scheduler, sampler and capture, stepped by one thread."""
from __future__ import annotations

import logging
from typing import Optional

import torch

from capture.buffer_sizing import ForwardShapeLimits
from capture.capturer import RoutedExpertsCapturer
from rollout.config import EngineConfig
from rollout.kv_pool import KVPool
from rollout.model_runner import ModelRunner
from rollout.models.registry import load_model
from rollout.output import RolloutOutput
from rollout.radix_cache import RadixCache
from rollout.request import FinishReason, Req, ReqState
from rollout.sampler import sample
from rollout.scheduler import Scheduler
from rollout.stream_chunk import StreamChunk
from rollout.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
DEFAULT_KV_CACHE_BYTES = 512 * 2**20


class EngineCore:
    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        self.tokenizer = Tokenizer(cfg.resolved_tokenizer_path)
        self.model, _ = load_model(cfg.model_path, cfg.dtype, self.device)
        self.info = self.model.info
        self.eos_ids = Tokenizer.eos_token_ids(cfg.model_path)
        self.context_length = cfg.context_length or self.info.max_position_embeddings
        self.weight_version = cfg.weight_version
        kv_dtype = next(self.model.parameters()).dtype
        per_slot = KVPool.bytes_per_slot(num_layers=self.info.num_hidden_layers, num_kv_heads=self.info.num_kv_heads,
                                         head_dim=self.info.head_dim, dtype=kv_dtype)
        num_slots = cfg.max_total_tokens or max(2, (cfg.kv_cache_bytes or DEFAULT_KV_CACHE_BYTES) // per_slot)
        self.kv_pool = KVPool(num_slots=num_slots, num_layers=self.info.num_hidden_layers,
                              num_kv_heads=self.info.num_kv_heads, head_dim=self.info.head_dim,
                              dtype=kv_dtype, device=self.device)
        self.cache = RadixCache(self.kv_pool, enabled=cfg.enable_prefix_caching)
        self.prefill_token_budget = cfg.chunked_prefill_size or self.context_length
        self.scheduler = Scheduler(kv_pool=self.kv_pool, cache=self.cache,
                                   max_running_requests=cfg.max_running_requests,
                                   prefill_token_budget=self.prefill_token_budget,
                                   on_retract=self._save_routing)
        self.capturer: Optional[RoutedExpertsCapturer] = None
        if cfg.enable_return_routed_experts:
            self.capturer = RoutedExpertsCapturer(
                limits=self.forward_shape_limits, num_slots=num_slots + 1,
                num_layers=self.info.num_hidden_layers, top_k=self.info.top_k,
                num_experts=self.info.num_experts, moe_layer_ids=self.info.moe_layer_ids, device=self.device)
        self.runner = ModelRunner(model=self.model, kv_pool=self.kv_pool, device=self.device,
                                  capture_buffer=self.capturer.buffer if self.capturer else None)
        self.stats = {"num_forwards": 0, "num_prefill_forwards": 0, "num_decode_forwards": 0,
                      "prompt_tokens": 0, "generated_tokens": 0, "finished_requests": 0,
                      "aborted_requests": 0}

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
        return self.scheduler.has_work()

    def abort(self, rid: str) -> bool:
        req = self.scheduler.find(rid)
        if req is None:
            return False
        self._finish(req, FinishReason("abort", message="aborted by request"))
        self.stats["aborted_requests"] += 1
        return True

    def abort_all(self) -> int:
        reqs = list(self.scheduler.running) + list(self.scheduler.waiting)
        for req in reqs:
            self.abort(req.rid)
        return len(reqs)

    def flush_cache(self) -> bool:
        """Drops every cached prefix (and so its routing); refused while requests hold KV."""
        if self.scheduler.has_work():
            return False
        return self.cache.flush()

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

    # ---- stepping ------------------------------------------------------------------------------
    def step(self) -> None:
        batch = self.scheduler.schedule()
        if batch is None:
            return
        out = self.runner.forward(batch)
        if self.capturer is not None:
            self.capturer.commit(out.layout, batch.out_cache_loc)
        if batch.is_prefill:
            for req in batch.reqs:
                self.scheduler.cache_unfinished(req)
        self.stats["num_forwards"] += 1
        self.stats["num_prefill_forwards" if batch.is_prefill else "num_decode_forwards"] += 1
        rows = [i for i in range(len(batch.reqs)) if batch.completes(i)]
        to_sample = [i for i in rows if batch.reqs[i].params.max_new_tokens > len(batch.reqs[i].output_ids)]
        for i in rows:
            if i not in to_sample:
                self._finish(batch.reqs[i], FinishReason("length"))
        if not to_sample:
            return
        reqs = [batch.reqs[i] for i in to_sample]
        result = sample(
            out.logits[to_sample], [r.params for r in reqs], [r.seed for r in reqs], [r.seq_len for r in reqs],
            [r.output_ids for r in reqs], [self._banned_ids(r) for r in reqs], [r.top_logprobs_num for r in reqs])
        next_ids = result.next_ids.tolist()
        logprobs = result.logprobs.tolist()
        top = None
        if result.top_ids is not None:
            top = (result.top_logprobs.tolist(), result.top_ids.tolist())
        for j, req in enumerate(reqs):
            tok = next_ids[j]
            req.output_ids.append(tok)
            req.output_logprobs.append(logprobs[j])
            if req.top_logprobs_num:
                n = req.top_logprobs_num
                req.output_top_logprobs.append(list(zip(top[0][j][:n], top[1][j][:n])))
            self.stats["generated_tokens"] += 1
            if req.detokenizer is not None:
                req.detokenizer.step(req.output_ids)
            reason = self._check_finish(req, tok)
            if reason is not None:
                self._finish(req, reason)
            elif req.stream:
                self._emit_chunk(req, finished=False)

    def _banned_ids(self, req: Req) -> list[int]:
        if len(req.output_ids) >= req.params.min_new_tokens:
            return []
        return list(req.params.stop_token_ids) + ([] if req.params.ignore_eos else self.eos_ids)

    def _check_finish(self, req: Req, tok: int) -> Optional[FinishReason]:
        p = req.params
        if not p.ignore_eos and tok in self.eos_ids:
            return FinishReason("stop", matched=tok)
        if tok in p.stop_token_ids:
            return FinishReason("stop", matched=tok)
        if p.stop and req.detokenizer is not None:
            if len(req.output_ids) >= p.min_new_tokens:
                window = req.detokenizer.text[-(max(len(s) for s in p.stop) + 16):]
                for s in p.stop:
                    if s in window:
                        return FinishReason("stop", matched=s)
        if len(req.output_ids) >= p.max_new_tokens or req.seq_len >= req.max_total_len:
            return FinishReason("length")
        return None

    # ---- outputs -------------------------------------------------------------------------------
    def _routing_hi(self, req: Req) -> int:
        if req.kv_len:
            return req.kv_len
        if req.saved_routing is not None:
            return req.routed_experts_start_len + req.saved_routing.shape[0]
        return req.routed_experts_start_len

    def _routing_rows(self, req: Req, lo: int, hi: int) -> torch.Tensor:
        return self.capturer.rows(req.kv_slots, lo, hi, req.saved_routing, req.routed_experts_start_len)

    def _save_routing(self, req: Req) -> None:
        if self.capturer is not None and req.return_routed_experts and req.kv_len:
            start = req.routed_experts_start_len
            req.saved_routing = self._routing_rows(req, start, max(start, req.kv_len)).clone()

    def _text(self, req: Req, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=req.params.skip_special_tokens)

    def _final_text(self, req: Req, reason: FinishReason) -> str:
        text = self._text(req, req.output_ids)
        if reason.type == "stop" and isinstance(reason.matched, str) and not req.params.no_stop_trim:
            cut = text.find(reason.matched)
            if cut >= 0:
                text = text[:cut]
        return text

    def _finish(self, req: Req, reason: FinishReason) -> None:
        want_rows = self.capturer is not None and req.return_routed_experts
        routed = None
        if want_rows:
            routed = self._routing_rows(req, req.routed_experts_start_len, self._routing_hi(req))
        output = RolloutOutput(
            rid=req.rid, prompt_ids=list(req.prompt_ids), output_ids=list(req.output_ids),
            text=self._final_text(req, reason), finish_reason=reason.type,
            finish_info=reason.to_dict(len(req.output_ids)),
            output_logprobs=list(req.output_logprobs) if req.return_logprob else None,
            output_top_logprobs=list(req.output_top_logprobs) if req.top_logprobs_num else None,
            cached_tokens=req.cached_tokens, weight_version=self.weight_version,
            routed_experts=routed, routed_experts_start_len=req.routed_experts_start_len,
            num_experts=self.info.num_experts, moe_layer_ids=self.info.moe_layer_ids,
            num_retractions=req.num_retractions)
        if req.stream:
            self._emit_chunk(req, finished=True, output=output)
        self.scheduler.remove(req)
        req.state = ReqState.FINISHED
        req.finish_reason = reason
        self.stats["finished_requests"] += 1
        if req.sink is not None and not req.stream:
            req.sink(output)

    def _emit_chunk(self, req: Req, *, finished: bool, output: Optional[RolloutOutput] = None) -> None:
        new_ids = req.output_ids[req.sent_tokens:]
        streamed = req.detokenizer.text if req.detokenizer is not None else ""
        if output is not None:
            # NOTE: the last chunk completes the full text (flushed bytes, stop-string trim).
            text = output.text[req.sent_text_len:] if len(output.text) >= req.sent_text_len else ""
            req.sent_text_len = len(output.text)
        else:
            text = streamed[req.sent_text_len:]
            req.sent_text_len = len(streamed)
        lo = max(req.sent_routing_rows, req.routed_experts_start_len)
        routed = None
        if self.capturer is not None and req.return_routed_experts:
            hi = max(lo, self._routing_hi(req))
            routed = self._routing_rows(req, lo, hi)
            req.sent_routing_rows = hi
        chunk = StreamChunk(
            rid=req.rid, output_ids=new_ids, text=text,
            output_logprobs=req.output_logprobs[req.sent_tokens:] if req.return_logprob else None,
            output_top_logprobs=req.output_top_logprobs[req.sent_tokens:] if req.top_logprobs_num else None,
            routed_experts=routed, routed_experts_start=lo, finished=finished, output=output)
        req.sent_tokens = len(req.output_ids)
        if req.sink is not None:
            req.sink(chunk)
