"""DP attention (dp_size worker processes, expert parallel MoE): outputs and routed experts equal
dp_size=1 and transformers, under uneven loads, mixed runners, abort/flush, and a crashing worker."""
import os
import random
import signal
import threading
import time

import pytest
import torch

from capture.capturer import GatherLayout
from oracle import hf_router_topk, same_sets
from rollout import EngineDeadError
from rollout.config import DEFAULT_MODEL_PATH
from rollout.exec.model_runner import DECODE, EAGER, PREFILL
from server_proc import pid_alive
from tiny_models import make_engine, random_prompts as prompts


GREEDY = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
BUCKETS = dict(decode_graph_batch_sizes=(1, 2, 4), prefill_graph_token_sizes=(16, 32), chunked_prefill_size=48)


def generate(engine, batch, params, ranks=None, **kw):
    return engine.generate(input_ids=batch, sampling_params=params, return_logprob=True, return_routed_experts=True,
                           routed_dp_rank=ranks, **kw)


def assert_same(outs, ref, path=None):
    assert len(outs) == len(ref)
    for out, r in zip(outs, ref):
        assert out.output_ids == r.output_ids
        diff = (torch.tensor(out.output_logprobs) - torch.tensor(r.output_logprobs)).abs().max().item()
        assert diff <= 1e-5, diff
        assert torch.equal(out.routed_experts, r.routed_experts)
        if path is not None:
            seq = out.prompt_ids + out.output_ids
            want = hf_router_topk(path, seq[:-1], out.routed_experts.shape[2], out.routed_experts.shape[1])
            assert same_sets(out.routed_experts, want)


def layouts(engine) -> list[GatherLayout]:
    per_rank = engine.recent_layouts()
    assert all(r == per_rank[0] for r in per_rank), "DP ranks disagree on a step's runner or layout"
    return per_rank[0]


@pytest.fixture(scope="module")
def qwen3(tiny_checkpoint):
    return tiny_checkpoint("qwen3_moe")


@pytest.fixture(scope="module")
def dp1(qwen3):
    with make_engine(qwen3, chunked_prefill_size=48) as engine:
        yield engine


def test_dp2_uneven_loads_match_dp1(qwen3, dp1):
    """Default suite: one rank idle while the other prefills, then uneven token counts; graph
    buckets and eager steps mixed; outputs and routing as dp_size=1 and transformers."""
    a = prompts(1, [5, 30, 60])                 # rank 0 only: rank 1 idle (60 > 48: chunked, eager)
    b = prompts(2, [7, 3, 21, 12])              # uneven: rank 0 gets 7 + 21, rank 1 gets 3 + 12
    b_ranks = [0, 1, 0, 1]
    with make_engine(qwen3, dp_size=2, **BUCKETS) as engine:
        outs_a = generate(engine, a, GREEDY, ranks=0)
        outs_b = generate(engine, b, GREEDY, ranks=b_ranks)
        steps = layouts(engine)
        engine.check_integrity()
        assert engine.flush_cache()
        loads = engine.loads()
    assert_same(outs_a, generate(dp1, a, GREEDY), qwen3)
    assert_same(outs_b, generate(dp1, b, GREEDY), qwen3)
    assert [row["dp_rank"] for row in loads] == [0, 1]
    runners = {s.runner for s in steps}
    assert runners == {DECODE, PREFILL, EAGER}
    assert any(s.token_counts[1] == 0 and s.token_counts[0] > 1 for s in steps)          # rank 1 idle
    assert any(0 < s.token_counts[0] != s.token_counts[1] > 0 for s in steps)           # uneven
    assert any(x.runner == PREFILL and y.runner == DECODE for x, y in zip(steps, steps[1:]))


