"""Routed-expert capture against transformers' router top-k, for every architecture and path."""
import asyncio

import pytest
import torch

from capture.codec import decode_routed_experts
from oracle import hf_router_topk, same_sets
from rollout import Rollout
from rollout.config import DEFAULT_MODEL_PATH
from tiny_models import ARCHS
from tiny_models import make_engine, random_prompts as prompts

GREEDY = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}
SAMPLED = {"temperature": 1.0, "top_p": 0.95, "max_new_tokens": 12, "ignore_eos": True, "sampling_seed": 11}






def check_rows(path, out, start=0):
    seq = out.prompt_ids + out.output_ids
    info_layers = out.routed_experts.shape[1]
    top_k = out.routed_experts.shape[2]
    ref = hf_router_topk(path, seq[:-1], top_k, info_layers)[start:]
    assert out.routed_experts.dtype == torch.int32
    assert out.routed_experts.shape == (len(seq) - 1 - start, info_layers, top_k)
    assert same_sets(out.routed_experts, ref), (out.routed_experts != ref).nonzero()[:5]
    # the wire format is what SGLang users decode
    wire = out.to_dict()["meta_info"]["routed_experts"]
    assert torch.equal(decode_routed_experts(wire, "int32", num_layers=info_layers, top_k=top_k), out.routed_experts)
    compact = out.to_dict("compact")["meta_info"]["routed_experts"]
    assert torch.equal(decode_routed_experts(compact, "compact"), out.routed_experts)


@pytest.mark.parametrize("arch", ARCHS)
def test_batch_greedy_and_sampled(tiny_checkpoint, arch):
    path = tiny_checkpoint(arch)
    batch = prompts(1, [4, 19, 37])
    with make_engine(path) as engine:
        for params in (GREEDY, SAMPLED):
            outs = engine.generate(input_ids=batch, sampling_params=params, return_routed_experts=True)
            for out in outs:
                check_rows(path, out)
        engine.check_integrity()
    if arch == "qwen2_moe":  # layer 0 is dense (mlp_only_layers): all -1
        assert (outs[0].routed_experts[:, 0] == -1).all() and (outs[0].routed_experts[:, 1:] >= 0).all()


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_n_samples_prefix_hits_and_warm_round(tiny_checkpoint, arch):
    path = tiny_checkpoint(arch)
    prompt = prompts(2, [30])[0]
    with make_engine(path) as engine:
        for _ in range(2):
            outs = engine.generate(input_ids=[prompt], sampling_params={**SAMPLED, "n": 8},
                                   return_routed_experts=True)
            assert sum(o.cached_tokens > 0 for o in outs) >= 7
            for out in outs:
                check_rows(path, out)
        assert all(o.cached_tokens == 29 for o in outs)  # second round: the whole prompt is warm
        engine.check_integrity()


@pytest.mark.parametrize("chunk", [1, 5, 16])
def test_chunked_prefill(tiny_checkpoint, chunk):
    path = tiny_checkpoint("mixtral")
    with make_engine(path, chunked_prefill_size=chunk) as engine:
        for out in engine.generate(input_ids=prompts(3, [9, 23]), sampling_params=GREEDY,
                                   return_routed_experts=True):
            check_rows(path, out)


def test_retraction_keeps_rows_paired(tiny_checkpoint):
    path = tiny_checkpoint("olmoe")
    batch = prompts(4, [20, 25, 30, 35])
    params = {**SAMPLED, "max_new_tokens": 30}
    with make_engine(path, enable_prefix_caching=False) as engine:
        ref = engine.generate(input_ids=batch, sampling_params=params, return_routed_experts=True,
                              return_logprob=True)
    with make_engine(path, max_total_tokens=120) as engine:
        outs = engine.generate(input_ids=batch, sampling_params=params, return_routed_experts=True,
                               return_logprob=True)
        assert engine.stats()["num_retractions"] > 0
        engine.check_integrity()
    assert any(o.num_retractions for o in outs)
    for out, r in zip(outs, ref):
        assert out.output_ids == r.output_ids
        check_rows(path, out)


def test_abort_mid_decode_partial_rows(tiny_checkpoint):
    path = tiny_checkpoint("qwen3_moe")
    prompt = prompts(5, [14])[0]
    with make_engine(path) as engine:
        stream = engine.generate(input_ids=[prompt], sampling_params={**GREEDY, "max_new_tokens": 450},
                                 return_routed_experts=True, stream=True, rid="victim")
        got = []
        for chunk in stream:
            got.append(chunk)
            if len(got) == 5:
                assert engine.abort("victim")
        final = got[-1].output
        engine.check_integrity()
    assert final.finish_reason == "abort" and 5 <= len(final.output_ids) < 450
    check_rows(path, final)
    assert torch.equal(torch.cat([c.routed_experts for c in got]), final.routed_experts)


