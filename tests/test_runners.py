"""Static-shape runners (dp_size=1), graph-capture profiling names, capture-buffer sizing."""
import json
import os
import random
import re

import pytest
import torch
from attention_cases import slot_table
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from core_driver import CoreDriver
from capture.buffer_sizing import ForwardShapeLimits, capture_buffer_rows
from capture.capturer import GatherLayout, RoutedExpertsBuffer, RoutedExpertsCapturer
from oracle import hf_router_topk, same_sets
from rollout.config import DEFAULT_MODEL_PATH, EngineConfig
from rollout.core.engine_core import EngineCore
from rollout.batch.kv_pool import SINK_SLOT, KVPool
from rollout.exec.model_runner import DECODE, EAGER, PREFILL, ModelRunner, RankShape, RunnerPlan
from rollout.batch.forward_batch import ForwardBatch
from rollout.models import load_model
from rollout.models.moe.experts import FusedExperts
from rollout.exec.runners.piecewise_backend import PiecewiseBackend
from rollout.core.radix_cache import RadixCache
from rollout.core.request import Req, ReqStatus
from rollout.sampling_params import SamplingParams
from rollout.core.scheduler import Scheduler
from tiny_models import make_engine, random_prompts as prompts

GREEDY = {"temperature": 0.0, "max_new_tokens": 10, "ignore_eos": True}
BUCKETS = dict(decode_graph_batch_sizes=(1, 2, 4), prefill_graph_token_sizes=(16, 32), chunked_prefill_size=48)


def assert_same_outputs(outs, ref, atol=1e-5):
    for out, r in zip(outs, ref, strict=True):
        assert out.output_ids == r.output_ids
        diff = (torch.tensor(out.output_logprobs) - torch.tensor(r.output_logprobs)).abs().max().item()
        assert diff <= atol, diff
        assert torch.equal(out.routed_experts, r.routed_experts)


def check_rows(path, out):
    seq = out.prompt_ids + out.output_ids
    ref = hf_router_topk(path, seq[:-1], out.routed_experts.shape[2], out.routed_experts.shape[1])
    assert same_sets(out.routed_experts, ref)


# ---- static-shape runners against eager ------------------------------------------------------

def test_static_runners_match_eager_and_pad_only_into_sink(tiny_checkpoint):
    path = tiny_checkpoint("qwen3_moe")
    # 1..3-token prompts, 9..31 (prefill buckets), 40..90 (chunked at 48: eager and bucket chunks);
    # 7 requests decode through the prefill runner (batch > 4) and then decode buckets 4, 2, 1
    # round 1: 191 prompt tokens in chunks of 48 (eager); 7 requests decode through the prefill
    # runner (batch > 4), then through decode buckets 4, 2, 1. Round 2: a 25-token prefill (bucket 32).
    rounds = [(prompts(1, [3, 9, 17, 31, 40, 90, 1]), [dict(GREEDY, max_new_tokens=m) for m in (12, 3, 6, 9, 14, 5, 2)]),
              (prompts(2, [25]), [GREEDY])]
    with make_engine(path, chunked_prefill_size=48) as engine:
        ref = [o for batch, params in rounds for o in engine.generate(
            input_ids=batch, sampling_params=params, return_logprob=True, return_routed_experts=True)]
    with make_engine(path, client="inproc", **BUCKETS) as engine:
        outs = [o for batch, params in rounds for o in engine.generate(
            input_ids=batch, sampling_params=params, return_logprob=True, return_routed_experts=True)]
        engine.check_integrity()
        stats = engine.stats()

        def kv_outside_allocated(core):
            # slots are handed out from 1 upwards (freed ones first again), so none above the
            # number of tokens ever given a slot was ever allocated
            high = core.stats["prompt_tokens"] + core.stats["generated_tokens"]
            k = core.kv_pool.k_buffers[0]
            assert SINK_SLOT not in core.cache.all_slots()     # the sink is never handed out
            return (k[high + 1:].abs().sum().item(), k[SINK_SLOT].abs().sum().item(),
                    [(runner, extent) for runner, _, extent in core.recent_layouts()])

        untouched, sink, layouts = engine.debug(kv_outside_allocated)
    assert_same_outputs(outs, ref)
    for out in outs:
        check_rows(path, out)
    assert stats["forwards_decode_graph"] > 0 and stats["forwards_prefill_graph"] > 0 and stats["forwards_eager"] > 0
    # every padding token wrote its KV into the sink slot and nowhere else
    assert untouched == 0 and sink > 0
    assert {(DECODE, 1), (DECODE, 2), (DECODE, 4), (PREFILL, 16), (PREFILL, 32), (EAGER, None)} <= set(layouts)


