"""The overlap schedule (enable_overlap_schedule): the next step is scheduled and the last one's
outputs processed while the forward thread runs the forward and sampling. Its outputs are the
sequential loop's (tokens, logprobs, top logprobs, routing rows; bitwise in deterministic mode),
through retraction, prefix hits, chunked prefill, aborts, pauses and weight swaps, with no KV
left behind."""
from __future__ import annotations

import base64
import threading
import time

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from rollout.config import EngineConfig
from test_speculative import _prompts, _run, _same, _workload
from tiny_models import make_engine

OVERLAP = {"enable_overlap_schedule": True}
# NOTE: small prefill chunks and a KV pool small enough to retract (tests/test_speculative.py's workload)
TIGHT = {"chunked_prefill_size": 16, "max_total_tokens": 130}


def _overlap_workload(engine, seed: int):
    """tests/test_speculative.py's workload, then sampled requests that a stop token (a fifth of the
    vocabulary) ends after a few tokens: each is fed once more after its end."""
    stops = {"temperature": 1.0, "max_new_tokens": 30, "stop_token_ids": list(range(3, 60))}
    prompts = _prompts(seed + 1, [10, 25, 17, 33])
    return _workload(engine, seed) + _run(engine, prompts, [dict(stops, sampling_seed=s) for s in range(4)])


@pytest.mark.parametrize("arch, kw", [
    ("qwen3_moe", {}),
    pytest.param("qwen3_moe", {"decode_graph_batch_sizes": (1, 2, 4, 8), "prefill_graph_token_sizes": (16, 64)},
                 id="static-runners"),
    pytest.param("deepseek_v3", {}, marks=pytest.mark.slow),
    pytest.param("qwen3_moe", {"dp_size": 2, "decode_graph_batch_sizes": (1, 2, 4, 8),
                               "prefill_graph_token_sizes": (16, 64)}, marks=pytest.mark.slow, id="dp2-graphs")])
def test_deterministic_outputs_equal_the_sequential_loop(tiny_checkpoint, arch, kw):
    """Deterministic mode: every output with the overlap schedule is bitwise the sequential loop's,
    the workload retracted and hit the prefix cache, and requests that a stop token ended were fed
    once more (their extra row dropped) without a slot leaking."""
    path = tiny_checkpoint(arch)
    kw = {"enable_deterministic_inference": True, **TIGHT, **kw}
    outs, stats = {}, {}
    for name, extra in (("sequential", {}), ("overlap", OVERLAP)):
        client = {} if kw.get("dp_size", 1) > 1 else {"client": "inproc"}
        with make_engine(path, **kw, **extra, **client) as engine:
            outs[name] = _overlap_workload(engine, 5)
            if client:
                stats[name] = engine.debug(lambda core: (core.check_integrity(), core.flush_cache(),
                                                         core.kv_pool.used(), dict(core.stats)))
    for a, b in zip(outs["sequential"], outs["overlap"]):
        _same(a, b, bitwise=True)
    out = outs["overlap"]
    assert any(o.num_retractions for o in out), "the KV pool must force a retraction"
    assert any(o.cached_tokens for o in out), "the repeated batch must hit the prefix cache"
    assert sum(o.finish_reason == "stop" for o in out) >= 3, "requests must end on a stop token"
    if stats:
        for name in stats:
            assert stats[name][:3] == (True, True, 0), (name, stats[name])
        # NOTE: a request that a stop token ended was fed once more (its results dropped, not counted)
        seq, ov = stats["sequential"][3], stats["overlap"][3]
        assert ov["generated_tokens"] == seq["generated_tokens"]
        assert ov["num_decode_forwards"] >= seq["num_decode_forwards"]


