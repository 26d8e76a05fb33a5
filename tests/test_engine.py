"""Engine core against transformers: greedy outputs, logprobs, prefix cache, chunking, retraction."""

import pytest
import torch

from oracle import hf_greedy, hf_logprobs
from rollout import SamplingParams
from tiny_models import ARCHS
from tiny_models import random_prompts as prompts
from tiny_models import make_engine as _make_engine


def make_engine(path, **kw):
    return _make_engine(path, capture=False, **kw)

GREEDY = {"temperature": 0.0, "max_new_tokens": 32, "ignore_eos": True, "logprob_mode": "raw"}






@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_and_logprobs_match_transformers(tiny_checkpoint, arch):
    path = tiny_checkpoint(arch)
    batch = prompts(1, [5, 17, 40])
    with make_engine(path, chunked_prefill_size=256) as engine:
        outs = engine.generate(input_ids=batch, sampling_params=GREEDY, return_logprob=True)
        engine.check_integrity()
    for prompt, out in zip(batch, outs):
        assert out.output_ids == hf_greedy(path, prompt, 32)
        ref = hf_logprobs(path, prompt, out.output_ids)
        got = torch.tensor(out.output_logprobs)
        assert torch.allclose(got, ref, atol=1e-4, rtol=0), (got - ref).abs().max()
        assert out.finish_reason == "length" and out.prompt_tokens == len(prompt)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_large_experts_match_transformers(tiny_checkpoint, arch, monkeypatch):
    """Large experts (the CPU paths for experts larger than half FusedExperts.EXPERT_CALL_BYTES,
    forced here for the tiny ones): batches run torch's grouped GEMM over views of the weights, and
    a lone decoding request runs its experts one by one: greedy ids and logprobs are still
    transformers'."""
    from rollout.models.moe.experts import FusedExperts

    calls = {"grouped": 0, "one": 0}
    grouped, one = FusedExperts._forward_grouped, FusedExperts._one_token
    monkeypatch.setattr(FusedExperts, "EXPERT_CALL_BYTES", 1)
    monkeypatch.setattr(FusedExperts, "_forward_grouped", lambda self, *a: calls.__setitem__("grouped", calls["grouped"] + 1)
                        or grouped(self, *a))
    monkeypatch.setattr(FusedExperts, "_one_token", lambda self, *a: calls.__setitem__("one", calls["one"] + 1)
                        or one(self, *a))
    path = tiny_checkpoint(arch)
    batch = prompts(1, [5, 17, 40])
    with make_engine(path, client="inproc") as engine:   # NOTE: the monkeypatch reaches only this process
        outs = engine.generate(input_ids=batch[:1], sampling_params=GREEDY, return_logprob=True)
        outs += engine.generate(input_ids=batch[1:], sampling_params=GREEDY, return_logprob=True)
        engine.check_integrity()
    assert calls["grouped"] and calls["one"], calls
    for prompt, out in zip(batch, outs):
        assert out.output_ids == hf_greedy(path, prompt, 32)
        ref = hf_logprobs(path, prompt, out.output_ids)
        got = torch.tensor(out.output_logprobs)
        assert torch.allclose(got, ref, atol=1e-4, rtol=0), (got - ref).abs().max()


