"""OutputProcessor: what a step does with its forward's results, and every ReqUpdate the engine sends.

After a forward: the routing rows committed, computed KV handed to the prefix cache, prompt
logprobs, the next tokens sampled (and the non-finite check), the finish checks, and an update
per request that finished or has a stream delta due. Aborts finish requests through it too.
It never builds text or wire formats beyond raw bytes: the front end detokenizes, checks stop
strings and encodes (rollout/frontend/).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from rollout.batch.host_device import to_device
from rollout.core.drafter import pace
from rollout.core.request import Req, ReqStatus
from rollout.core.token_latency import Bucketed, TokenLatency
from rollout.exec.sampler import counter_uniform, sample
from rollout.generate_io import FinishReason
from rollout.ipc.control_values import ACCEPT_BUCKETS
from rollout.ipc.messages import ReqUpdate, floats, ints

logger = logging.getLogger(__name__)
ABORT_BEFORE_PREFILL = "Abort before prefill"   # SGLang's message for a request that computed no KV


@dataclass(frozen=True)
class SamplePlan:
    """What one forward samples, fixed when the step is launched (OutputProcessor.plan)."""
    rows: tuple[int, ...]         # the batch's requests whose logits pick a next token
    reqs: tuple[Req, ...]         # those requests
    positions: tuple[int, ...]    # each sampled token's position (its noise's counter)
    known: tuple[int, ...]        # output tokens the host had at launch
    pending: tuple[bool, ...]     # whether the request's last token was the running forward's sample then
    banned: Optional[list]        # per row, tokens min_new_tokens masks; None: none
    ends: tuple[int, ...] = ()    # requests completed at max_new_tokens: they end ("length") unsampled
    # each row's uniform noise (counter_uniform of its seed and position) [rows] float64 on the host,
    # hashed before the forward; None when every row is greedy
    noise: Optional[torch.Tensor] = None


class OutputProcessor:
    def __init__(self, *, scheduler: Any, capturer: Any, host_reads: Any, stats: dict, eos_ids: list[int],
                 vocab_size: int, num_experts: int, weight_version: str):
        self.scheduler = scheduler
        self.capturer = capturer                  # Optional[RoutedExpertsCapturer]
        self.host_reads = host_reads              # the step's one read of its device results (counted)
        self.stats = stats                        # EngineCore's counters (shared)
        self.eos_ids = eos_ids
        self._eos_set = frozenset(eos_ids)
        self.vocab_size = vocab_size
        self.weight_version = weight_version      # the label every update carries
        # NOTE: routing rows travel as int16 (logical ids and -1) unless the expert count needs int32
        self._routing_dtype = torch.int16 if num_experts < 2**15 else torch.int32
        self.outbox: list[ReqUpdate] = []
        self.latency = TokenLatency()             # time to first token, inter-token latency
        self.accepted = Bucketed(ACCEPT_BUCKETS)  # speculative decoding: tokens per request per verify step

    def take(self) -> list[ReqUpdate]:
        out, self.outbox = self.outbox, []
        return out

    # ---- after a forward -----------------------------------------------------------------------
    def plan(self, batch: Any) -> Optional[SamplePlan]:
        """What the forward of `batch` samples (None: nothing; a verify step samples in process),
        fixed as it is launched: with the overlap schedule, the previous step's tokens are
        appended (process) while this forward runs and samples."""
        if batch is None or batch.drafts:
            return None
        reqs = batch.reqs
        pending = batch.pending or (False,) * len(reqs)
        if not batch.is_prefill and not batch.pending and all(r.output_ids for r in reqs):
            # NOTE: the usual decode step: it completes every request, and one that has sampled
            # before is below max_new_tokens (_check_finish finished it otherwise)
            rows: Sequence[int] = range(len(reqs))
            ends: tuple = ()
        else:
            # NOTE: a prefill step, a prompt's last token through a decode step (chunked prefill),
            # or a step that feeds tokens still being sampled (the overlap schedule)
            rows, end_rows = [], []
            for i, (req, pre, ext, p) in enumerate(zip(reqs, batch.prefix_lens, batch.extend_lens, pending)):
                if pre + ext == req.seq_len + p:
                    (rows if req.params.max_new_tokens > len(req.output_ids) + p else end_rows).append(i)
            ends = tuple(end_rows)
            if not rows:
                return SamplePlan(rows=(), reqs=(), positions=(), known=(), pending=(), banned=None, ends=ends)
        sampled = tuple(reqs[i] for i in rows)
        known = tuple(len(r.output_ids) for r in sampled)
        pend = tuple(pending[i] for i in rows)
        banned = None
        if any(n + p < r.params.min_new_tokens for n, p, r in zip(known, pend, sampled)):
            banned = [self._banned_ids(r, n + p) for r, n, p in zip(sampled, known, pend)]
        positions = tuple(batch.prefix_lens[i] + batch.extend_lens[i] for i in rows)
        # NOTE: the noise is hashed here, before the forward: right after it (the forward's memory
        # traffic evicts the host's caches) the same numpy calls took ~0.1 ms more on CPU
        noise = None if all(r.params.is_greedy for r in sampled) else counter_uniform([r.seed for r in sampled], positions)
        return SamplePlan(rows=tuple(rows), reqs=sampled, known=known, pending=pend, banned=banned, ends=ends,
                          positions=positions, noise=noise)

    def draw(self, plan: SamplePlan, logits: torch.Tensor, last: dict[int, int]) -> list:
        """Samples the plan's rows of logits (the forward's) and reads the results to the host.
        last: each request's token sampled by the previous forward (uid -> id), for the requests
        whose last token the host did not have at launch (plan.pending)."""
        if len(plan.rows) != logits.shape[0]:
            logits = logits.index_select(0, to_device(torch.tensor(plan.rows, dtype=torch.int64), logits.device))
        # NOTE: penalties count the output tokens: those the host had at launch, and the pending one
        outs = [(r.output_ids[:n] + [last[r.uid]] if p else r.output_ids[:n]) if r.params.has_penalty else ()
                for r, n, p in zip(plan.reqs, plan.known, plan.pending)]
        return self._draw(plan.reqs, logits, plan.positions, outs, plan.banned, plan.noise)

    def process(self, batch: Any, out: Any, plan: Optional[SamplePlan] = None, drawn: Optional[list] = None) -> None:
        """batch: the ScheduledBatch the forward ran; out: its ForwardOutput; plan, drawn: what its
        forward sampled (plan(batch), draw's results). A request that finished while the forward
        ran (the overlap schedule: its previous token ended it) is left alone."""
        self.stats[f"forwards_{out.runner}"] = self.stats.get(f"forwards_{out.runner}", 0) + 1
        if batch.drafts:
            self.stats["num_forwards"] += 1
            self.stats["num_decode_forwards"] += 1
            self._verify(batch, out)
            return
        if batch.is_prefill:
            self.scheduler.cache_prefill(batch)
        if out.token_logits is not None:
            self._record_prompt_logprobs(batch, out.token_logits)
        self.stats["num_forwards"] += 1
        self.stats["num_prefill_forwards" if batch.is_prefill else "num_decode_forwards"] += 1
        if plan is None:
            return
        for i in plan.ends:
            req = batch.reqs[i]
            if req.status is not ReqStatus.FINISHED:
                self.finish(req, FinishReason("length"))
        if not plan.rows:
            return
        reqs = list(plan.reqs)
        live = [j for j, r in enumerate(reqs) if r.status is not ReqStatus.FINISHED]
        if len(live) == len(reqs):
            self._settle(*self._append(reqs, *drawn))
        elif live:
            self._settle(*self._append([reqs[j] for j in live], *drawn, spans=[(j, j + 1) for j in live]))

    def _draw(self, reqs: Sequence[Req], logits: torch.Tensor, positions: Sequence[int],
              outs: Sequence[Sequence[int]], banned: Optional[list], noise: Optional[torch.Tensor] = None) -> list:
        """Samples row i of logits for reqs[i] at positions[i] (its noise's counter), after
        outs[i] (penalties) with banned[i] masked (min_new_tokens), and reads the results to the
        host: [next ids, logprobs, finite] (and top logprobs, top ids)."""
        # NOTE: every row is sampled, finite or not (rows are independent), so that the step reads
        # its results once: ids, logprobs, finiteness (and top logprobs) in one transfer.
        seeds = [r.seed for r in reqs] if noise is None else ()   # NOTE: hashed into the noise already
        result = sample(logits, [r.params for r in reqs], seeds, positions, outs, banned,
                        [r.top_logprobs_num for r in reqs], noise=noise)
        # NOTE: a row is finite iff 0 * row sums to 0 (inf and NaN give NaN): 3 cheap ops where
        # isfinite().all() costs more than the whole log-softmax on CPU
        columns = [result.next_ids, result.logprobs, (logits * 0).sum(dim=-1) == 0]   # [B] each
        if result.top_ids is not None:
            columns += [result.top_logprobs, result.top_ids]                                # [B, k] each
        return self.host_reads.read(columns)

    def _verify(self, batch: Any, out: Any) -> None:
        """A speculative decode step: each request fed its last token and its drafts; a draft is
        kept iff it equals the token sampled (with the request's own noise) at its position, and
        the first mismatch emits that sample, so the tokens are those decoding one by one gives.
        The KV of the rejected drafts' positions is given back and only the kept positions'
        routing rows reach the host store."""
        reqs, drafts = batch.reqs, batch.drafts
        ends: list = []
        rows: list[int] = []         # sampled rows of out.logits
        row_reqs: list[Req] = []
        depth: list[int] = []
        fed: list = []
        live: list[tuple[Req, list[int], int]] = []   # (request, drafts, its first sampled row)
        off = 0
        for req, d in zip(reqs, drafts):
            req.spec_verify_ct += 1
            req.spec_num_proposed_drafts += len(d)
            if req.params.max_new_tokens <= len(req.output_ids):
                ends.append((req, FinishReason("length")))   # NOTE: a prompt's last token at max_new_tokens 0
            else:
                live.append((req, d, len(rows)))
                rows.extend(range(off, off + len(d) + 1))
                row_reqs.extend([req] * (len(d) + 1))
                depth.extend(range(len(d) + 1))
                fed.extend(d[:j] for j in range(len(d) + 1))
            off += len(d) + 1
        cols = None
        if rows:
            logits = out.logits
            if len(rows) != logits.shape[0]:
                logits = logits.index_select(0, to_device(torch.tensor(rows, dtype=torch.int64), logits.device))
            # NOTE: row i lies depth[i] tokens past its request's last one, after the drafts fed[i]:
            # its noise position, penalties and min_new_tokens count them as if they were sampled
            positions = [r.seq_len + d for r, d in zip(row_reqs, depth)]
            lens = [len(r.output_ids) + d for r, d in zip(row_reqs, depth)]
            outs = [r.output_ids + list(f) if f and r.params.has_penalty else r.output_ids
                    for r, f in zip(row_reqs, fed)]
            banned = None
            if any(n < r.params.min_new_tokens for n, r in zip(lens, row_reqs)):
                banned = [self._banned_ids(r, n) for r, n in zip(row_reqs, lens)]
            cols = self._draw(row_reqs, logits, positions, outs, banned)
        spans = []
        for req, d, lo in live:
            ids = cols[0]
            kept = 0
            while kept < len(d) and ids[lo + kept] == d[kept]:
                kept += 1
            req.spec_num_correct_drafts += kept
            pace(req, len(d), kept)
            spans.append((lo, lo + kept + 1))
        live_reqs = [req for req, _, _ in live]
        before = [len(r.output_ids) for r in live_reqs]
        more_ends, due = self._append(live_reqs, *cols, spans=spans) if live else ([], [])
        self.accepted.add([len(r.output_ids) - b for r, b in zip(live_reqs, before)])
        # NOTE: positions past a request's new seq_len - 1 fed rejected drafts (or tokens after its
        # end): their KV goes back and their routing rows are never stored
        keep: list[int] = []
        off = 0
        for req, pre, ext in zip(reqs, batch.prefix_lens, batch.extend_lens):
            kv = max(pre, req.seq_len - 1)
            keep.extend(range(off, off + kv - pre))
            off += ext
            self.scheduler.truncate(req, kv)
        if self.capturer is not None:
            self.capturer.commit(out.layout, batch.out_cache_loc, keep=None if len(keep) == off else keep)
        self._settle(ends + more_ends, due)

    def _append(self, reqs: list[Req], next_ids: list, logprobs: list, finite: list, *top: list,
                spans: Optional[Sequence[tuple[int, int]]] = None) -> tuple[list, list]:
        """Appends each request's sampled token (rows spans[j] = (lo, hi) of the results for
        request j, in order, until one ends it; default: row j) -> (the requests to finish and why,
        those whose stream delta is due): _settle sends them."""
        eos = self._eos_set
        version = self.weight_version
        now = time.time()
        firsts: list[float] = []
        gaps: list[float] = []
        ends: list[tuple[Req, FinishReason]] = []
        due: list[Req] = []
        for j, req in enumerate(reqs):
            lo, hi = (j, j + 1) if spans is None else spans[j]
            reason = None
            out_ids = req.output_ids
            start = len(out_ids)
            p = req.params
            for i in range(lo, hi):
                if not finite[i]:
                    reason = self._nonfinite(req, "the forward produced non-finite logits (NaN or inf)")
                    break
                self.stats["generated_tokens"] += 1
                if logprobs[i] != logprobs[i]:   # NaN: no finite distribution to sample from
                    reason = self._nonfinite(req, "sampling produced a NaN logprob (no finite distribution)")
                    break
                tok = next_ids[i]
                out_ids.append(tok)
                req.output_logprobs.append(logprobs[i])
                if req.top_logprobs_num:
                    n = req.top_logprobs_num
                    req.output_top_logprobs.append(list(zip(top[0][i][:n], top[1][i][:n])))
                # NOTE: the usual token ends nothing; only a token that could (_check_finish) pays for
                # the full check. Stop strings are the front end's (it sees the text and aborts).
                if ((tok in eos and not p.ignore_eos) or p.stop_token_ids or len(out_ids) >= p.max_new_tokens
                        or len(req.prompt_ids) + len(out_ids) >= req.max_total_len):
                    reason = self._check_finish(req, tok)
                    if reason is not None:
                        break
            added = len(out_ids) - start
            if added:
                versions = req.weight_versions
                if not versions or versions[-1][0] != version:   # NOTE: a request that lives across a weight update
                    versions.append((version, start))
                if req.last_token_time:
                    gaps.extend([(now - req.last_token_time) / added] * added)
                elif req.arrival_time:
                    firsts.append(now - req.arrival_time)
                    gaps.extend([0.0] * (added - 1))
                req.last_token_time = now
            if reason is not None:
                ends.append((req, reason))
            elif req.emit_interval and len(out_ids) - req.sent_tokens >= req.emit_interval:
                due.append(req)
        self.latency.observe(firsts, gaps)
        return ends, due

    def _settle(self, ends: list[tuple[Req, FinishReason]], due: list[Req]) -> None:
        """Finishes the requests that ended and sends the due stream deltas."""
        for req, reason in ends:
            self.finish(req, reason)
        for req in due:
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

    def _banned_ids(self, req: Req, num_output: int) -> list[int]:
        """Tokens req may not sample as its output token number num_output + 1 (min_new_tokens)."""
        if num_output >= req.params.min_new_tokens:
            return []
        banned = list(req.params.stop_token_ids) + ([] if req.params.ignore_eos else self.eos_ids)
        if len(set(banned)) >= self.vocab_size:
            return []   # NOTE: every token would end the request: min_new_tokens cannot hold; ban none
        return banned

    def _nonfinite(self, req: Req, why: str) -> FinishReason:
        """Why a request whose next token has no finite distribution ends: abort, with what it has."""
        logger.warning("request %s: %s; aborted", req.rid, why)
        self.stats["nonfinite_logits_aborts"] += 1
        self.stats["aborted_requests"] += 1
        return FinishReason("abort", message=why + "; the request was aborted", err_type="NonFiniteLogits",
                            status_code=500)

    def _check_finish(self, req: Req, tok: int) -> Optional[FinishReason]:
        p = req.params
        if not p.ignore_eos and tok in self.eos_ids:
            return FinishReason("stop", matched=tok)
        if tok in p.stop_token_ids:
            return FinishReason("stop", matched=tok)
        if len(req.output_ids) >= p.max_new_tokens or req.seq_len >= req.max_total_len:
            return FinishReason("length")
        return None

    # ---- updates -------------------------------------------------------------------------------
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

    def save_routing(self, req: Req) -> None:
        """Keeps a request's routing rows before its KV slots are given up (a retraction)."""
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
        if len(req.weight_versions) > req.sent_weight_versions:
            upd.weight_versions = [[v, i] for v, i in req.weight_versions[req.sent_weight_versions:]]
            req.sent_weight_versions = len(req.weight_versions)
        if (req.prompt_logprob_start >= 0 and not req.sent_input_logprobs
                and (reason is not None or not req.needs_prompt_logprobs)):
            req.sent_input_logprobs = True   # NOTE: once complete (the front end may stop the request early)
            upd.input_logprobs = floats(req.input_logprobs)
            if req.top_logprobs_num:
                upd.input_top_logprobs = floats([[lp for lp, _ in row] for row in req.input_top_logprobs])
                upd.input_top_ids = ints([[t for _, t in row] for row in req.input_top_logprobs])
        if reason is not None:
            upd.finished = True
            if req.spec_verify_ct:
                upd.spec = [req.spec_verify_ct, req.spec_num_proposed_drafts, req.spec_num_correct_drafts]
            upd.finish_type, upd.finish_matched, upd.finish_message = reason.type, reason.matched, reason.message
            upd.finish_err_type, upd.finish_status_code = reason.err_type, reason.status_code
        self.outbox.append(upd)

    def finish(self, req: Req, reason: FinishReason) -> None:
        """Ends a request: its last update, its KV returned (to the prefix cache when enabled)."""
        if not req.scheduled_once and reason.type == "abort":
            # NOTE: no KV (so no routing row) was ever computed: SGLang's message, no routing field
            reason = FinishReason("abort", message=ABORT_BEFORE_PREFILL)
        self._update(req, reason)  # NOTE: before remove(): the routing rows live at the request's KV slots
        self.scheduler.remove(req)
        req.status = ReqStatus.FINISHED
        req.finish_reason = reason
        self.stats["finished_requests"] += 1
