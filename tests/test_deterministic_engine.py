"""Deterministic inference: a request's tokens, logprobs and routing rows are the same bits
whatever the batch, chunking, prefix-cache state, retraction or DP rank; decode == prefill."""
from __future__ import annotations

import random

import pytest
import torch

from tiny_models import ARCHS, GROUPED_ARCHS, NEW_ARCHS, make_engine, random_prompts

TARGET = {"temperature": 0.8, "top_p": 0.95, "max_new_tokens": 12, "ignore_eos": True, "sampling_seed": 7,
          "logprob_mode": "raw"}


def _run(engine, prompt, params=TARGET):
    return engine.generate(input_ids=[prompt], sampling_params=params, return_logprob=True, top_logprobs_num=3,
                           return_routed_experts=True)[0]


def _same(a, b) -> None:
    assert a.output_ids == b.output_ids
    assert torch.equal(torch.tensor(a.output_logprobs), torch.tensor(b.output_logprobs))
    assert a.output_top_logprobs == b.output_top_logprobs
    assert torch.equal(a.routed_experts, b.routed_experts)


def _others(seed: int, count: int) -> tuple[list[list[int]], list[dict]]:
    rng = random.Random(seed)
    prompts = random_prompts(seed, [rng.randrange(3, 70) for _ in range(count)])
    params = [{"temperature": 1.0, "max_new_tokens": rng.randrange(1, 20), "ignore_eos": True} for _ in prompts]
    return prompts, params


def _mixed(engine, target, seed: int, count: int = 9, later: int = 6):
    """The target among random others: 4 queued before it, count - 4 queued with it, and `later`
    more submitted while it decodes, each batch of 1-3 once the target has streamed a random number
    of tokens (they join between engine steps, mid-decode). Lengths random, all seeded."""
    prompts, params = _others(seed, count + later)
    early = engine.submit(lambda _: None, input_ids=prompts[:4], sampling_params=params[:4])
    engine.submit(lambda _: None, input_ids=prompts[4:count], sampling_params=params[4:count])
    late = _arrivals(seed, count, count + later)
    out, tokens = None, 0
    for chunk in engine.generate(input_ids=[target], sampling_params=TARGET, return_logprob=True, top_logprobs_num=3,
                                 return_routed_experts=True, stream=True, rid="target"):
        tokens += len(chunk.output_ids)
        out = chunk.output or out
        while late and late[0][0] <= tokens and not chunk.finished:
            _, lo, hi = late.pop(0)
            engine.submit(lambda _: None, input_ids=prompts[lo:hi], sampling_params=params[lo:hi])
    assert early.rids and not late, "every later batch must arrive before the target finishes"
    return out


def _arrivals(seed: int, lo: int, hi: int) -> list[tuple[int, int, int]]:
    """(target tokens streamed, first, end) of each later batch of others: 1-3 requests each, after a
    random 1..8 of the target's 12 tokens."""
    rng = random.Random(seed + 1)
    out, i = [], lo
    while i < hi:
        n = min(rng.randrange(1, 4), hi - i)
        out.append((rng.randrange(1, 9), i, i + n))
        i += n
    return sorted(out)


# NOTE: one architecture by default (~15-60 s on 2 cores, with the host load); the others, and dp 2, under slow
@pytest.mark.parametrize("arch", [a if a == "qwen3_moe" else pytest.param(a, marks=pytest.mark.slow)
                                  for a in ARCHS + GROUPED_ARCHS + NEW_ARCHS])
def test_request_is_batch_invariant(tiny_checkpoint, arch):
    check_batch_invariance(tiny_checkpoint(arch))


def check_batch_invariance(path, **engine_kw):
    """The target alone vs among others with small chunks, retractions of others and a prefix hit;
    vs others arriving mid-decode; and decode vs the same tokens scored as a prompt (logprobs, top-k
    logprobs, routing): the same bits. -> the target's output alone."""
    target = random_prompts(11, [45])[0]
    with make_engine(path, enable_deterministic_inference=True, enable_prefix_caching=False, **engine_kw) as engine:
        alone = _run(engine, target)
        # others arriving at random steps while the target decodes (a pool with room: no retraction)
        late = _mixed(engine, target, seed=4, later=6)
    # small chunks, a tight KV pool (retractions), prefix-cache hits, other requests all around
    with make_engine(path, enable_deterministic_inference=True, chunked_prefill_size=16,
                     max_total_tokens=260, **engine_kw) as engine:
        mixed = _mixed(engine, target, seed=3, later=0)
        hit = _run(engine, target)
        # decode vs prefill: the same tokens scored at once by a later request
        scored = engine.generate(input_ids=[target + alone.output_ids], return_logprob=True,
                                 logprob_start_len=len(target) - 1, return_routed_experts=True,
                                 top_logprobs_num=3, sampling_params={"max_new_tokens": 1, "temperature": 0.0})[0]
        stats = engine.stats()
        engine.check_integrity()
    for out in (mixed, hit, late):
        _same(alone, out)
    assert hit.cached_tokens > 0
    assert stats["num_retractions"] > 0
    assert torch.equal(torch.tensor(scored.input_logprobs), torch.tensor(alone.output_logprobs))
    assert scored.input_top_logprobs == alone.output_top_logprobs
    rows = alone.routed_experts.shape[0]
    assert torch.equal(scored.routed_experts[:rows], alone.routed_experts)
    return alone