def _run_core(core, batch, params):
    driver = CoreDriver(core)
    for i, (ids, p) in enumerate(zip(batch, params)):
        driver.add(Req(uid=i, rid=str(i), prompt_ids=ids, params=SamplingParams(**p), seed=i, return_logprob=True,
                       return_routed_experts=True, max_total_len=core.context_length))
    driver.run()
    core.check_integrity()
    return [driver.outputs[str(i)] for i in range(len(batch))]


def test_static_attention_grid_matches_trimmed(tiny_checkpoint):
    """The decode runner's full static grid (what a CUDA graph replays) gives the trimmed grid's outputs."""
    path = tiny_checkpoint("olmoe")
    cfg = EngineConfig(model_path=str(path), tokenizer_path=DEFAULT_MODEL_PATH, dtype="float32",
                       enable_return_routed_experts=True, decode_graph_batch_sizes=(2, 4), context_length=96)
    batch = prompts(2, [5, 30, 11])
    params = [dict(GREEDY, max_new_tokens=8)] * 3
    trimmed = _run_core(EngineCore(cfg), batch, params)
    core = EngineCore(cfg)
    core.runner = ModelRunner(model=core.model, kv_pool=core.kv_pool, device=core.device,
                              limits=core.forward_shape_limits, capture_buffer=core.capturer.buffer,
                              seq_capacity=core.context_length, static_grid=True)
    assert core.runner.runners[DECODE].inputs[4].static_grid
    static = _run_core(core, batch, params)
    assert core.runner.counts[DECODE] > 0
    assert_same_outputs(static, trimmed)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3", "glm4_moe"])   # GQA, MLA, partial rotary
def test_cuda_graph_decode_matches_eager(tiny_checkpoint, arch):
    """On a GPU the decode buckets replay CUDA graphs (static grid, dense MoE path)."""
    path = tiny_checkpoint(arch)
    batch = prompts(3, [4, 19, 33])
    with make_engine(path, device="cuda") as engine:
        ref = engine.generate(input_ids=batch, sampling_params=GREEDY, return_logprob=True, return_routed_experts=True)
    with make_engine(path, device="cuda", decode_graph_batch_sizes=(1, 2, 4)) as engine:
        assert engine.runner_report()[0][DECODE]["uses_graphs"]
        outs = engine.generate(input_ids=batch, sampling_params=GREEDY, return_logprob=True, return_routed_experts=True)
        engine.check_integrity()
        assert engine.stats()["forwards_decode_graph"] > 0
    for out, r in zip(outs, ref):
        assert out.output_ids == r.output_ids and torch.equal(out.routed_experts, r.routed_experts)
        assert max(abs(a - b) for a, b in zip(out.output_logprobs, r.output_logprobs)) < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3", "glm4_moe"])   # GQA, MLA, partial rotary