def test_default_mode_outputs_equal_the_sequential_loop(tiny_checkpoint):
    """Default kernels: the overlap schedule changes which requests share a forward (a finished
    request frees its KV a step later), so logprobs may differ in the last bits; tokens and routing
    rows are the sequential loop's."""
    path = tiny_checkpoint("qwen3_moe")
    outs = {}
    for name, extra in (("sequential", {}), ("overlap", OVERLAP)):
        with make_engine(path, **TIGHT, **extra) as engine:
            outs[name] = _overlap_workload(engine, 7)
    for a, b in zip(outs["sequential"], outs["overlap"]):
        _same(a, b, bitwise=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_overlap_schedule_on_cuda_matches_the_sequential_loop(tiny_checkpoint):
    """On a GPU, decode buckets as CUDA graphs (captured on the forward thread, replayed there
    while the engine thread schedules and processes): the workload's tokens and routing rows are
    the sequential loop's, logprobs within the default kernels' last bits, no KV left behind."""
    path = tiny_checkpoint("qwen3_moe")
    kw = dict(TIGHT, client="inproc", device="cuda", decode_graph_batch_sizes=(1, 2, 4, 8))
    outs, left = {}, {}
    for name, extra in (("sequential", {}), ("overlap", OVERLAP)):
        with make_engine(path, **kw, **extra) as engine:
            outs[name] = _overlap_workload(engine, 9)
            left[name] = engine.debug(lambda core: (core.check_integrity(), core.flush_cache(), core.kv_pool.used(),
                                                    core.runner.report()["decode_graph"]["uses_graphs"]))
    for a, b in zip(outs["sequential"], outs["overlap"], strict=True):
        _same(a, b, bitwise=False)
    assert left == {"sequential": (True, True, 0, True), "overlap": (True, True, 0, True)}


def test_forwards_run_on_the_forward_thread(tiny_checkpoint):
    """Every forward runs on the forward thread, and the engine thread keeps torch to one thread
    (no OpenMP pool of its own beside the forward thread's)."""
    path = tiny_checkpoint("qwen3_moe")
    seen: set = set()
    with make_engine(path, client="inproc", **OVERLAP) as engine:
        def hook(core):
            core.model.register_forward_pre_hook(lambda *_: seen.add(threading.current_thread().name))
            return threading.current_thread().name, torch.get_num_threads(), core.forward_threads
        engine_thread, engine_threads, forward_threads = engine.debug(hook)
        _run(engine, _prompts(3, [12, 20]), {"temperature": 0.0, "max_new_tokens": 8})
    assert seen == {"rollout-forward"}
    assert engine_thread == "rollout-engine" and engine_threads == 1 and forward_threads >= 1


def test_abort_pause_and_weight_swap_between_overlapped_steps(tiny_checkpoint):
    """Aborts, pauses and weight swaps come between steps: the step in flight is processed first.
    An aborted request's partial output is an exact prefix of its sequential output; a paused and
    resumed one ends as without the pause; a swap of the same weights changes nothing; no KV is
    left behind."""
    path = tiny_checkpoint("qwen3_moe")
    prompt = _prompts(4, [30])[0]
    params = {"temperature": 0.0, "max_new_tokens": 120, "ignore_eos": True}
    det = {"enable_deterministic_inference": True}
    with make_engine(path, **det) as engine:
        full = _run(engine, [prompt], params)[0]
    with make_engine(path, client="inproc", **det, **OVERLAP) as engine:
        seen = 0
        for chunk in engine.generate(input_ids=[prompt], sampling_params=params, return_logprob=True,
                                     top_logprobs_num=3, return_routed_experts=True, stream=True, rid="a"):
            seen += len(chunk.output_ids)
            if seen >= 20 and not chunk.finished:
                engine.abort("a")
            part = chunk.output or None
        paused: list = []
        done = []
        start = engine.steps_done
        worker = threading.Thread(target=lambda: done.append(_run(engine, [prompt], params)[0]))
        worker.start()
        while engine.steps_done < start + 30 and worker.is_alive():
            time.sleep(0.005)
        paused.append(engine.pause_generation("in_place"))
        paused.append(engine.debug(lambda core: core.check_integrity()))
        engine.continue_generation()
        worker.join()
        weights = {k: v for k, v in load_file(f"{path}/model.safetensors").items() if k.endswith("mlp.gate.weight")}
        assert engine.swap_weights(weights, weight_version="same") == len(weights) >= 1
        again = _run(engine, [prompt], params)[0]
        assert engine.debug(lambda core: core.flush_cache() and core.check_integrity() and core.kv_pool.used() == 0)
    assert part.finish_reason == "abort" and 20 <= len(part.output_ids) < 120
    n = len(part.output_ids)
    assert part.output_ids == full.output_ids[:n] and part.output_logprobs == full.output_logprobs[:n]
    assert part.output_top_logprobs == full.output_top_logprobs[:n]
    assert torch.equal(part.routed_experts, full.routed_experts[:len(prompt) + n - 1])
    assert paused == [1, True]
    for out in (done[0], again):
        _same(out, full, bitwise=True)
    assert again.weight_version == "same"


@pytest.mark.parametrize("kw, message", [
    ({"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 4},
     "enable_overlap_schedule cannot be combined with speculative decoding"),
    ({"enable_overlap_schedule": 1}, "enable_overlap_schedule must be a boolean")])
def test_bad_settings_are_refused_by_name(kw, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model_path="m", **{"enable_overlap_schedule": True, **kw})


def test_slime_shaped_requests_to_a_real_server():
    """A GRPO group sent as slime sends it (one concurrent /generate per sample, logprobs and routing
    asked) to a real rollout-serve with the overlap schedule: every answer is bitwise the sequential
    server's, and a greedy sample's routing is transformers' router top-k."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from oracle import hf_router_topk, same_sets
    from rollout.config import DEFAULT_MODEL_PATH
    from server_proc import ServerProcess
    from test_sglang_conformance import slime_sampling_params

    ids = _prompts(9, [21])[0]
    payloads = [{"input_ids": ids, "return_logprob": True, "return_routed_experts": True,
                 "sampling_params": dict(slime_sampling_params(), temperature=0.0 if s == 0 else 1.0,
                                         sampling_seed=s, max_new_tokens=12)} for s in range(6)]
    answers = {}
    for name, flags in (("sequential", []), ("overlap", ["--enable-overlap-schedule"])):
        with ServerProcess(["--enable-return-routed-experts", "--dtype", "float32",
                            "--enable-deterministic-inference", *flags]) as srv, \
                httpx.Client(base_url=srv.url, timeout=120) as c, ThreadPoolExecutor(len(payloads)) as pool:
            replies = list(pool.map(lambda p: c.post("/generate", json=p), payloads))
            assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
            answers[name] = [r.json() for r in replies]
    # NOTE: cached_tokens: whether a sample's prompt was already cached depends on when its request
    # reached the server next to the others (either server), not on the schedule
    strip = ("e2e_latency", "id", "cached_tokens")
    for a, b in zip(answers["sequential"], answers["overlap"]):
        assert a["output_ids"] == b["output_ids"]
        assert {k: v for k, v in a["meta_info"].items() if k not in strip} == \
            {k: v for k, v in b["meta_info"].items() if k not in strip}
    assert all("output_token_logprobs" in a["meta_info"] and a["meta_info"]["routed_experts"]
               for a in answers["overlap"])
    greedy = answers["overlap"][0]
    tokens = ids + greedy["output_ids"]
    rows = np.frombuffer(base64.b64decode(greedy["meta_info"]["routed_experts"]), dtype=np.int32)
    rows = torch.from_numpy(rows.reshape(len(tokens) - 1, 4, 4).copy())
    assert same_sets(rows, hf_router_topk(DEFAULT_MODEL_PATH, tokens[:-1], 4, 4))