@pytest.mark.slow
def test_retracted_target_is_recomputed_exactly(tiny_checkpoint):
    """The target itself retracted and recomputed (asserted), with others arriving mid-decode."""
    path = tiny_checkpoint("qwen3_moe")
    target = random_prompts(11, [45])[0]
    with make_engine(path, enable_deterministic_inference=True, enable_prefix_caching=False) as engine:
        alone = _run(engine, target)
    with make_engine(path, enable_deterministic_inference=True, chunked_prefill_size=16, max_total_tokens=260) as engine:
        mixed = _mixed(engine, target, seed=3, later=6)
        engine.check_integrity()
    assert mixed.num_retractions > 0
    _same(alone, mixed)


@pytest.mark.slow
def test_target_among_200_short_requests(tiny_checkpoint):
    """~200 short others around the target: 100 queued before or with it, 100 arriving mid-decode."""
    path = tiny_checkpoint("qwen3_moe")
    target = random_prompts(11, [45])[0]
    with make_engine(path, enable_deterministic_inference=True, enable_prefix_caching=False) as engine:
        alone = _run(engine, target)
    with make_engine(path, enable_deterministic_inference=True, chunked_prefill_size=64) as engine:
        crowd = _mixed(engine, target, seed=8, count=100, later=100)
        engine.check_integrity()
    _same(alone, crowd)


@pytest.mark.gpu
@pytest.mark.parametrize("backends", [{}, dict(moe_backend="triton", attention_backend="triton")],
                         ids=["torch_exact_ops", "triton_batch_invariant"])
def test_gpu_request_is_batch_invariant(tiny_checkpoint, backends):
    """The CPU check on CUDA: with the torch exact ops (the backends' default in this mode) and with
    the Triton kernels in their batch-invariant form."""
    alone = check_batch_invariance(tiny_checkpoint("qwen3_moe"), device="cuda", **backends)
    assert alone.routed_experts.device.type == "cpu" and len(alone.output_ids) == TARGET["max_new_tokens"]


BUCKETS = dict(decode_graph_batch_sizes=(1, 2, 4), prefill_graph_token_sizes=(16, 32), chunked_prefill_size=48)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3", "gpt_oss", "minimax_m2"])
def test_dp_ranks_static_runners_and_streaming_agree(tiny_checkpoint, arch):
    """dp 2 with expert parallelism, static-bucket runners, streamed: the same bits as one eager
    rank holding every expert (the ranks' expert terms are added per top-k slot)."""
    path = tiny_checkpoint(arch)
    target = random_prompts(12, [30])[0]
    with make_engine(path, enable_deterministic_inference=True) as engine:
        alone = _run(engine, target)
    prompts, params = _others(5, 5)
    with make_engine(path, dp_size=2, enable_deterministic_inference=True, **BUCKETS) as engine:
        on_rank = []
        for rank in (0, 1):
            outs = engine.generate(input_ids=prompts + [target], sampling_params=params + [TARGET],
                                   return_logprob=True, top_logprobs_num=3, return_routed_experts=True,
                                   routed_dp_rank=[rank, 1 - rank, rank, 1 - rank, rank, rank])
            on_rank.append(outs[-1])
        chunks = list(engine.generate(input_ids=[target], sampling_params=TARGET, return_logprob=True,
                                      top_logprobs_num=3, return_routed_experts=True, stream=True,
                                      routed_dp_rank=1))
        pair = engine.generate(input_ids=[target], sampling_params={**TARGET, "n": 2, "max_new_tokens": 24})
    for out in on_rank + [chunks[-1].output]:
        _same(alone, out)
    assert pair[0].output_ids != pair[1].output_ids   # each sample has its own seed


def test_config_refuses_what_breaks_invariance():
    from rollout.config import EngineConfig

    # unset backends resolve to the torch exact ops on every device (the exact-mode trainer's ops)
    cuda = EngineConfig(enable_deterministic_inference=True, device="cuda")
    assert (cuda.resolved_attention_backend, cuda.resolved_moe_backend) == ("torch", "torch")
    assert EngineConfig(enable_deterministic_inference=True).resolved_attention_backend == "torch"
    for bad, field in ((dict(attention_backend="flashinfer"), "attention_backend"), (dict(cpu_reserve=1), "cpu_reserve")):
        with pytest.raises(ValueError, match=field):
            EngineConfig(enable_deterministic_inference=True, **bad)
        EngineConfig(**bad)   # fine without the mode
