"""--enable-torch-compile: the decode buckets up to torch_compile_max_bs run a torch.compile'd
forward (rollout/exec/runners/compiled_backend.py) with attention and the MoE layers as opaque ops
(rollout/models/opaque_step.py)."""
import dataclasses

import pytest
import torch
from attention_cases import slot_table

from capture.capturer import RoutedExpertsBuffer
from rollout.batch.forward_batch import ForwardBatch
from rollout.batch.kv_pool import KVPool
from rollout.config import EngineConfig
from rollout.config.engine_cli import engine_flags
from rollout.exec.model_runner import DECODE
from rollout.exec.runners.compiled_backend import CompiledBackend
from rollout.models import load_model
from rollout.models.opaque_step import OpaqueStep
from rollout.server.args import ServerArgs
from tiny_models import make_engine, random_prompts

GREEDY = {"temperature": 0.0, "ignore_eos": True}
SAMPLED = {"temperature": 0.9, "top_p": 0.95, "ignore_eos": True}


def _decode_batch(model, lengths, capture=None):
    """A KV pool holding `lengths` prompts (prefilled eagerly) and the decode step after them."""
    info = model.info
    pool = KVPool(num_slots=sum(lengths) + len(lengths) + 8, num_layers=info.num_hidden_layers,
                  num_kv_heads=info.num_kv_heads, head_dim=info.head_dim, dtype=torch.float32,
                  latent_dim=info.kv_latent_dim)
    prompts = random_prompts(7, lengths)
    slots = [pool.alloc(n + 1) for n in lengths]
    with torch.inference_mode():
        for ids, s in zip(prompts, slots):
            n = len(ids)
            model(ForwardBatch.build(input_ids=ids, out_cache_loc=s[:n], prefix_lens=[0], extend_lens=[n],
                                     kv_indices=slot_table([s[:n]]), kv_pool=pool))
    return ForwardBatch.build(input_ids=[ids[-1] for ids in prompts], out_cache_loc=torch.stack([s[-1] for s in slots]),
                              prefix_lens=list(lengths), extend_lens=[1] * len(lengths),
                              kv_indices=slot_table(slots), kv_pool=pool, capture=capture)