def test_cuda_graph_prefill_pieces_match_eager(tiny_checkpoint, arch):
    """On a GPU the prefill buckets replay one CUDA graph per piece between the attention cores."""
    path = tiny_checkpoint(arch)
    batch = prompts(3, [4, 19, 33, 7, 12])
    with make_engine(path, device="cuda") as engine:
        ref = engine.generate(input_ids=batch, sampling_params=GREEDY, return_logprob=True, return_routed_experts=True)
    with make_engine(path, device="cuda", prefill_graph_token_sizes=(16, 64), decode_graph_batch_sizes=(8,),
                     chunked_prefill_size=32) as engine:
        graphs = engine.runner_report()[0][PREFILL]["graphs"]
        assert sorted(int(k.strip("(").split(",")[0]) for k in graphs) == [16, 64]
        assert set(graphs.values()) == {engine.info.num_hidden_layers + 1}
        outs = engine.generate(input_ids=batch, sampling_params=GREEDY, return_logprob=True, return_routed_experts=True)
        engine.check_integrity()
        stats = engine.stats()
        assert stats["forwards_prefill_graph"] > 0 and stats["forwards_decode_graph"] > 0
    for out, r in zip(outs, ref):
        assert out.output_ids == r.output_ids and torch.equal(out.routed_experts, r.routed_experts)
        assert max(abs(a - b) for a, b in zip(out.output_logprobs, r.output_logprobs)) < 1e-4


@pytest.mark.parametrize("arch,overrides", [("qwen3_moe", {}), ("mixtral", {"sliding_window": 5}),
                                            ("qwen2_moe", {})])
def test_piecewise_prefill_equals_one_forward(tiny_checkpoint, arch, overrides):
    """The prefill runner's pieces (cut at every attention core, through the static buffers) give
    exactly the logits, KV and captured routing of one whole forward, padding included."""
    path = tiny_checkpoint(arch, **overrides)
    model, _ = load_model(path, torch.float32)
    info = model.info
    results = []
    for piecewise in (False, True):
        pool = KVPool(num_slots=64, num_layers=info.num_hidden_layers, num_kv_heads=info.num_kv_heads,
                      head_dim=info.head_dim, dtype=torch.float32)
        buf = RoutedExpertsBuffer(rows=32, num_layers=info.num_hidden_layers, top_k=info.top_k)
        prefix = pool.alloc(6)                                  # request 0 continues a 6-token prefix
        reqs = [prompts(4, [6 + 9])[0], prompts(5, [11])[0]]
        new = [pool.alloc(9), pool.alloc(11)]
        sink = torch.full((12,), SINK_SLOT)                     # padding to the 32-token bucket
        fb = ForwardBatch.build(input_ids=reqs[0][6:] + reqs[1] + [0] * 12, out_cache_loc=torch.cat(new + [sink]),
                                prefix_lens=[6, 0, 0], extend_lens=[9, 11, 12],
                                kv_indices=slot_table([torch.cat([prefix, new[0]]), new[1], sink]), kv_pool=pool, capture=buf)
        if piecewise:
            backend = PiecewiseBackend(model, max_tokens=32, device=torch.device("cpu"), use_graphs=False)
            assert len(backend.pieces(fb)) == info.num_hidden_layers + 1
            logits = backend.run(None, fb)
        else:
            logits = model(fb)
        results.append((logits, torch.stack(pool.k_buffers), torch.stack(pool.v_buffers), buf.buffer.clone()))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def _full_and_shard(hidden: int, inter: int, experts: int, held: tuple[int, int], std: float):
    """Seeded random FusedExperts over every expert, and a shard holding experts [held) of the same weights."""
    torch.manual_seed(0)
    full = FusedExperts(hidden_size=hidden, intermediate_size=inter, num_experts=experts)
    with torch.no_grad():
        full.w13.normal_(std=std)
        full.w2.normal_(std=std)
    shard = FusedExperts(hidden_size=hidden, intermediate_size=inter, num_experts=experts)
    shard.shard(*held)
    with torch.no_grad():
        shard.w13.copy_(full.w13[held[0]:held[1]])
        shard.w2.copy_(full.w2[held[0]:held[1]])
    return full, shard


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 0.1)])
def test_moe_expert_paths_agree(dtype, atol):
    """The padded batched-matmul path, the grouped-GEMM path (no host sync), the per-expert loop
    and the dense graph-safe path give the same output over any expert range, on a whole module
    and on an expert shard."""
    full, shard = _full_and_shard(16, 8, 6, (2, 5), std=0.3)
    full, shard = full.to(dtype), shard.to(dtype)
    x = torch.randn(11, 16, dtype=dtype)
    ids = torch.stack([torch.randperm(6)[:2] for _ in range(11)])
    w = torch.rand(11, 2)
    assert FusedExperts.choose_impl(x, graph_safe=True, rows=22) == "grouped"          # CPU: torch has it
    assert FusedExperts.choose_impl(x, graph_safe=False, rows=22) == "padded"
    assert FusedExperts.choose_impl(x, graph_safe=False, rows=FusedExperts.PADDED_MAX_ROWS + 1) == "grouped"
    # large experts: several tokens take the grouped GEMM, a lone token the padded path (one by one)
    assert FusedExperts.choose_impl(x, graph_safe=False, rows=22, large=True) == "grouped"
    assert FusedExperts.choose_impl(x[:1], graph_safe=False, rows=2, large=True) == "padded"
    for module, ranges in ((full, (None, (0, 3), (3, 6), (2, 2), (1, 5))), (shard, (None, (2, 4), (4, 5)))):
        for rng in ranges:
            ref = module(x, w, ids, experts=rng, impl="loop").float()
            for impl in ("padded", "grouped", "dense"):
                got = module(x, w, ids, experts=rng, impl=impl).float()
                assert torch.allclose(got, ref, atol=atol), (impl, rng, (got - ref).abs().max())
    parts = full(x, w, ids, experts=(0, 2)) + shard(x, w, ids) + full(x, w, ids, experts=(5, 6))
    assert torch.allclose(parts.float(), full(x, w, ids).float(), atol=atol)
    with pytest.raises(ValueError, match=r"experts \[1, 4\) are not all held here \(\[2, 5\)\)"):
        shard(x, w, ids, experts=(1, 4))