def test_expert_shards_and_expert_weight_updates_match_dp1(qwen3):
    """Each rank holds only its experts; an update of some experts (per-expert names, on both
    ranks' shards) and of a whole layer's stacked experts lands in the right shards: dp_size 2
    then generates exactly what dp_size 1 does with the same update."""
    from oracle import hf_model

    donor = hf_model(str(qwen3)).state_dict()
    update = {k: v * 1.25 for k, v in donor.items() if ".layers.2.mlp.experts." in k}        # stacked
    for e in (1, 6):                                                                         # rank 0, rank 1
        for proj in ("gate_proj", "up_proj", "down_proj"):
            name = f"model.layers.1.mlp.experts.{e}.{proj}.weight"
            half = {"gate_proj": 0, "up_proj": 1}.get(proj)
            src = donor["model.layers.1.mlp.experts.down_proj"][e] if half is None else \
                donor["model.layers.1.mlp.experts.gate_up_proj"][e].chunk(2)[half]
            update[name] = -src
    batch = prompts(6, [9, 14, 5, 20])
    cpus = tuple(sorted(os.sched_getaffinity(0))[:2])   # each rank pinned to a CPU of its own (cpu_affinity)
    pinned = cpus if len(cpus) == 2 else ()
    with make_engine(qwen3, dp_size=2, cpu_affinity=pinned, **BUCKETS) as engine:
        for pid, cpu in zip(engine.engine_pids(), pinned):
            with open(f"/proc/{pid}/status") as f:
                assert f"Cpus_allowed_list:\t{cpu}\n" in f.read()
        loads = engine.loads()
        before = generate(engine, batch, GREEDY, ranks=[0, 1, 0, 1])
        assert engine.swap_weights(update, weight_version="w2") == len(update)
        outs = generate(engine, batch, GREEDY, ranks=[0, 1, 0, 1])
    assert [ld["experts_held"] for ld in loads] == [[0, 4], [4, 8]]
    with make_engine(qwen3, **BUCKETS) as engine:
        full = engine.loads()[0]
        assert_same(before, generate(engine, batch, GREEDY))
        engine.swap_weights(update, weight_version="w2")
        assert_same(outs, generate(engine, batch, GREEDY))
    assert full["experts_held"] == [0, 8]
    assert [ld["expert_weight_bytes"] * 2 for ld in loads] == [full["expert_weight_bytes"]] * 2
    assert any(a.output_ids != b.output_ids for a, b in zip(before, outs))


@pytest.mark.slow
def test_dp3_mixed_runners_and_least_load_dispatch(qwen3, dp1):
    rng = random.Random(3)
    long_ = prompts(3, [60])                     # rank 0: chunked prefill 24 + 24 + 12
    short = prompts(4, [4, 9, 13, 2, 6])         # rank 1 decodes meanwhile; rank 2 idle
    sampled = {"temperature": 1.0, "top_p": 0.9, "max_new_tokens": 6, "ignore_eos": True, "sampling_seed": 17,
               "n": 3}
    group = prompts(5, [11, 19])
    with make_engine(qwen3, dp_size=3, decode_graph_batch_sizes=(2, 8), prefill_graph_token_sizes=(16,),
                     chunked_prefill_size=24) as engine:
        params = [dict(GREEDY, max_new_tokens=rng.randint(3, 12)) for _ in range(6)]
        outs = generate(engine, long_ + short, params, ranks=[0, 1, 1, 1, 1, 1])
        steps = layouts(engine)
        before = [r["prompt_tokens"] for r in engine.stats()["dp_ranks"]]
        outs_n = generate(engine, group, sampled)            # least load; each prompt's n stay together
        assert engine._client._load == [0, 0, 0]             # the placement counts: nothing left in flight
        engine.check_integrity()
        after = [r["prompt_tokens"] for r in engine.stats()["dp_ranks"]]
    assert_same(outs, generate(dp1, long_ + short, params), qwen3)
    assert_same(outs_n, generate(dp1, group, sampled), qwen3)
    assert all(s.token_counts[2] == 0 for s in steps)
    # NOTE: which step picks up which rank's requests is timing (each rank's loop drains its own
    # inbox), so no exact mixed composition is asserted; the ranks agree on every step (layouts())
    assert {s.runner for s in steps} == {DECODE, PREFILL, EAGER}
    # the n samples of a prompt ran on one rank (its prompt was prefilled once there)
    added = [y - x for x, y in zip(before, after)]
    assert sorted(x for x in added if x) == sorted([3 * 11, 3 * 19])


