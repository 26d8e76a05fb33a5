"""--schedule-policy (SGLang's flag and names): the order in which prefill steps admit waiting
requests (fcfs, lpm, lof, random), over a real scheduler and prefix cache; and a request's
outputs do not depend on the policy (deterministic mode: bitwise)."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from capture.codec import decode_routed_experts
from rollout import Rollout
from rollout.batch.kv_pool import KVPool
from rollout.config import DEFAULT_MODEL_PATH, EngineConfig
from rollout.core.radix_cache import RadixCache
from rollout.core.request import Req
from rollout.core.schedule_policy import LPM_MAX_WAITING, SchedulePolicy
from rollout.core.scheduler import Scheduler
from rollout.sampling_params import SamplingParams
from rollout.server.args import ServerArgs
from server_proc import ServerProcess

pytestmark = pytest.mark.timeout(600)


def _scheduler(policy: str, running: int = 1, seed: int = 0) -> Scheduler:
    pool = KVPool(num_slots=4096, num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32)
    return Scheduler(kv_pool=pool, cache=RadixCache(pool), max_running_requests=running,
                     prefill_token_budget=4096, context_length=1024, policy=SchedulePolicy(policy, seed=seed))


def _req(uid: int, prompt: list[int], new: int = 8) -> Req:
    return Req(uid=uid, rid=f"r{uid}", prompt_ids=prompt, params=SamplingParams(max_new_tokens=new), seed=uid)


def _admitted(sched: Scheduler, *, done: bool = True) -> list[int]:
    """The uids of the next prefill step (done: they finish at once, giving back their places)."""
    batch = sched.schedule()
    assert batch is not None and batch.is_prefill
    if done:
        for req in batch.reqs:
            sched.remove(req)
    return [r.uid for r in batch.reqs]


def _cache_prompt(sched: Scheduler, prompt: list[int]) -> None:
    slots = sched.kv_pool.alloc(len(prompt))
    assert sched.cache.insert(prompt, slots) == 0


def test_fcfs_admits_in_arrival_order_and_lof_the_longest_output_first():
    for policy, want in (("fcfs", [0, 1, 2, 3]), ("lof", [2, 0, 3, 1])):
        sched = _scheduler(policy)
        for uid, new in enumerate((64, 8, 200, 64)):
            sched.add(_req(uid, [10 + uid] * 20, new))
        order = []
        while sched.waiting:
            order += _admitted(sched)
        assert order == want, policy


def test_lpm_admits_the_longest_cached_prefix_first_and_is_fcfs_past_128_waiting():
    shared = list(range(100, 164))
    sched = _scheduler("lpm")
    _cache_prompt(sched, shared)
    # uid 0: no hit; uid 1: 16 tokens; uid 2: all 64 (then its own tail); uid 3: 32
    prompts = [[7] * 40, shared[:16] + [5] * 30, shared + [6] * 4, shared[:32] + [8] * 9]
    for uid, p in enumerate(prompts):
        sched.add(_req(uid, p))
    assert [sched.cache.match_len(p) for p in prompts] == [0, 16, 64, 32]
    order = []
    while sched.waiting:
        order += _admitted(sched)
    assert order == [2, 3, 1, 0]
    # a long queue: matching every prompt each step would cost more than it saves (SGLang's rule)
    sched = _scheduler("lpm")
    _cache_prompt(sched, shared)
    for uid in range(LPM_MAX_WAITING + 1):
        sched.add(_req(uid, [7] * 20 if uid == 0 else shared + [uid]))
    assert _admitted(sched) == [0]


def test_match_len_leaves_the_tree_as_it_was():
    sched = _scheduler("lpm")
    _cache_prompt(sched, list(range(50)))
    before = (len(sched.cache._nodes()), sched.cache.evictable_size())
    assert sched.cache.match_len(list(range(20)) + [999]) == 20      # NOTE: mid-edge: no split
    assert sched.cache.match_len(list(range(50)) + [1, 2]) == 50
    assert sched.cache.match_len([999]) == 0
    assert (len(sched.cache._nodes()), sched.cache.evictable_size()) == before


def test_random_is_a_seeded_shuffle():
    def order(seed: int) -> list[int]:
        sched = _scheduler("random", seed=seed)
        for uid in range(8):
            sched.add(_req(uid, [20 + uid] * 10))
        out = []
        while sched.waiting:
            out += _admitted(sched)
        return out

    runs = {seed: order(seed) for seed in (0, 1, 2)}
    assert order(1) == runs[1]                                        # the same seed, the same order
    assert all(sorted(o) == list(range(8)) for o in runs.values())
    assert len({tuple(o) for o in runs.values()} | {tuple(range(8))}) > 2


def test_a_policy_keeps_the_admission_hold_of_a_weight_update():
    # NOTE: a request that arrived after hold_admission waits, wherever the policy puts it
    sched = _scheduler("lof", running=4)
    sched.add(_req(0, [3] * 10, new=8))
    sched.hold_admission()
    sched.add(_req(1, [4] * 10, new=500))
    sched.add(_req(2, [5] * 10, new=2))
    assert _admitted(sched, done=False) == [0]
    sched.release_admission()
    assert sorted(_admitted(sched)) == [1, 2]


def test_unsupported_policies_are_refused_by_name():
    for bad in ("dfs-weight", "priority", "routing-key", "LPM", None):
        with pytest.raises(ValueError, match=r"^schedule_policy must be one of .*dfs-weight"):
            EngineConfig(schedule_policy=bad)
    assert ServerArgs.from_cli(["--schedule-policy", "lpm"]).engine.schedule_policy == "lpm"


def test_outputs_do_not_depend_on_the_policy():
    """Deterministic mode, 4 running places for 12 requests (shared prompts, varied lengths): each
    policy admits them in another order, and every request's tokens, logprobs and routing are
    bitwise the same."""
    prompts = [[11, 57, 203, 9, 88] * 6, [3, 4, 5] * 12, [400, 401] * 20]
    inputs = [p for p in prompts for _ in range(4)]
    params = [{"temperature": 1.0, "max_new_tokens": 6 + 5 * (i % 5), "ignore_eos": True, "sampling_seed": i}
              for i in range(len(inputs))]
    results = {}
    for policy, exact in (("fcfs", True), ("lpm", True), ("lof", True), ("random", True), ("fcfs", False),
                          ("lof", False)):
        with Rollout(DEFAULT_MODEL_PATH, schedule_policy=policy, max_running_requests=4, dtype="float32",
                     enable_deterministic_inference=exact, enable_return_routed_experts=True) as engine:
            outs = engine.generate(input_ids=inputs, sampling_params=params, return_logprob=True,
                                   return_routed_experts=True)
        results[policy, exact] = [(o.output_ids, o.output_logprobs, o.routed_experts.numpy().tobytes())
                                  for o in outs]
    for policy in ("lpm", "lof", "random"):
        assert results[policy, True] == results["fcfs", True], policy
    # NOTE: the control: the orders do make other batches (the default kernels' logprobs move in
    # their last bits with the batch)
    assert [o[1] for o in results["lof", False]] != [o[1] for o in results["fcfs", False]]


def test_lpm_through_rollout_serve_gives_each_sample_what_the_python_api_gives():
    """slime's GRPO traffic: every sample of every prompt its own /generate (sampling_seed,
    logprobs, routing), all sent at once to `rollout-serve --schedule-policy lpm` with 4 running
    places, so the prefix-cache order decides who runs. Each sample's tokens, logprobs and
    routing are bitwise the Python API's (fcfs), deterministic mode."""
    prompts = [[11, 57, 203, 9, 88] * 8, [3, 4, 5] * 14, [400, 401] * 21, [77] * 30]
    samples = [(p, {"temperature": 1.0, "max_new_tokens": 5 + 3 * (i % 4), "ignore_eos": True, "sampling_seed": i})
               for i, p in enumerate(q for q in prompts for _ in range(4))]
    common = {"max_running_requests": 4, "dtype": "float32", "enable_deterministic_inference": True,
              "enable_return_routed_experts": True}
    with Rollout(DEFAULT_MODEL_PATH, **common) as engine:
        want = engine.generate(input_ids=[ids for ids, _ in samples], sampling_params=[sp for _, sp in samples],
                               return_logprob=True, return_routed_experts=True)
    flags = ["--model-path", DEFAULT_MODEL_PATH, "--schedule-policy", "lpm", "--max-running-requests", "4",
             "--dtype", "float32", "--enable-deterministic-inference", "--enable-return-routed-experts"]
    with ServerProcess(flags) as srv, httpx.Client(base_url=srv.url, timeout=300) as client:
        assert client.get("/server_info").json()["schedule_policy"] == "lpm"
        info = client.get("/model_info").json()

        def one(sample):
            ids, sp = sample
            r = client.post("/generate", json={"input_ids": ids, "sampling_params": sp, "return_logprob": True,
                                               "return_routed_experts": True})
            assert r.status_code == 200, r.text
            return r.json()["meta_info"]

        with ThreadPoolExecutor(len(samples)) as pool:
            got = list(pool.map(one, samples))
    for meta, out in zip(got, want):
        assert [t for _, t, _ in meta["output_token_logprobs"]] == out.output_ids
        assert [lp for lp, _, _ in meta["output_token_logprobs"]] == out.output_logprobs
        routing = decode_routed_experts(meta["routed_experts"], "int32", num_layers=info["num_hidden_layers"],
                                        top_k=info["num_experts_per_tok"])
        assert torch.equal(routing, out.routed_experts.to(torch.int32))