# qwen2_moe: a dense layer and a gated shared expert; gpt_oss: sinks, sliding windows (masks made
# inside the attention op), biased router; minimax_m2: sigmoid routing with a correction bias;
# deepseek_v3: MLA (latent rows written by the attention op), grouped routing, a dense first layer
@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "gpt_oss", "minimax_m2", "deepseek_v3"])
def test_opaque_forward_is_one_graph_and_the_eager_forward(tiny_checkpoint, arch):
    """The forward a compiled bucket traces has no graph break; run eagerly through its opaque
    ops it is bitwise the plain forward (logits and routing rows)."""
    model, _ = load_model(tiny_checkpoint(arch), torch.float32)
    info = model.info
    captures = [RoutedExpertsBuffer(rows=4, num_layers=info.num_hidden_layers, top_k=info.top_k) for _ in range(2)]
    fb = _decode_batch(model, [5, 11, 13], capture=captures[0])   # past gpt_oss's window of 8
    with torch.inference_mode():
        ref = model(fb)
        opaque = dataclasses.replace(fb, capture=captures[1])
        got = model(dataclasses.replace(opaque, opaque=OpaqueStep(model, opaque)))
        explained = torch._dynamo.explain(model.forward)(dataclasses.replace(opaque, opaque=OpaqueStep(model, opaque)))
    assert torch.equal(got, ref)
    moe = list(info.moe_layer_ids)
    assert torch.equal(captures[0].buffer, captures[1].buffer) and (captures[0].buffer[:3, moe] >= 0).all()
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    ops = [str(n.target) for g in explained.graphs for n in g.graph.nodes if n.op == "call_function"]
    assert sum("rollout.attention" in o for o in ops) == info.num_hidden_layers
    assert sum("rollout.sparse_moe" in o for o in ops) == len(info.moe_layer_ids)


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3", pytest.param("gpt_oss", marks=pytest.mark.slow)])
def test_compiled_buckets_match_eager(tiny_checkpoint, arch):
    """Compiled buckets 1 and 2 (of 1, 2, 4, 8) against the same engine without compile: greedy and
    seeded sampled requests, logprobs and routed experts; one graph per compiled bucket, no
    recompile while serving."""
    path = tiny_checkpoint(arch)
    batch = random_prompts(11, [6, 17, 9, 30, 4])
    # 5 requests finishing one by one: buckets 8, 4, 4, 2, 1 (the last two compiled)
    params = [dict(GREEDY, max_new_tokens=14), dict(SAMPLED, max_new_tokens=10, sampling_seed=3),
              dict(GREEDY, max_new_tokens=3), dict(SAMPLED, max_new_tokens=12, sampling_seed=8),
              dict(GREEDY, max_new_tokens=6)]
    kw = dict(client="inproc", decode_graph_batch_sizes=(1, 2, 4, 8), max_total_tokens=512)
    outs, reports = {}, {}
    for compiled in (False, True):
        with make_engine(path, enable_torch_compile=compiled, torch_compile_max_bs=2, **kw) as engine:
            outs[compiled] = engine.generate(input_ids=batch, sampling_params=params, return_logprob=True,
                                             return_routed_experts=True)
            reports[compiled] = engine.debug(lambda core: (core.runner.report(), core.runner.runners[DECODE].backend,
                                                           [(r, e) for r, _, e in core.recent_layouts()]))
    for got, ref in zip(outs[True], outs[False], strict=True):
        assert got.output_ids == ref.output_ids
        diff = (torch.tensor(got.output_logprobs) - torch.tensor(ref.output_logprobs)).abs().max().item()
        assert diff <= 1e-5, diff
        assert torch.equal(got.routed_experts, ref.routed_experts)
    report, backend, layouts = reports[True]
    assert isinstance(backend, CompiledBackend) and backend.compile_keys == (1, 2)
    assert not isinstance(reports[False][1], CompiledBackend)
    assert report[DECODE]["compiled_graphs"] == {"1": 1, "2": 1}   # one graph each: no break, no recompile
    assert report[DECODE]["graphs"] == {}                           # no CUDA graphs on CPU
    assert set(report[DECODE]["compile_seconds"]) == {"1", "2"}
    assert {(DECODE, 1), (DECODE, 2), (DECODE, 4)} <= set(layouts)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_cuda_graphs_match_uncompiled_graphs(tiny_checkpoint):
    """On a GPU a compiled bucket replays a CUDA graph captured over its compiled forward (Triton
    kernels; bucket 1: the last request's steps), the larger ones plain graphs. Against the same
    engine without compile: greedy and seeded sampled requests, logprobs and routed experts. (One
    architecture and one compiled bucket: the GPU check's test budget is small; MLA compiles on CPU
    in test_compiled_buckets_match_eager.)"""
    path = tiny_checkpoint("qwen3_moe")
    batch = random_prompts(11, [6, 17, 9, 30, 4])
    params = [dict(GREEDY, max_new_tokens=14), dict(SAMPLED, max_new_tokens=10, sampling_seed=3),
              dict(GREEDY, max_new_tokens=3), dict(SAMPLED, max_new_tokens=12, sampling_seed=8),
              dict(GREEDY, max_new_tokens=6)]
    kw = dict(client="inproc", device="cuda", decode_graph_batch_sizes=(1, 2, 4, 8), max_total_tokens=512)
    outs, reports = {}, {}
    for compiled in (False, True):
        # NOTE: one compiled bucket (Triton compiles take the GPU check's time)
        with make_engine(path, enable_torch_compile=compiled, torch_compile_max_bs=1, **kw) as engine:
            outs[compiled] = engine.generate(input_ids=batch, sampling_params=params, return_logprob=True,
                                             return_routed_experts=True)
            engine.check_integrity()
            reports[compiled] = engine.debug(lambda core: core.runner.report()[DECODE])
    for got, ref in zip(outs[True], outs[False], strict=True):
        assert got.output_ids == ref.output_ids
        diff = (torch.tensor(got.output_logprobs) - torch.tensor(ref.output_logprobs)).abs().max().item()
        assert diff <= 1e-4, diff
        assert torch.equal(got.routed_experts, ref.routed_experts)
    report = reports[True]
    assert report["uses_graphs"] and set(report["graphs"]) == {"1", "2", "4", "8"}
    assert report["compiled_graphs"] == {"1": 1} and report["forwards"] > 0


