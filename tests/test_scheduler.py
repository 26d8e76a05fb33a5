"""The scheduler on random workloads under KV pressure (no model: sampled tokens are random):
a decode step only ever takes requests whose prompt is computed, and every request finishes."""
from __future__ import annotations

import os
import random

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout.batch.kv_pool import KVPool
from rollout.core.radix_cache import RadixCache
from rollout.core.request import Req, ReqStatus
from rollout.core.scheduler import Scheduler
from rollout.core.shared_prefixes import SharedPrefixes
from rollout.sampling_params import SamplingParams


def _drive(seed: int, num_slots: int, chunk: int, n_reqs: int, cache: bool, arrivals: int) -> dict:
    """Runs a seeded workload to the end: n_reqs requests queued at once, `arrivals` more added
    one per step later on. Returns counts; asserts each step's invariants."""
    rng = random.Random(seed)
    pool = KVPool(num_slots=num_slots, num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32)
    sched = Scheduler(kv_pool=pool, cache=RadixCache(pool, enabled=cache), max_running_requests=16,
                      prefill_token_budget=chunk, context_length=num_slots + 16)

    def make(uid: int) -> Req:
        new = rng.randint(1, 12)
        prompt = [rng.randrange(3, 20) for _ in range(rng.randint(1, max(1, num_slots - new - 1)))]
        return Req(uid=uid, rid=str(uid), prompt_ids=prompt, params=SamplingParams(max_new_tokens=new), seed=uid)

    reqs = [make(i) for i in range(n_reqs + arrivals)]
    for req in reqs[:n_reqs]:
        sched.add(req)
    later = reqs[n_reqs:]
    counts = {"decode_steps": 0, "retractions": 0}
    for _ in range(20000):
        if later and rng.random() < 0.3:
            sched.add(later.pop(0))
        batch = sched.schedule()
        if batch is None:
            if not sched.has_work() and not later:
                break
            assert later or sched.has_work()
            if not later:
                # NOTE: nothing scheduled while work remains is allowed only once in a row (a retraction)
                batch = sched.schedule()
                assert batch is not None, "the scheduler stalled with work left"
            else:
                continue
        if not batch.is_prefill:
            counts["decode_steps"] += 1
            for req, pre in zip(batch.reqs, batch.prefix_lens):
                assert pre == req.seq_len - 1, (
                    f"request {req.rid} decoded at position {pre} of a {req.seq_len}-token sequence "
                    "(its prompt is not computed: the token would come from inside the prompt)")
        for i, req in enumerate(batch.reqs):
            if batch.is_prefill:
                sched.cache_unfinished(req)
            if batch.completes(i):
                req.output_ids.append(rng.randrange(3, 20))
                if len(req.output_ids) >= req.params.max_new_tokens:
                    sched.remove(req)
                    req.status = ReqStatus.FINISHED
        sched.check_integrity()
    assert not sched.has_work() and not later, "the workload did not finish"
    assert all(len(r.output_ids) == r.params.max_new_tokens for r in reqs)
    counts["retractions"] = sched.num_retractions
    return counts


def test_a_request_mid_chunked_prefill_is_not_decoded_under_kv_pressure():
    """The case that broke: small chunks, a tight pool, requests arriving while others decode. A
    request whose next chunk does not fit must wait (or be retracted), not take a decode step from
    the middle of its prompt."""
    counts = [_drive(seed, num_slots=64, chunk=4, n_reqs=6, cache=seed % 2 == 0, arrivals=6) for seed in range(12)]
    assert sum(c["retractions"] for c in counts) > 0 and all(c["decode_steps"] for c in counts)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), num_slots=st.integers(24, 160), chunk=st.integers(1, 64),
       n_reqs=st.integers(1, 10), cache=st.booleans(), arrivals=st.integers(0, 8))
def test_random_workloads_decode_only_computed_prompts_and_finish(seed, num_slots, chunk, n_reqs, cache, arrivals):
    _drive(seed, num_slots, chunk, n_reqs, cache, arrivals)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**16), n=st.integers(1, 12), min_shared=st.integers(1, 8))
def test_shared_prefixes_answer_as_a_common_prefix_scan_of_every_pair(seed, n, min_shared):
    """The index answers what the definition says: some added request (same namespace) holds the
    candidate's first cache_len + min_shared tokens."""
    rng = random.Random(seed)
    base = [rng.randrange(3, 6) for _ in range(16)]

    def make(uid: int) -> Req:
        prompt = base[:rng.randint(0, 16)] + [rng.randrange(3, 6) for _ in range(rng.randint(0, 6))]
        req = Req(uid=uid, rid=str(uid), prompt_ids=prompt or [3], params=SamplingParams(max_new_tokens=4), seed=uid,
                  output_ids=[rng.randrange(3, 6) for _ in range(rng.randint(0, 3))])
        req.cache_ns = rng.choice([0, 0, 0, 1000])
        req.cache_len = rng.randint(0, 4)
        return req

    index, added = SharedPrefixes(min_shared), []
    for uid in range(n):
        req = make(uid)
        want = any(o.cache_ns == req.cache_ns and len(os.path.commonprefix([req.fill_ids, o.fill_ids]))
                   - req.cache_len >= min_shared for o in added)
        assert index.shares(req) == want
        if rng.random() < 0.7:
            index.add(req)
            added.append(req)


def test_samples_of_one_prompt_compute_it_once():
    """n requests with one uncached prompt: the first computes it, the others wait a step and then
    find all of it but the last token in the prefix cache."""
    pool = KVPool(num_slots=512, num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32)
    sched = Scheduler(kv_pool=pool, cache=RadixCache(pool, enabled=True), max_running_requests=16,
                      prefill_token_budget=256, context_length=512)
    prompt = list(range(3, 43))
    reqs = [Req(uid=i, rid=str(i), prompt_ids=list(prompt), params=SamplingParams(max_new_tokens=2), seed=i)
            for i in range(4)]
    for req in reqs:
        sched.add(req)
    first = sched.schedule()
    assert [r.uid for r in first.reqs] == [0] and first.extend_lens == [40]
    sched.cache_unfinished(reqs[0])
    second = sched.schedule()
    assert sorted(r.uid for r in second.reqs if r.uid) == [1, 2, 3]
    assert all(e == 1 for r, e in zip(second.reqs, second.extend_lens) if r.uid)