@pytest.mark.parametrize("fp8", [False, True])
def test_small_batches_read_only_the_experts_routed_to(monkeypatch, fp8):
    """At batch 1 the padded path gathers (and, FP8, dequantizes) the top-k experts' weights only,
    not all 32 held: its cost follows the experts routed to. The output is the bits of the path
    over every expert, and of the per-expert loop. (Experts small enough that a gather costs less
    than one call per expert; larger ones: the next test.)"""
    monkeypatch.setattr(FusedExperts, "EXPERT_CALL_BYTES", 1 << 60)
    from rollout.models.quant.fp8 import ONLINE, quantize_into

    torch.manual_seed(0)
    module = FusedExperts(hidden_size=256, intermediate_size=128, num_experts=32)
    with torch.no_grad():
        module.w13.normal_(std=0.1)
        module.w2.normal_(std=0.1)
    if fp8:
        w13, w2 = module.w13.detach().clone(), module.w2.detach().clone()
        module.quantize_fp8(ONLINE)
        for e in range(32):
            for half in (0, 1):
                quantize_into(w13[e, half * 128:(half + 1) * 128], module.w13.data[e, half * 128:(half + 1) * 128],
                              module.w13_scale_inv.data[e, half:half + 1], ONLINE)
            quantize_into(w2[e], module.w2.data[e], module.w2_scale_inv.data[e], ONLINE)
    read = []
    dense = module.dense

    def counting(name, first, num, dtype, ids=None):
        out = dense(name, first, num, dtype, ids)
        read.append(out.shape[0])
        return out
    monkeypatch.setattr(module, "dense", counting)
    x, w = torch.randn(1, 256), torch.rand(1, 4)
    ids = torch.tensor([[30, 3, 17, 8]])
    with torch.no_grad():
        got = module(x, w, ids, impl="padded")
        assert read == [4, 4]                                          # w13 and w2 of 4 experts
        assert torch.equal(got, module(x, w, ids, impl="loop"))
        # 20 tokens routed to at most 12 of the 32: gathered; to over half of them: all read at
        # once, unless FP8 (whose dequantization is the cost: only the routed ones, always)
        for n_exp in (12, 28):
            read.clear()
            many = torch.stack([torch.randperm(n_exp)[:4] for _ in range(20)])
            active = len(many.unique())
            xs, ws = torch.randn(20, 256), torch.rand(20, 4)
            got = module(xs, ws, many, impl="padded")
            want = active if fp8 or 2 * active <= 32 else 32
            assert read == [want, want], (n_exp, active, read)
            assert torch.allclose(got, module(xs, ws, many, impl="loop"), atol=1e-5)