@pytest.mark.parametrize("kw,names", [
    (dict(torch_compile_max_bs=0), ["torch_compile_max_bs"]),
    (dict(torch_compile_max_bs=2.5), ["torch_compile_max_bs"]),
    (dict(enable_torch_compile="yes"), ["enable_torch_compile"]),
    (dict(enable_torch_compile=True, decode_graph_batch_sizes=(16,), torch_compile_max_bs=8),
     ["enable_torch_compile", "torch_compile_max_bs=8", "decode_graph_batch_sizes"]),
    (dict(enable_torch_compile=True, decode_graph_batch_sizes=(1,), enable_deterministic_inference=True),
     ["enable_torch_compile", "enable_deterministic_inference"]),
])
def test_bad_values_refused_by_name(kw, names):
    with pytest.raises(ValueError) as err:
        EngineConfig(**kw)
    assert all(n in str(err.value) for n in names), str(err.value)


def test_flags_and_api():
    cfg = ServerArgs.from_cli(["--enable-torch-compile", "--torch-compile-max-bs", "4",
                               "--decode-graph-batch-sizes", "1", "4", "8"]).engine
    assert cfg.enable_torch_compile and cfg.torch_compile_max_bs == 4
    assert EngineConfig().enable_torch_compile is False and EngineConfig().torch_compile_max_bs == 32
    flags = engine_flags(cfg)
    assert "--enable-torch-compile" in flags and flags[flags.index("--torch-compile-max-bs") + 1] == "4"
    with pytest.raises(SystemExit):
        ServerArgs.from_cli(["--enable-torch-compile", "--torch-compile-max-bs", "0", "--decode-graph-batch-sizes", "1"])
    # SGLang's flags alone: the decode buckets are the powers of two up to the max
    assert ServerArgs.from_cli(["--enable-torch-compile"]).engine.decode_graph_batch_sizes == (1, 2, 4, 8, 16, 32)
    assert EngineConfig(enable_torch_compile=True, torch_compile_max_bs=6).decode_graph_batch_sizes == (1, 2, 4)
    assert EngineConfig(torch_compile_max_bs=6).decode_graph_batch_sizes == ()


@pytest.mark.slow
def test_compiled_buckets_under_dp2_match_eager(tiny_checkpoint):
    """DP attention (2 ranks): each rank compiles its buckets; the MoE op gathers every rank's rows
    (the layout of the executing runner) inside, as eager."""
    path = tiny_checkpoint("qwen3_moe")
    batch = random_prompts(3, [5, 12, 7, 20, 9, 4])
    params = [dict(GREEDY, max_new_tokens=m) for m in (12, 3, 8, 10, 5, 2)]
    outs = {}
    for compiled in (False, True):
        with make_engine(path, dp_size=2, decode_graph_batch_sizes=(1, 2, 4), enable_torch_compile=compiled,
                         torch_compile_max_bs=2, max_total_tokens=256) as engine:
            outs[compiled] = engine.generate(input_ids=batch, sampling_params=params, return_logprob=True,
                                             return_routed_experts=True)
    for got, ref in zip(outs[True], outs[False], strict=True):
        assert got.output_ids == ref.output_ids
        assert (torch.tensor(got.output_logprobs) - torch.tensor(ref.output_logprobs)).abs().max().item() <= 1e-5
        assert torch.equal(got.routed_experts, ref.routed_experts)