@pytest.mark.parametrize("arch", ["qwen3_moe", "olmoe"])
def test_grpo_group_decode_matches_transformers(tiny_checkpoint, arch, monkeypatch):
    """n samples of long prompts decode through the shared-prefix cascade (the prompts' KV read
    once per group) and a request in no group next to them: greedy ids and logprobs are still
    transformers'."""
    from rollout.batch.decode_cascade import DecodeCascade

    calls = []
    attend = DecodeCascade.attend
    monkeypatch.setattr(DecodeCascade, "attend", lambda self, *a: calls.append(1) or attend(self, *a))
    path = tiny_checkpoint(arch)
    long_prompts = prompts(3, [300, 150])
    loner = prompts(4, [20])[0]
    with make_engine(path, client="inproc") as engine:   # NOTE: the monkeypatch reaches only this process
        outs = engine.generate(input_ids=long_prompts + [loner],
                               sampling_params=[{**GREEDY, "n": 8, "max_new_tokens": 24}] * 2
                               + [{**GREEDY, "max_new_tokens": 24}], return_logprob=True)
        engine.check_integrity()
    assert len(outs) == 17 and calls, "the decode steps never took the cascade"
    for i, prompt in enumerate(long_prompts + [loner]):
        want = hf_greedy(path, prompt, 24)
        ref = hf_logprobs(path, prompt, want)
        for out in outs[8 * i: 8 * i + 8] if i < 2 else outs[16:]:
            assert out.output_ids == want
            assert torch.allclose(torch.tensor(out.output_logprobs), ref, atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def qwen3(tiny_checkpoint):
    return tiny_checkpoint("qwen3_moe")


@pytest.fixture(scope="module")
def baseline(qwen3):
    batch = prompts(2, [3, 9, 30, 64, 64])
    batch[4] = batch[3][:40] + batch[4][40:]  # shares a 40-token prefix with prompt 3
    with make_engine(qwen3, enable_prefix_caching=False, chunked_prefill_size=1024) as engine:
        outs = engine.generate(input_ids=batch, sampling_params=GREEDY, return_logprob=True)
    return batch, outs


def _same(a, b):
    assert [o.output_ids for o in a] == [o.output_ids for o in b]
    for i, (x, y) in enumerate(zip(a, b)):
        got, want = torch.tensor(x.output_logprobs), torch.tensor(y.output_logprobs)
        diff = (got - want).abs()
        assert torch.allclose(got, want, atol=1e-4), (
            f"request {i}: logprobs differ by up to {float(diff.max()):.2e} (token {int(diff.argmax())}; "
            f"{int((diff > 1e-5).sum())} of {len(diff)} tokens above 1e-5)")


@pytest.mark.parametrize("chunk", [1, 7, 32])
def test_chunked_prefill_same_outputs(qwen3, baseline, chunk):
    batch, ref = baseline
    with make_engine(qwen3, chunked_prefill_size=chunk) as engine:
        outs = engine.generate(input_ids=batch, sampling_params=GREEDY, return_logprob=True)
        engine.check_integrity()
    _same(outs, ref)


def test_prefix_cache_hits_same_outputs(qwen3, baseline):
    batch, ref = baseline
    with make_engine(qwen3) as engine:
        first = engine.generate(input_ids=batch, sampling_params=GREEDY, return_logprob=True)
        second = engine.generate(input_ids=batch, sampling_params=GREEDY, return_logprob=True)
        engine.check_integrity()
        assert engine.flush_cache()
        third = engine.generate(input_ids=batch[:1], sampling_params=GREEDY, return_logprob=True)
        engine.check_integrity()
    _same(first, ref)
    _same(second, ref)
    assert first[4].cached_tokens >= 40  # waited one step for prompt 3's prefix
    assert all(o.cached_tokens == len(p) - 1 for o, p in zip(second, batch))
    assert third[0].cached_tokens == 0


def test_n_samples_share_prompt_kv(qwen3):
    prompt = prompts(3, [48])[0]
    params = {"temperature": 1.0, "max_new_tokens": 8, "n": 8, "sampling_seed": 7}
    with make_engine(qwen3) as engine:
        outs = engine.generate(input_ids=[prompt], sampling_params=params)
        stats = engine.stats()
    assert len(outs) == 8
    assert sorted(o.cached_tokens for o in outs)[1:] == [47] * 7
    assert stats["prompt_tokens"] == 8 * 48
    assert len({tuple(o.output_ids) for o in outs}) > 1  # each sample has its own seed


def test_retraction_resumes_exactly(qwen3, baseline):
    batch, ref = baseline
    with make_engine(qwen3, max_total_tokens=110, enable_prefix_caching=True) as engine:
        outs = engine.generate(input_ids=batch, sampling_params=GREEDY, return_logprob=True)
        stats = engine.stats()
        engine.check_integrity()
    assert stats["num_retractions"] > 0
    assert any(o.num_retractions for o in outs)
    _same(outs, ref)


def test_seeded_sampling_independent_of_batch(qwen3):
    target = prompts(4, [12])[0]
    others = prompts(5, [3, 20, 33])
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, max_new_tokens=24, sampling_seed=1234,
                            ignore_eos=True)
    other_params = SamplingParams(temperature=1.0, max_new_tokens=10, ignore_eos=True)
    with make_engine(qwen3) as engine:
        alone = engine.generate(input_ids=[target], sampling_params=params)[0]
        mixed = engine.generate(input_ids=others[:1] + [target] + others[1:],
                                sampling_params=[other_params, params, other_params, other_params])[1]
        reseeded = engine.generate(input_ids=[target], sampling_params=params.replace(sampling_seed=99))[0]
    assert alone.output_ids == mixed.output_ids
    assert alone.output_ids != reseeded.output_ids