@pytest.mark.parametrize("batch", [1, 3, 20])
def test_large_experts_take_views_of_the_routed_experts(monkeypatch, batch):
    """Experts larger than half a call's cost (FusedExperts.large): a lone token runs its routed
    experts one by one over views of their weights (reading exactly those), several tokens run
    torch's grouped GEMM over views of the held experts (each routed one read once, none padded);
    nothing is gathered, and both equal the per-expert loop (also on a shard and a range)."""
    monkeypatch.setattr(FusedExperts, "EXPERT_CALL_BYTES", 1)
    full, shard = _full_and_shard(32, 16, 12, (4, 9), std=0.1)
    x, w = torch.randn(batch, 32), torch.rand(batch, 4)
    ids = torch.stack([torch.randperm(12 if batch < 20 else 8)[:4] for _ in range(batch)])
    for module, ranges in ((full, (None, (0, 6), (6, 12), (3, 3))), (shard, (None, (5, 7)))):
        assert module.large
        assert FusedExperts.choose_impl(x, False, ids.numel(), module.large) == ("padded" if batch == 1 else "grouped")
        read = []
        dense = module.dense

        def counting(name, first, num, dtype, ids=None, dense=dense):
            assert ids is None, "a gather"
            read.append((name, first + module.expert_lo, num))
            return dense(name, first, num, dtype, ids)
        monkeypatch.setattr(module, "dense", counting)
        for rng in ranges:
            lo, hi = rng or (module.expert_lo, module.expert_hi)
            read.clear()
            with torch.no_grad():
                got = module(x, w, ids, experts=rng)
                if batch == 1 and lo < hi:
                    want = sorted({e for e in ids.flatten().tolist() if lo <= e < hi})
                    assert sorted(first for name, first, num in read if name == "w13") == want
                    assert all(num == 1 for _, _, num in read)
                assert torch.allclose(got, module(x, w, ids, experts=rng, impl="loop"), atol=1e-6), rng


def test_routed_dp_rank_validated(tiny_checkpoint):
    with make_engine(tiny_checkpoint("qwen3_moe")) as engine:
        assert engine.generate(input_ids=[[5, 6]], sampling_params={"max_new_tokens": 1}, routed_dp_rank=0)
        with pytest.raises(ValueError, match="routed_dp_rank"):
            engine.generate(input_ids=[[5, 6]], routed_dp_rank=1)


# ---- graph-capture profiling --------------------------------------------------------------------

_TRACE_NAME = re.compile(r"^(decode|prefill)_(bs|tokens)(\d+)_rank(\d+)\.json$")


def _trace_facts(path):
    events = json.load(open(path))["traceEvents"]
    embed = [e["args"]["Input Dims"] for e in events if e.get("name") == "aten::embedding"]
    sdpa = [e["args"]["Input Dims"] for e in events if e.get("name") == "aten::scaled_dot_product_attention"]
    spans = [e["name"] for e in events if e.get("name", "").startswith("graph_capture[")]
    return embed, sdpa, spans


def test_profile_graph_capture_one_trace_per_shape(tmp_path):
    out = tmp_path / "traces"
    cfg = EngineConfig(dtype="float32", decode_graph_batch_sizes=(4, 8), prefill_graph_token_sizes=(16,),
                       enable_profile_graph_capture=True, profile_graph_capture_dir=str(out), max_total_tokens=256)
    EngineCore(cfg)
    names = sorted(os.listdir(out))
    seen = set()
    for name in names:
        m = _TRACE_NAME.match(name)
        assert m, name
        runner, size, rank = m.group(1), int(m.group(3)), m.group(4)
        assert rank == "0"
        seen.add((runner, size))
        embed, sdpa, spans = _trace_facts(out / name)
        # the traced forward ran exactly the shape the name says: size tokens (decode: size
        # requests of one query each)
        assert embed and all(dims[1] == [size] for dims in embed), (name, embed)
        if runner == "decode":
            # (the mask [B, 1, queries per request, keys] shows one query per request)
            assert sdpa and all(d[0][0] == size and d[3][:3] == [size, 1, 1] for d in sdpa), (name, sdpa)
        assert spans == [f"graph_capture[{name[:-5]}]"]
    assert len(names) == 3 and seen == {("decode", 4), ("decode", 8), ("prefill", 16)}