def test_start_len_and_streaming_chunks(tiny_checkpoint):
    path = tiny_checkpoint("qwen2_moe")
    batch = prompts(6, [12, 21])
    with make_engine(path) as engine:
        outs = engine.generate(input_ids=batch, sampling_params=GREEDY, return_routed_experts=True,
                               routed_experts_start_len=[5, 21])
        for out, start in zip(outs, [5, 21]):
            assert out.routed_experts_start_len == start
            check_rows(path, out, start)
        chunks = list(engine.generate(input_ids=batch, sampling_params=GREEDY, return_routed_experts=True,
                                      routed_experts_start_len=3, stream=True))

        async def collect():
            return [c async for c in engine.async_generate(input_ids=batch[:1], sampling_params=GREEDY,
                                                           return_routed_experts=True, stream=True,
                                                           routed_experts_start_len=3)]

        achunks = asyncio.run(collect())
    by_rid = {}
    for c in chunks:
        by_rid.setdefault(c.rid, []).append(c)
    for cs in list(by_rid.values()) + [achunks]:
        final = cs[-1].output
        pos = 3
        for c in cs:
            assert c.routed_experts_start == pos
            pos += c.routed_experts.shape[0]
        assert torch.equal(torch.cat([c.routed_experts for c in cs]), final.routed_experts)
        check_rows(path, final, 3)


def test_flush_invalidates_cached_routing(tiny_checkpoint):
    path = tiny_checkpoint("qwen3_moe")
    prompt = prompts(7, [16])[0]
    with make_engine(path) as engine:
        a = engine.generate(input_ids=[prompt], sampling_params=GREEDY, return_routed_experts=True)[0]
        assert engine.flush_cache()
        b = engine.generate(input_ids=[prompt], sampling_params=GREEDY, return_routed_experts=True)[0]
    assert b.cached_tokens == 0 and torch.equal(a.routed_experts, b.routed_experts)


def test_exact_ties_pick_lower_expert_id(tiny_checkpoint, tmp_path):
    """Two experts with identical router rows tie exactly; the lower expert id wins.

    Only the last layer is tied: transformers' own forward breaks ties with torch.topk (unspecified
    order), so a tie in an earlier layer would send its hidden states down other experts.
    """
    import shutil

    from safetensors.torch import load_file, save_file

    src = tiny_checkpoint("mixtral")
    dst = tmp_path / "tied"
    shutil.copytree(src, dst)
    weights = load_file(dst / "model.safetensors")
    last = max(k for k in weights if k.endswith("gate.weight") and "experts" not in k)
    w = weights[last].clone()
    w[1:4] = w[0]              # experts 0-3 tie exactly on every token
    w[4:] = w[0] - 5.0 * w[0].sign()   # and the rest rank below them (x . sign(w0) > 0 mostly)
    weights[last] = w
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    with make_engine(dst) as engine:
        out = engine.generate(input_ids=prompts(8, [24]), sampling_params=GREEDY, return_routed_experts=True)[0]
    check_rows(dst, out)
    from oracle import hf_model

    seq = (out.prompt_ids + out.output_ids)[:-1]
    logits = hf_model(str(dst))(torch.tensor([seq]), output_router_logits=True).router_logits
    straddles = 0
    for layer, lg in enumerate(logits):
        probs = torch.softmax(lg.float(), dim=-1)
        vals, _ = torch.sort(probs, dim=-1, descending=True)
        for row in (vals[:, 1] == vals[:, 2]).nonzero().flatten().tolist():
            tied = (probs[row] == vals[row, 1]).nonzero().flatten().tolist()
            chosen = set(out.routed_experts[row, layer].tolist())
            assert min(tied) in chosen and max(tied) not in chosen
            straddles += 1
    assert straddles > 0  # the tie really sat at the top-k boundary


def test_capture_off_rejects_and_costs_nothing(tiny_checkpoint):
    with Rollout(str(tiny_checkpoint("qwen3_moe")), tokenizer_path=DEFAULT_MODEL_PATH) as engine:
        assert engine.stats()["capture_buffer_bytes"] == 0
        with pytest.raises(ValueError, match="return_routed_experts"):
            engine.generate(input_ids=[[5, 6]], return_routed_experts=True)
        out = engine.generate(input_ids=[[5, 6]], sampling_params={"max_new_tokens": 2})[0]
        assert out.routed_experts is None and "routed_experts" not in out.to_dict()["meta_info"]