def test_streaming_and_async(qwen3):
    import asyncio

    batch = prompts(6, [10, 20])
    with make_engine(qwen3) as engine:
        final = engine.generate(input_ids=batch, sampling_params=GREEDY, return_logprob=True)
        chunks = list(engine.generate(input_ids=batch, sampling_params=GREEDY, return_logprob=True, stream=True))

        async def run():
            got = await engine.async_generate(input_ids=batch, sampling_params=GREEDY)
            streamed = [c async for c in engine.async_generate(input_ids=batch[:1], sampling_params=GREEDY,
                                                               stream=True)]
            return got, streamed

        got, streamed = asyncio.run(run())
    for out in final:
        mine = [c for c in chunks if c.rid.startswith(out.rid[:0]) and c.output and c.output.prompt_ids == out.prompt_ids]
        assert mine
    by_prompt = {}
    for c in chunks:
        by_prompt.setdefault(c.rid, []).append(c)
    assert len(by_prompt) == 2
    for rid, cs in by_prompt.items():
        assert cs[-1].finished and sum(1 for c in cs if c.finished) == 1
        ids = [t for c in cs for t in c.output_ids]
        assert ids == cs[-1].output.output_ids
        assert "".join(c.text for c in cs) == cs[-1].output.text
        assert [lp for c in cs for lp in c.output_logprobs] == cs[-1].output.output_logprobs
    assert [o.output_ids for o in got] == [o.output_ids for o in final]
    assert [t for c in streamed for t in c.output_ids] == final[0].output_ids