def test_profile_graph_capture_plain_names_without_axes(tmp_path):
    cfg = EngineConfig(dtype="float32", decode_graph_batch_sizes=(1, 4), prefill_graph_token_sizes=(32,),
                       enable_profile_graph_capture=True, profile_graph_capture_dir=str(tmp_path),
                       max_total_tokens=256)
    EngineCore(cfg)
    assert sorted(os.listdir(tmp_path)) == ["decode_bs1_rank0.json", "decode_bs4_rank0.json",
                                            "prefill_tokens32_rank0.json"]


# ---- capture buffer sizing (invariant 1) and rank-correct slicing (invariant 2) -------------------

def _scheduler_shapes(limits: ForwardShapeLimits, seed: int, num_slots: int, n_reqs: int):
    """Per-step RankShapes a real Scheduler issues for a random workload (no model: tokens are random)."""
    rng = random.Random(seed)
    pool = KVPool(num_slots=num_slots, num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32)
    cache = RadixCache(pool, enabled=rng.random() < 0.5)
    sched = Scheduler(kv_pool=pool, cache=cache, max_running_requests=limits.max_running_requests,
                      prefill_token_budget=limits.chunked_prefill_tokens, context_length=num_slots + 16)
    for i in range(n_reqs):
        new = rng.randint(1, 12)
        prompt = [rng.randrange(3, 50) for _ in range(rng.randint(1, max(1, num_slots - new - 1)))]
        sched.add(Req(uid=i, rid=str(i), prompt_ids=prompt, params=SamplingParams(max_new_tokens=new), seed=i))
    shapes = []
    for _ in range(2000):
        batch = sched.schedule()
        if batch is None:
            break
        shapes.append(RankShape.of(batch))
        for i, req in enumerate(batch.reqs):
            if batch.is_prefill:
                sched.cache_unfinished(req)
            if batch.completes(i):
                req.output_ids.append(rng.randrange(3, 50))
                if len(req.output_ids) >= req.params.max_new_tokens:
                    sched.remove(req)
                    req.status = ReqStatus.FINISHED
    sched.check_integrity()
    return shapes


bucket_lists = st.lists(st.integers(1, 96), max_size=4, unique=True).map(lambda xs: tuple(sorted(xs)))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dp=st.integers(1, 4), decode=bucket_lists, prefill=bucket_lists, chunk=st.integers(1, 80),
       max_running=st.integers(1, 24), seed=st.integers(0, 2**16), num_slots=st.integers(16, 160))