@pytest.mark.slow
def test_rank1_prefill_rows_before_and_after_decode_runner(qwen3, dp1):
    """Failure class (1): DP rank 1, the prefill runner executing, with the decode runner (a) never
    run yet and (b) run before with another batch size: rank 1's rows are right in every case."""
    first = prompts(6, [20])
    with make_engine(qwen3, dp_size=2, decode_graph_batch_sizes=(1, 2, 4), prefill_graph_token_sizes=(16, 32),
                     chunked_prefill_size=16) as engine:
        # (a) one prefill forward only (max_new_tokens=1: the token comes from prefill logits)
        out_a = generate(engine, first, dict(GREEDY, max_new_tokens=1), ranks=1)
        steps = layouts(engine)
        assert steps and all(s.runner == PREFILL for s in steps)
        assert steps[-1].token_counts == (0, 4) and steps[0].token_counts == (0, 16)
        # decode runner with batch bucket 4 (rank 1: 3 requests, rank 0: 1)
        mid = prompts(7, [5, 8, 6, 9])
        out_mid = generate(engine, mid, dict(GREEDY, max_new_tokens=4), ranks=[1, 1, 1, 0])
        # (b) rank 1 prefills a chunked 40-token prompt while rank 0 decodes 2 requests (batch 2)
        late = prompts(8, [3, 4, 40])
        params = [dict(GREEDY, max_new_tokens=12), dict(GREEDY, max_new_tokens=12), dict(GREEDY, max_new_tokens=1)]
        out_b = generate(engine, late, params, ranks=[0, 0, 1])
        steps = layouts(engine)
        engine.check_integrity()
    decode_steps = [s for s in steps if s.runner == DECODE]
    assert any(s.padded_extent == 4 for s in decode_steps)
    assert any(s.runner == PREFILL and s.token_counts == (2, 16) for s in steps)
    assert_same(out_a, generate(dp1, first, dict(GREEDY, max_new_tokens=1)), qwen3)
    assert_same(out_mid, generate(dp1, mid, dict(GREEDY, max_new_tokens=4)), qwen3)
    assert_same(out_b, generate(dp1, late, params), qwen3)


@pytest.mark.slow
def test_abort_flush_and_integrity_reach_every_rank(qwen3):
    batch = prompts(9, [6, 10])
    with make_engine(qwen3, dp_size=2, **BUCKETS) as engine:
        stream = engine.generate(input_ids=batch, sampling_params=dict(GREEDY, max_new_tokens=500),
                                 return_routed_experts=True, stream=True, rid=["x0", "x1"], routed_dp_rank=[0, 1])
        finals, seen = {}, 0
        for chunk in stream:
            seen += 1
            if seen == 6:
                assert not engine.flush_cache()            # requests in flight on both ranks
                assert engine.abort_all() == 2
            if chunk.finished:
                finals[chunk.rid] = chunk.output
        assert set(finals) == {"x0", "x1"}
        engine.check_integrity()
        assert engine.flush_cache()
        single = engine.generate(input_ids=batch[:1], sampling_params=dict(GREEDY, max_new_tokens=300),
                                 return_routed_experts=True, stream=True, rid="y", routed_dp_rank=1)
        for i, chunk in enumerate(single):
            if i == 3:
                assert engine.abort("y")
        last = chunk.output
        engine.check_integrity()
    for out in list(finals.values()) + [last]:
        assert out.finish_reason == "abort" and 0 < len(out.output_ids) < 300
        seq = out.prompt_ids + out.output_ids
        want = hf_router_topk(qwen3, seq[:-1], out.routed_experts.shape[2], out.routed_experts.shape[1])
        assert same_sets(out.routed_experts, want)