def test_stop_conditions(qwen3):
    prompt = prompts(7, [15])[0]
    with make_engine(qwen3) as engine:
        free = engine.generate(input_ids=[prompt], sampling_params=GREEDY)[0]
        tok = free.output_ids[5]
        first = free.output_ids.index(tok)
        stopped = engine.generate(input_ids=[prompt], sampling_params={**GREEDY, "stop_token_ids": [tok]})[0]
        assert stopped.output_ids == free.output_ids[:first + 1]
        assert stopped.finish_reason == "stop" and stopped.finish_info["matched"] == tok
        at_least = engine.generate(input_ids=[prompt], sampling_params={**GREEDY, "stop_token_ids": [tok],
                                                                         "min_new_tokens": first + 2})[0]
        assert len(at_least.output_ids) > first + 1 and tok not in at_least.output_ids[:first + 2]
        text = free.text
        needle = text[len(text) // 2: len(text) // 2 + 2]
        if needle.strip():
            s = engine.generate(input_ids=[prompt], sampling_params={**GREEDY, "stop": [needle]})[0]
            assert s.finish_reason == "stop" and s.finish_info["matched"] == needle
            assert needle not in s.text and text.startswith(s.text)
            kept = engine.generate(input_ids=[prompt], sampling_params={**GREEDY, "stop": [needle],
                                                                        "no_stop_trim": True})[0]
            assert kept.text.endswith(needle) or needle in kept.text
        zero = engine.generate(input_ids=[prompt], sampling_params={"max_new_tokens": 0})[0]
        assert zero.output_ids == [] and zero.finish_reason == "length"
        engine.check_integrity()
    # a prompt's last token computed by a decode step (chunked prefill of 1 token)
    with make_engine(qwen3, chunked_prefill_size=1) as engine:
        zero, one = engine.generate(input_ids=[prompt[:5], prompt[:6]],
                                    sampling_params=[{"max_new_tokens": 0}, {**GREEDY, "max_new_tokens": 1}])
        assert zero.output_ids == [] and zero.finish_reason == "length"
        assert len(one.output_ids) == 1 and one.finish_reason == "length"
        engine.check_integrity()


def test_to_dict_shape(qwen3):
    with make_engine(qwen3) as engine:
        out = engine.generate(input_ids=[[5, 6, 7]], sampling_params={**GREEDY, "max_new_tokens": 4},
                              return_logprob=True, rid="abc")[0]
    d = out.to_dict()
    assert d["output_ids"] == out.output_ids and d["text"] == out.text
    meta = d["meta_info"]
    assert meta["id"] == "abc" and meta["finish_reason"] == {"type": "length", "length": 4}
    assert meta["prompt_tokens"] == 3 and meta["completion_tokens"] == 4
    assert [row[1] for row in meta["output_token_logprobs"]] == out.output_ids
    assert meta["weight_version"] == "default"


def test_top_logprobs_and_modes(qwen3):
    prompt = prompts(8, [11])[0]
    with make_engine(qwen3) as engine:
        out = engine.generate(input_ids=[prompt], sampling_params={**GREEDY, "max_new_tokens": 6},
                              return_logprob=True, top_logprobs_num=5)[0]
        scaled = engine.generate(input_ids=[prompt], return_logprob=True,
                                 sampling_params={"temperature": 0.5, "max_new_tokens": 6, "ignore_eos": True,
                                                  "sampling_seed": 3, "logprob_mode": "scaled"})[0]
        processed = engine.generate(input_ids=[prompt], return_logprob=True,
                                    sampling_params={"temperature": 0.5, "top_k": 3, "max_new_tokens": 6,
                                                     "ignore_eos": True, "sampling_seed": 3,
                                                     "logprob_mode": "processed"})[0]
    from oracle import hf_model

    with torch.no_grad():
        logits = hf_model(str(qwen3))(torch.tensor([prompt + out.output_ids])).logits[0].float()
    lp = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)
    for i, row in enumerate(out.output_top_logprobs):
        ref_lp, ref_ids = torch.topk(lp[i], 5)
        assert [t for _, t in row] == ref_ids.tolist()
        assert torch.allclose(torch.tensor([v for v, _ in row]), ref_lp, atol=1e-4)
    with torch.no_grad():
        logits = hf_model(str(qwen3))(torch.tensor([prompt + scaled.output_ids])).logits[0].float()
    ref = torch.log_softmax(logits[len(prompt) - 1:-1] / 0.5, dim=-1)
    ref = ref.gather(1, torch.tensor(scaled.output_ids)[:, None]).squeeze(1)
    assert torch.allclose(torch.tensor(scaled.output_logprobs), ref, atol=1e-4)
    with torch.no_grad():
        logits = hf_model(str(qwen3))(torch.tensor([prompt + processed.output_ids])).logits[0].float()
    scaled_logits = logits[len(prompt) - 1:-1] / 0.5
    kth = torch.topk(scaled_logits, 3, dim=-1).values[:, -1:]
    ref = torch.log_softmax(scaled_logits.masked_fill(scaled_logits < kth, float("-inf")), dim=-1)
    ref = ref.gather(1, torch.tensor(processed.output_ids)[:, None]).squeeze(1)
    assert torch.allclose(torch.tensor(processed.output_logprobs), ref, atol=1e-4)


def test_bfloat16_engine_runs(qwen3):
    prompt = prompts(9, [13])[0]
    with make_engine(qwen3, dtype="bfloat16", enable_return_routed_experts=True) as engine:
        out = engine.generate(input_ids=[prompt], sampling_params={**GREEDY, "max_new_tokens": 8},
                              return_logprob=True, return_routed_experts=True)[0]
        engine.check_integrity()
    ref = hf_greedy(qwen3, prompt, 8)
    assert len(out.output_ids) == 8 and all(torch.isfinite(torch.tensor(out.output_logprobs)))
    assert out.output_ids[:2] == ref[:2]  # bf16 rounding may drift later tokens
    assert out.routed_experts.shape == (len(prompt) + 7, 3, 2)