def test_every_scheduled_forward_fits_the_capture_buffer(dp, decode, prefill, chunk, max_running, seed, num_slots):
    limits = ForwardShapeLimits(dp_size=dp, max_running_requests=max_running, chunked_prefill_tokens=chunk,
                                decode_graph_batch_sizes=decode, prefill_graph_token_sizes=prefill)
    rows = capture_buffer_rows(limits)
    plan = RunnerPlan(limits)
    plan.check_capture_fits(rows)
    # each rank runs its own scheduler; a step combines one shape from each (idle ranks included)
    per_rank = [_scheduler_shapes(limits, seed + r, num_slots, n_reqs=6) for r in range(dp)]
    steps = max(len(s) for s in per_rank)
    for t in range(steps):
        shapes = [s[t] if t < len(s) else RankShape.of(None) for s in per_rank]
        for shape in shapes:
            assert shape.num_tokens <= limits.max_tokens_per_rank
        choice = plan.choose(shapes)
        if choice is None:
            continue
        layout = plan.layout(choice, shapes)
        assert layout.total_rows <= rows, (layout, rows)
        if choice.runner != EAGER:
            assert layout.padded_extent == choice.extent
            assert choice.runner != DECODE or all(s.all_single for s in shapes)
        spans = [layout.rank_span(r) for r in range(dp)]
        for r in range(dp):
            lo, hi = layout.rank_rows(r)
            assert spans[r][0] == lo <= hi <= spans[r][1] <= rows and hi - lo == shapes[r].num_tokens
            assert r == 0 or spans[r - 1][1] <= lo
    # a buffer one row short of the largest forward is refused, naming the values
    worst = max(plan.max_gathered_rows().values())
    with pytest.raises(ValueError, match=rf"dp_size={dp} .*max_running_requests={max_running}"):
        plan.check_capture_fits(worst - 1)
    # the sizing other engines used, max(chunk, max_running) x dp, forgets the prefill graph's tokens
    legacy = dp * max(chunk, max_running)
    if prefill and prefill[-1] > max(chunk, max_running, max(decode, default=0)):
        with pytest.raises(ValueError, match="prefill_graph_token_sizes max"):
            plan.check_capture_fits(legacy)


def test_config_that_cannot_fit_is_rejected_at_startup():
    kw = dict(dtype="float32", enable_return_routed_experts=True, dp_size=1, max_running_requests=8,
              chunked_prefill_size=64, decode_graph_batch_sizes=(4, 16), prefill_graph_token_sizes=(128,),
              max_total_tokens=256)
    rows = capture_buffer_rows(ForwardShapeLimits(dp_size=1, max_running_requests=8, chunked_prefill_tokens=64,
                                                  decode_graph_batch_sizes=(4, 16), prefill_graph_token_sizes=(128,)))
    assert rows == 128
    with pytest.raises(ValueError) as err:
        EngineCore(EngineConfig(max_capture_buffer_rows=rows - 1, **kw))
    msg = str(err.value)
    for part in ("needs 128 rows", "dp_size=1", "decode_graph_batch_sizes max 16", "prefill_graph_token_sizes max 128",
                 "chunked prefill tokens per rank 64", "max_running_requests=8", "max_capture_buffer_rows=127"):
        assert part in msg, (part, msg)
    core = EngineCore(EngineConfig(max_capture_buffer_rows=rows, **kw))
    assert core.capturer.buffer.rows == rows


def test_capturer_slices_the_executing_runners_rows():
    """Failure class (1), unit level: rank 1 commits exactly its rows under whatever layout ran."""
    limits = ForwardShapeLimits(dp_size=2, max_running_requests=8, chunked_prefill_tokens=64,
                                decode_graph_batch_sizes=(4, 8), prefill_graph_token_sizes=(64,))
    cap = RoutedExpertsCapturer(limits=limits, num_slots=300, num_layers=2, top_k=2, num_experts=200,
                                moe_layer_ids=(0, 1), dp_rank=1)
    rows = cap.buffer.rows
    tagged = torch.arange(rows, dtype=torch.int32)[:, None, None].expand(rows, 2, 2) % 200
    layouts = [GatherLayout.padded(PREFILL, (0, 5), extent=64),     # decode runner never ran
               GatherLayout.padded(DECODE, (3, 7), extent=8),       # decode ran with batch 8
               GatherLayout.padded(PREFILL, (2, 9), extent=64),     # prefill again after decode
               GatherLayout.packed(EAGER, (4, 6))]
    slot = 1
    for layout in layouts:
        cap.buffer.buffer.copy_(tagged)
        n = layout.token_counts[1]
        slots = torch.arange(slot, slot + n)
        cap.commit(layout, slots)
        start = layout.padded_extent if layout.padded_extent is not None else layout.token_counts[0]
        # NOTE: a commit's rows reach the store when read (rows() flushes the pending copy)
        assert cap.rows(slots, 0, n)[:, 0, 0].tolist() == list(range(start, start + n)), layout
        slot += n