@pytest.mark.slow
def test_killed_rank_under_load_returns_partials_and_stops_cleanly(qwen3):
    """kill -9 of DP rank 1 mid-run: rank 0's requests come back as aborts with their exact partial
    tokens and routing (the message names the dead rank), rank 1's raise EngineDeadError; all
    within 5 s; no engine process is left behind."""
    engine = make_engine(qwen3, dp_size=2)
    victim, survivor = engine.engine_pids()[1], engine.engine_pids()[0]
    items: dict = {}
    ends: list = []
    done = threading.Event()

    def sink(item):
        items.setdefault(getattr(item, "rid", "error"), []).append(item)
        if isinstance(item, BaseException) or item.finished:
            ends.append(item)
            if len(ends) == 4:
                done.set()

    engine.submit(sink, input_ids=prompts(10, [5, 6, 7, 8]), sampling_params=dict(GREEDY, max_new_tokens=500),
                  rid=["a", "b", "c", "d"], routed_dp_rank=[0, 1, 0, 1], return_routed_experts=True, stream=True)
    while len(items.get("a", [])) < 5 or len(items.get("b", [])) < 5:
        time.sleep(0.01)
    os.kill(victim, signal.SIGKILL)
    t0 = time.monotonic()
    assert done.wait(5.0), items.keys()
    assert time.monotonic() - t0 < 5.0
    assert not engine.is_alive
    for rid in ("a", "c"):                   # rank 0: partial outputs
        out = items[rid][-1].output
        assert out.finish_reason == "abort" and "DP rank 1 died" in out.finish_info["message"]
        seq = out.prompt_ids + out.output_ids
        assert 0 < len(out.output_ids) < 500 and out.routed_experts.shape[0] == len(seq) - 1
        want = hf_router_topk(qwen3, seq[:-1], out.routed_experts.shape[2], out.routed_experts.shape[1])
        assert same_sets(out.routed_experts, want)
    assert isinstance(items["error"][0], EngineDeadError) and len(items["error"]) == 2   # rank 1's b and d
    with pytest.raises(EngineDeadError, match="DP rank 1"):
        engine.generate(input_ids=[[5, 6]])
    engine.shutdown()
    deadline = time.monotonic() + 10
    while pid_alive(survivor) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(survivor)


@pytest.mark.slow
def test_killed_idle_rank_is_noticed_at_once(qwen3):
    engine = make_engine(qwen3, dp_size=2)
    os.kill(engine.engine_pids()[0], signal.SIGKILL)
    t0 = time.monotonic()
    while engine.is_alive:
        assert time.monotonic() - t0 < 5.0
        time.sleep(0.01)
    with pytest.raises(EngineDeadError, match="DP rank 0 died"):
        engine.generate(input_ids=[[5, 6]])
    engine.shutdown()


def engine_ranks(parent_pid: int) -> dict[int, int]:
    """rank -> pid of the engine processes a front end started (read from /proc)."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if ppid == parent_pid and b"rollout.core.engine_proc" in argv:
            out[int(argv[argv.index(b"rollout.core.engine_proc") + 2])] = int(entry)
    return out


@pytest.mark.slow
def test_server_with_a_dead_rank_fails_health_and_exits_nonzero(qwen3):
    """rollout-serve --dp-size 2, rank 1 killed under load: the in-flight requests are answered
    (rank 0's as aborts with partial output, rank 1's with 503), /health fails, and the server
    exits non-zero so that its supervisor restarts it: no process left answering 503."""
    import httpx

    from server_proc import ServerProcess

    srv = ServerProcess(["--model-path", str(qwen3), "--tokenizer-path", DEFAULT_MODEL_PATH, "--dtype", "float32",
                         "--dp-size", "2", "--enable-return-routed-experts"]).start()
    try:
        ranks = engine_ranks(srv._server.proc.pid)
        assert sorted(ranks) == [0, 1]
        results: list = []

        def one(rank: int) -> None:
            body = {"input_ids": [5, 6, 7], "routed_dp_rank": rank, "return_routed_experts": True,
                    "sampling_params": dict(GREEDY, max_new_tokens=500)}
            r = httpx.post(srv.url + "/generate", json=body, timeout=60)
            results.append((rank, r.status_code, r.json()))

        threads = [threading.Thread(target=one, args=(r,)) for r in (0, 1, 0, 1)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while httpx.get(srv.url + "/v1/loads").json()["loads"][1]["num_running_reqs"] < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.5)
        os.kill(ranks[1], signal.SIGKILL)
        t0 = time.monotonic()
        for t in threads:
            t.join(10)
        assert time.monotonic() - t0 < 5.0 and len(results) == 4
        for rank, status, body in results:
            if rank == 0:
                meta = body["meta_info"]
                assert status == 200 and meta["finish_reason"]["type"] == "abort"
                assert "DP rank 1 died" in meta["finish_reason"]["message"] and meta["completion_tokens"] > 0
            else:
                assert status == 503, body
        try:
            assert httpx.get(srv.url + "/health", timeout=2).status_code != 200
        except httpx.HTTPError:
            pass   # already gone
        srv._server.proc.wait(15)
        assert srv._server.proc.returncode not in (0, None)
        assert not any(pid_alive(p) for p in ranks.values() if p != ranks[1])
    finally:
        srv.stop()