def test_compiled_buckets_follow_weight_updates_and_memory_release(tiny_checkpoint):
    """The compiled graphs read the parameters they were compiled over: a weight swap (copied into
    them) and a release / resume of weights and KV change what they compute exactly as they change
    the uncompiled engine's, with no recompile."""
    from safetensors.torch import load_file

    path = tiny_checkpoint("qwen3_moe")
    donor = load_file(str(tiny_checkpoint("qwen3_moe", seed=1) / "model.safetensors"))
    batch = random_prompts(5, [7, 15])
    params = [dict(GREEDY, max_new_tokens=8)] * 2
    outs = {}
    for compiled in (False, True):
        with make_engine(path, client="inproc", decode_graph_batch_sizes=(1, 2), enable_torch_compile=compiled,
                         max_total_tokens=256) as engine:
            run = lambda: engine.generate(input_ids=batch, sampling_params=params, return_logprob=True,  # noqa: E731
                                          return_routed_experts=True)
            before = run()
            engine.release_memory_occupation()
            engine.resume_memory_occupation()
            again = run()
            engine.swap_weights(donor, weight_version="w2")
            outs[compiled] = (before, again, run())
            graphs = engine.debug(lambda core: core.runner.report()[DECODE].get("compiled_graphs"))
        assert graphs == ({"1": 1, "2": 1} if compiled else None)
        assert [o.output_ids for o in outs[compiled][0]] == [o.output_ids for o in outs[compiled][1]]
        assert [o.output_ids for o in outs[compiled][0]] != [o.output_ids for o in outs[compiled][2]]
    for got, ref in zip(sum(outs[True], []), sum(outs[False], []), strict=True):
        assert got.output_ids == ref.output_ids
        assert (torch.tensor(got.output_logprobs) - torch.tensor(ref.output_logprobs)).abs().max().item() <= 1e-5
        assert torch.equal(got.routed_experts, ref.routed_experts)


def test_config_file(tmp_path):
    from rollout.config.config_file import ConfigFileError, load_engine_config

    path = tmp_path / "engine.yaml"
    path.write_text("engine:\n  decode_graph_batch_sizes: [1, 8, 64]\n  enable_torch_compile: true\n"
                    "  torch_compile_max_bs: 8\n")
    cfg = load_engine_config(str(path))
    assert cfg.enable_torch_compile and cfg.torch_compile_max_bs == 8
    path.write_text("engine:\n  decode_graph_batch_sizes: [64]\n  enable_torch_compile: true\n  torch_compile_max_bs: 8\n")
    with pytest.raises((ConfigFileError, ValueError), match="torch_compile_max_bs"):
        load_engine_config(str(path))


def test_slime_shaped_requests_to_a_compiled_server():
    """A GRPO group sent as slime sends it (one concurrent /generate per sample, logprobs and routing
    asked) to a real rollout-serve with --enable-torch-compile: tokens and routing rows equal the
    uncompiled server's, logprobs within 1e-5, and the decode steps ran the compiled buckets."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from server_proc import ServerProcess
    from test_sglang_conformance import slime_sampling_params

    ids = random_prompts(9, [21])[0]
    payloads = [{"input_ids": ids, "return_logprob": True, "return_routed_experts": True,
                 "sampling_params": dict(slime_sampling_params(), temperature=0.0 if s == 0 else 1.0,
                                         sampling_seed=s, max_new_tokens=12)} for s in range(6)]
    answers, forwards = {}, {}
    for name, flags in (("plain", ["--decode-graph-batch-sizes", "1", "2", "4", "8"]),
                        ("compiled", ["--enable-torch-compile", "--torch-compile-max-bs", "8"])):
        with ServerProcess(["--enable-return-routed-experts", "--dtype", "float32", *flags]) as srv, \
                httpx.Client(base_url=srv.url, timeout=300) as c, ThreadPoolExecutor(len(payloads)) as pool:
            replies = list(pool.map(lambda p: c.post("/generate", json=p), payloads))
            assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
            answers[name] = [r.json() for r in replies]
            forwards[name] = c.get("/server_info").json()["internal_states"][0].get("forwards_decode_graph", 0)
    assert forwards["plain"] > 0 and forwards["compiled"] > 0
    for a, b in zip(answers["plain"], answers["compiled"], strict=True):
        assert a["output_ids"] == b["output_ids"]
        assert a["meta_info"]["routed_experts"] == b["meta_info"]["routed_experts"]
        lp = [(x[0], y[0]) for x, y in zip(a["meta_info"]["output_token_logprobs"],
                                           b["meta_info"]["output_token_logprobs"], strict=True)]
        assert max(abs(x - y) for x, y in lp) <= 1e-5
