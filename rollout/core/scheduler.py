"""Scheduler: continuous batching over a KV slot pool with a prefix cache.

Each step is one forward over a list of (request, new tokens) pairs: a prefill step (new and
chunked requests, at most `prefill_token_budget` tokens) when anything waits and fits, else a
decode step over every running request whose prompt is computed. When KV runs out during decode the newest running
requests are retracted: their KV goes to the prefix cache and they re-queue at the front.
"""
from __future__ import annotations

from collections import Counter
from itertools import chain
from operator import attrgetter
from typing import Any, Callable, Optional

import torch

from rollout.batch.kv_pool import KVPool, ReqToTokenPool
from rollout.core.radix_cache import RadixCache
from rollout.core.request import Req, ReqStatus, WaitQueue
from rollout.core.schedule_policy import SchedulePolicy
from rollout.core.shared_prefixes import SharedPrefixes
from rollout.batch.forward_batch import ScheduledBatch


MIN_SHARED_PREFIX = 8  # uncached tokens two new requests must share before one waits for the other


class Scheduler:
    def __init__(self, *, kv_pool: KVPool, cache: RadixCache, max_running_requests: int,
                 prefill_token_budget: int, context_length: int,
                 on_retract: Optional[Callable[[Req], None]] = None, drafter: Optional[Any] = None,
                 policy: Optional[SchedulePolicy] = None):
        """drafter: speculative decoding's proposer (rollout/core/drafter.py), whose drafts a decode
        step feeds after each request's last token; None: plain decode steps. policy: the order in
        which prefill steps admit waiting requests (default fcfs)."""
        self.kv_pool = kv_pool
        # NOTE: one row per admitted request; hold_admission lowers max_running_requests to 0
        # at times, never above this. On the KV pool's device (a batch's kv_indices are gathered
        # there), with a host copy for the scheduler's own reads.
        self.req_to_token = ReqToTokenPool(num_rows=max(1, max_running_requests), width=context_length,
                                           device=kv_pool.device)
        self.cache = cache
        self.max_running_requests = max_running_requests
        self.prefill_token_budget = prefill_token_budget
        self.on_retract = on_retract
        self.drafter = drafter
        self.policy = policy or SchedulePolicy()
        self.waiting = WaitQueue()
        self.running: list[Req] = []        # admitted: holding KV (prefilling or decoding)
        self._by_uid: dict[int, Req] = {}   # every queued or running request, by uid
        self._admit_counter = 0
        self._arrival_counter = 0
        # while set (a weight update waits), only requests that arrived up to this number are admitted
        self.admit_limit: Optional[int] = None
        self.num_retractions = 0
        # prefill totals: admissions, prompt tokens computed, prompt tokens found in the prefix cache
        self.num_admitted = 0
        self.num_prefill_tokens = 0
        self.num_cached_prefill_tokens = 0
        self.num_decode_steps = 0          # paces speculative drafts (rollout/core/drafter.py)
        # True unless no running request can be mid-prefill (set on every prefill scheduling)
        self._maybe_chunked = False
        # the last prefill step scheduled, until its new KV reaches the prefix cache (cache_prefill):
        # with the overlap schedule the next step is scheduled before that
        self._uncached: Optional[ScheduledBatch] = None

    # ---- queue management ------------------------------------------------------------------
    def add(self, req: Req) -> None:
        assert req.uid not in self._by_uid, f"request {req.rid} (uid {req.uid}) is already scheduled"
        self._by_uid[req.uid] = req
        self._arrival_counter += 1
        req.queue_seq = self._arrival_counter
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def hold_admission(self) -> None:
        """Requests that arrive from now on wait until release_admission(); earlier ones run."""
        if self.admit_limit is None:
            self.admit_limit = self._arrival_counter

    def release_admission(self) -> None:
        self.admit_limit = None

    def has_admissible(self) -> bool:
        """Whether a running request, or a waiting one that may be admitted, exists."""
        if self.running:
            return True
        front = next(iter(self.waiting), None)
        # NOTE: the queue is in arrival order but for retracted requests at its front, which are
        # older still: a front request past the limit means every queued one is.
        return front is not None and (self.admit_limit is None or front.queue_seq <= self.admit_limit)

    def find(self, uid: int) -> Optional[Req]:
        return self._by_uid.get(uid)

    def remove(self, req: Req) -> None:
        """Takes a request out of the queues and returns its KV (to the cache when enabled)."""
        if self._by_uid.get(req.uid) is not req:
            return
        del self._by_uid[req.uid]
        if req in self.waiting:
            self.waiting.remove(req)
        else:
            self.running.remove(req)
            self._release(req)

    def remove_all_waiting(self) -> list[Req]:
        """Takes every waiting request out of the queue (they hold no KV), in one pass."""
        reqs = self.waiting.discard_all()
        by_uid = self._by_uid
        for req in reqs:
            del by_uid[req.uid]
        return reqs

    def kv_slots(self, req: Req) -> torch.Tensor:
        """The request's KV slots for positions 0 .. kv_len-1 ([kv_len] int64, a copy)."""
        if req.req_to_token_row is None:
            return torch.empty(0, dtype=torch.int64)
        return self.req_to_token.slots(req.req_to_token_row, req.kv_len)

    def _release(self, req: Req) -> None:
        """Gives up a request's KV: computed KV to the prefix cache (freed when it is disabled)."""
        if req.kv_len:
            n = min(req.kv_len, req.seq_len)
            self._give_to_cache(req, n)
            if n < req.kv_len:
                # NOTE: the overlap schedule: the slot of a token still being sampled (never cached)
                self.kv_pool.free(self.kv_slots(req)[n:])
        if req.last_node is not None:
            self.cache.dec_lock(req.last_node)
        self._drop_row(req)
        if self.drafter is not None:
            self.drafter.release(req)

    def _give_to_cache(self, req: Req, n: int) -> list[int]:
        """Inserts the request's KV of positions 0 .. n-1 into the prefix cache and frees the
        slots the cache did not take; returns the key inserted."""
        tokens = req.cache_key(n)
        slots = self.req_to_token.slots(req.req_to_token_row, n)
        kept = self.cache.insert(tokens, slots)
        # the cache keeps its own slots for the first `kept` tokens; ours beyond cache_len are duplicates
        if kept > req.cache_len:
            self.kv_pool.free(slots[req.cache_len:kept])
        return tokens

    def _drop_row(self, req: Req) -> None:
        if req.req_to_token_row is not None:
            self.req_to_token.free(req.req_to_token_row)
        req.req_to_token_row = None
        req.kv_len = 0
        req.cache_len = 0
        req.last_node = None

    def cache_prefill(self, batch: ScheduledBatch) -> None:
        """After a prefill step's forward: each request's KV computed so far to the prefix cache."""
        for req, pre, ext in zip(batch.reqs, batch.prefix_lens, batch.extend_lens):
            self.cache_unfinished(req, pre + ext)
        if self._uncached is batch:
            self._uncached = None

    def cache_unfinished(self, req: Req, n: Optional[int] = None) -> None:
        """Hands a running request's KV of positions 0 .. n-1 (default: kv_len), computed by the
        forward just processed, to the prefix cache (others can share it now). Later positions may
        be scheduled already (the overlap schedule)."""
        n = req.kv_len if n is None else n
        if not self.cache.enabled or n <= req.cache_len or req.req_to_token_row is None:
            return
        tokens = self._give_to_cache(req, n)
        slots, node = self.cache.match_prefix(tokens)
        assert slots.numel() == len(tokens)
        self.cache.inc_lock(node)
        self.cache.dec_lock(req.last_node)
        req.last_node = node
        self.req_to_token.write(req.req_to_token_row, 0, slots)
        req.cache_len = len(tokens)

    # ---- scheduling --------------------------------------------------------------------------
    def _alloc(self, n: int) -> Optional[torch.Tensor]:
        short = n - self.kv_pool.available()
        if short > 0:
            self.cache.evict(short)
        return self.kv_pool.alloc(n)

    def _admit(self, req: Req) -> None:
        """Matches the prefix cache and locks it (no allocation yet)."""
        # NOTE: the last token is always computed, so its logits exist to sample from.
        n = req.seq_len - 1
        if req.needs_prompt_logprobs:
            # NOTE: the hit is shortened so that every position whose logits give a prompt logprob
            # still to compute is computed (a cached position has KV but no logits)
            n = min(n, req.prompt_logprob_start + len(req.input_logprobs))
        slots, node = self.cache.match_prefix(req.cache_key(n))
        self.cache.inc_lock(node)
        req.last_node = node
        req.req_to_token_row = self.req_to_token.alloc()
        self.req_to_token.write(req.req_to_token_row, 0, slots)
        req.kv_len = req.cache_len = int(slots.numel())

    def _unadmit(self, req: Req) -> None:
        self.cache.dec_lock(req.last_node)
        self._drop_row(req)

    def schedule(self) -> Optional[ScheduledBatch]:
        return self._schedule_prefill() or self._schedule_decode()

    def _schedule_prefill(self) -> Optional[ScheduledBatch]:
        if not self.waiting and not self._maybe_chunked:
            return None   # NOTE: the usual decode step: no scan of the running requests
        batch = self._schedule_prefill_from(self._chunked())
        self._maybe_chunked = bool(self._chunked())
        return batch

    def _chunked(self) -> list[Req]:
        """Running requests whose prompt is not fully computed yet (chunked prefill)."""
        return [r for r in self.running if r.kv_len < r.seq_len - 1]

    def _schedule_prefill_from(self, chunked: list[Req]) -> Optional[ScheduledBatch]:
        budget = self.prefill_token_budget
        reqs, ext, pre, locs, admitted = [], [], [], [], []
        # NOTE: the queue is read lazily (it may hold many thousands) and changed after the loop.
        candidates = chain(chunked, self.policy.order(self.waiting, self.cache))
        in_order = self.policy.in_queue_order
        running_count = len(self.running)
        shared = SharedPrefixes(MIN_SHARED_PREFIX) if self.cache.enabled else None
        if shared is not None and self._uncached is not None:
            # NOTE: the overlap schedule: the prefill in flight is not in the cache yet; a request
            # sharing its prefix waits a step for it as for one scheduled in this step
            for req in self._uncached.reqs:
                if req.status is ReqStatus.RUNNING:
                    shared.add(req)
        for req in candidates:
            if budget <= 0:
                break
            is_new = req.status is ReqStatus.WAITING
            if is_new:
                if running_count >= self.max_running_requests:
                    break
                if self.admit_limit is not None and req.queue_seq > self.admit_limit:
                    if in_order:
                        break   # NOTE: in queue order every later request arrived later still
                    continue
                self._admit(req)
                if shared is not None and shared.shares(req):
                    # NOTE: wait one step: the prefix computed by the earlier request is cached then,
                    # so n samples of one prompt compute its KV once.
                    self._unadmit(req)
                    continue
            remaining = req.seq_len - req.kv_len
            take = min(remaining, budget)
            slots = self._alloc(take)
            if slots is None:
                if is_new:
                    self._unadmit(req)
                break
            reqs.append(req)
            if shared is not None:
                shared.add(req)
            pre.append(req.kv_len)
            ext.append(take)
            locs.append(slots)
            self.req_to_token.write(req.req_to_token_row, req.kv_len, slots)
            req.kv_len += take
            budget -= take
            self.num_prefill_tokens += take
            if is_new:
                self.num_admitted += 1
                self.num_cached_prefill_tokens += req.cache_len
                if not req.scheduled_once:
                    req.cached_tokens = req.cache_len
                    req.scheduled_once = True
                admitted.append(req)
                req.status = ReqStatus.RUNNING
                self._admit_counter += 1
                req.admit_seq = self._admit_counter
                self.running.append(req)
                running_count += 1
            if take < remaining:
                break
        for req in admitted:
            self.waiting.remove(req)
        if not reqs:
            return None
        # NOTE: fewest new tokens first: attention cuts the batch into runs of similar shape
        # (ForwardBatch.segments); a GRPO group's samples that only compute their last prompt
        # token then do not pad to a whole prompt's queries.
        order = sorted(range(len(reqs)), key=lambda i: (ext[i], pre[i] + ext[i]))
        reqs, ext, pre = [reqs[i] for i in order], [ext[i] for i in order], [pre[i] for i in order]
        batch = ScheduledBatch(reqs, ext, pre, torch.cat([locs[i] for i in order]), is_prefill=True,
                               kv_indices=self._kv_indices(reqs, max(p + e for p, e in zip(pre, ext))))
        self._uncached = batch
        return batch

    def _kv_indices(self, reqs: list[Req], width: int) -> torch.Tensor:
        rows = torch.tensor([r.req_to_token_row for r in reqs], dtype=torch.int64)
        return self.req_to_token.gather(rows, width)

    def _schedule_decode(self) -> Optional[ScheduledBatch]:
        """One token for every running request whose prompt is computed. A request still in its
        chunked prefill is not decoded: its next chunk did not fit (this step had no prefill), and
        a decode would sample from a position inside its prompt. When nothing can decode, the newest
        running request is retracted so that the prefill of the others can go on."""
        if not self.running:
            return None
        retracted = False
        while True:
            ready = [r for r in self.running if r.kv_len >= r.seq_len - 1]
            if not ready:
                # NOTE: every running request is mid-prefill and none of their chunks fitted
                if not retracted and len(self.running) > 1:
                    self.retract(max(self.running, key=lambda r: r.admit_seq))
                return None   # the freed KV goes to the prefill of the next step
            # NOTE: the overlap schedule: a request whose last token is still being sampled and
            # certainly ends with it (max_new_tokens, the context) sits this step out
            ready = [r for r in ready if not _ends_with_pending_token(r)]
            if not ready:
                return None
            drafts = self._drafts(ready)
            slots = self._alloc(len(ready) + sum(map(len, drafts.values())))
            if slots is None and drafts:
                drafts = {}   # NOTE: a plain decode step before anyone is retracted (drafts never change outputs)
                slots = self._alloc(len(ready))
            if slots is not None:
                break
            if len(self.running) == 1:
                return None  # NOTE: cannot happen: requests that cannot fit alone are rejected up front
            self.retract(max(self.running, key=lambda r: r.admit_seq))
            retracted = True
        # NOTE: shortest first: attention cuts a decode batch into runs of similar length
        # (ForwardBatch.segments), so that short requests do not pad to the longest.
        self.num_decode_steps += 1
        reqs = sorted(ready, key=attrgetter("kv_len"))
        pre = [r.kv_len for r in reqs]
        rows = torch.tensor([r.req_to_token_row for r in reqs], dtype=torch.int64)
        # NOTE: a request's KV reaching its last known token means that token's successor is the
        # running forward's sample (the overlap schedule): this step feeds it, unseen
        pending = tuple(p == r.seq_len for p, r in zip(pre, reqs))
        pending = pending if any(pending) else ()
        if self.drafter is not None:
            assert not pending, "speculative decoding runs without the overlap schedule"
            return self._verify_batch(reqs, pre, rows, slots, drafts)
        self.req_to_token.append_one(rows, torch.tensor(pre, dtype=torch.int64), slots)
        for req in reqs:
            req.kv_len += 1
        kv_indices = self.req_to_token.gather(rows, pre[-1] + 1)
        return ScheduledBatch(reqs, [1] * len(reqs), pre, slots, is_prefill=False, kv_indices=kv_indices,
                              prefix_groups=self._prefix_groups(reqs), pending=pending)

    def _drafts(self, ready: list[Req]) -> dict[int, list[int]]:
        """The drafter's tokens per request uid (only requests it proposed for)."""
        if self.drafter is None:
            return {}
        return {r.uid: d for r, d in zip(ready, self.drafter.propose(ready, self.num_decode_steps)) if d}

    def _verify_batch(self, reqs: list[Req], pre: list[int], rows: torch.Tensor, slots: torch.Tensor,
                      drafts: dict[int, list[int]]) -> ScheduledBatch:
        """A decode step that feeds each request's last token and its drafts (speculative decoding;
        a request without drafts feeds its last token alone)."""
        if drafts:
            # NOTE: fewest fed tokens first, as a prefill step: attention cuts the batch into runs of
            # similar shape, so the requests without drafts do not pad to the drafting ones' queries
            order = sorted(range(len(reqs)), key=lambda i: (len(drafts.get(reqs[i].uid, ())), pre[i]))
            reqs, pre = [reqs[i] for i in order], [pre[i] for i in order]
            rows = rows[torch.tensor(order, dtype=torch.int64)]
        chain = [drafts.get(r.uid, []) for r in reqs]
        ext = [1 + len(d) for d in chain]
        off = 0
        for req, p, e in zip(reqs, pre, ext):
            self.req_to_token.write(req.req_to_token_row, p, slots[off:off + e])
            req.kv_len += e
            off += e
        kv_indices = self.req_to_token.gather(rows, max(p + e for p, e in zip(pre, ext)))
        return ScheduledBatch(reqs, ext, pre, slots, is_prefill=False, kv_indices=kv_indices, drafts=tuple(chain),
                              prefix_groups=() if drafts else self._prefix_groups(reqs))

    def truncate(self, req: Req, kv_len: int) -> None:
        """Gives back the KV of a running request's positions kv_len .. (a verify step's rejected
        drafts): their slots are freed (they are the request's own, never the prefix cache's)."""
        if kv_len >= req.kv_len:
            return
        assert kv_len >= req.cache_len, (req.rid, kv_len, req.cache_len)
        self.kv_pool.free(self.kv_slots(req)[kv_len:])
        req.kv_len = kv_len

    @staticmethod
    def _prefix_groups(reqs: list[Req]) -> tuple:
        """Requests holding the same prefix-cache node share the slots of its whole path: after
        their prefill each one's first cache_len slots are that path's (cache_unfinished)."""
        if len({id(r.last_node) for r in reqs}) == len(reqs):
            return ()   # NOTE: no two share a node (a batch of distinct prompts): one cheap pass
        nodes = [r.last_node if r.cache_len else None for r in reqs]
        shared = {node for node, count in Counter(nodes).items() if count > 1 and node is not None}
        by_node: dict[Any, list[int]] = {node: [] for node in shared}
        for i, node in enumerate(nodes):
            if node in by_node:
                by_node[node].append(i)
        return tuple((reqs[m[0]].cache_len, tuple(m)) for m in by_node.values())

    def retract(self, req: Req) -> None:
        """Moves a running request back to the front of the queue; its generated tokens stay."""
        if self.on_retract is not None:
            self.on_retract(req)  # e.g. save routing rows before the slots can be reused
        self.running.remove(req)
        self._release(req)
        req.status = ReqStatus.WAITING
        req.num_retractions += 1
        self.num_retractions += 1
        self.waiting.appendleft(req)

    def check_integrity(self) -> None:
        """Every used KV slot is held by exactly one owner: a running request or the prefix cache."""
        self.kv_pool.check_integrity()
        self.cache.check_integrity()
        owned: list[int] = []
        for req in self.running:
            owned.extend(self.kv_slots(req)[req.cache_len:].tolist())
        for req in self.waiting:
            assert req.kv_len == 0 and req.last_node is None and req.req_to_token_row is None, (
                f"waiting request {req.rid} holds KV")
        self.req_to_token.check_integrity([r.req_to_token_row for r in self.running])
        cached = self.cache.all_slots()
        assert len(owned) == len(set(owned)), "a KV slot is owned twice"
        assert not (set(owned) & cached), "a KV slot is owned by a request and the cache"
        assert len(owned) + len(cached) == self.kv_pool.used(), (
            f"slot leak: {len(owned)} request-owned + {len(cached)} cached != {self.kv_pool.used()} used")
        kv = getattr(self.drafter, "kv", None)   # a drafter's own KV (rollout/core/draft_kv.py)
        if kv is not None:
            kv.check_integrity([r.draft_state for r in self.running if r.draft_state is not None])


def _ends_with_pending_token(req: Req) -> bool:
    """Whether a request whose next token is still being sampled (its KV reaches its last known
    token) certainly ends with that token: it reaches max_new_tokens or its length limit."""
    n = req.seq_len
    return req.kv_len == n and (len(req.output_ids) + 1 >= req.params.max_new_tokens or n + 1 >= req.max_total_len)
