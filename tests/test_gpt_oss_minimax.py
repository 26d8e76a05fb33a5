"""gpt-oss and MiniMax-M2 against transformers: the model layer (chunked prefill + paged decode
logits), the checkpoint forms (gpt-oss's MXFP4 experts, BF16, weight updates by transformers'
names), and through the engine: greedy tokens and every routing row (static runners, chunked
prefill, prefix-cache hits, retraction, streaming, DP attention with expert parallelism, the
Triton kernels under the interpreter)."""
from __future__ import annotations

import functools
import json
import shutil

import pytest
import torch

from mxfp4_checkpoint import make_mxfp4_checkpoint
from oracle import hf_greedy, hf_model
from rollout.models import load_model
from tiny_models import NEW_ARCHS, make_engine, prefill_decode_logits, random_prompts

GREEDY = {"temperature": 0.0, "max_new_tokens": 10, "ignore_eos": True}
BUCKETS = dict(decode_graph_batch_sizes=(1, 2, 4), prefill_graph_token_sizes=(16, 32), chunked_prefill_size=48)
ROUTERS = ("GptOssTopKRouter", "MiniMaxM2TopKRouter")


@functools.lru_cache(maxsize=16)
def hf_routing(path: str, seq: tuple[int, ...]) -> torch.Tensor:
    """[T, L, K] top-k ids of transformers' own router modules over seq, sorted per row."""
    model = hf_model(path)
    cfg = model.config
    ids = torch.full((len(seq), cfg.num_hidden_layers, cfg.num_experts_per_tok), -1, dtype=torch.int32)
    handles = []
    for name, router in model.named_modules():
        if type(router).__name__ in ROUTERS:
            layer = int(name.split(".")[2])

            def hook(module, args, out, layer=layer):
                ids[:, layer] = torch.sort(out[2], dim=-1).values.to(torch.int32)
            handles.append(router.register_forward_hook(hook))
    assert len(handles) == cfg.num_hidden_layers
    try:
        with torch.no_grad():
            model(torch.tensor([seq]))
    finally:
        for h in handles:
            h.remove()
    return ids


def assert_matches_hf(path, prompt, out):
    """Greedy tokens equal transformers'; every routing row (prompt and output) equals its router's."""
    assert out.output_ids == hf_greedy(path, list(prompt), len(out.output_ids))
    want = hf_routing(str(path), tuple(prompt) + tuple(out.output_ids[:-1]))
    got = torch.sort(out.routed_experts, dim=-1).values
    assert got.shape == want.shape and torch.equal(got, want)


# ---- the model layer ---------------------------------------------------------------------------

@pytest.mark.parametrize("arch", NEW_ARCHS)
def test_prefill_then_decode_match_hf(tiny_checkpoint, arch):
    """Logits over the KV pool equal transformers' full forward; gpt-oss's sequence is longer than
    its sliding window (8), so windowed and full layers, sinks and YaRN all count."""
    path = tiny_checkpoint(arch)
    model, _ = load_model(path, torch.float32)
    spec = model.spec
    if arch == "gpt_oss":
        assert spec.sliding_windows == (8, None, 8) and spec.attention_sinks and spec.scoring == "topk_softmax"
        assert model.model.layers[0].mlp.experts.b13.shape == (8, 128)
    else:
        assert spec.qk_norm == "full" and spec.rotary_dim == 8 and spec.scoring == "sigmoid" and spec.n_group == 1
    seq = random_prompts(5, [23])[0]
    with torch.no_grad():
        want = hf_model(str(path))(torch.tensor([seq])).logits[0]
    torch.testing.assert_close(prefill_decode_logits(model, seq), want, rtol=1e-4, atol=1e-4)


def test_gpt_oss_mxfp4_checkpoint(tiny_checkpoint, tmp_path):
    """gpt-oss as shipped (MXFP4 expert blocks / scales): dequantized on load to what transformers
    holds after its own dequantization; logits equal that model's; router, attention and sinks
    stay as stored. A checkpoint of another quant_method is refused by name before loading."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    src = tiny_checkpoint("gpt_oss")
    path = make_mxfp4_checkpoint(src, tmp_path / "mxfp4")
    model, cfg = load_model(path, torch.float32)
    assert cfg["quantization_config"]["quant_method"] == "mxfp4"
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                              quantization_config=Mxfp4Config(dequantize=True)).eval()
    hf_experts = hf.model.layers[1].mlp.experts
    ours = model.model.layers[1].mlp.experts
    assert torch.equal(ours.w2, hf_experts.down_proj.transpose(1, 2))
    assert torch.equal(ours.w13[:, :64], hf_experts.gate_up_proj[..., 0::2].transpose(1, 2))
    float_model, _ = load_model(src, torch.float32)
    assert not torch.equal(ours.w13, float_model.model.layers[1].mlp.experts.w13)   # really quantized
    seq = random_prompts(6, [21])[0]
    with torch.no_grad():
        want = hf(torch.tensor([seq])).logits[0]
    torch.testing.assert_close(prefill_decode_logits(model, seq), want, rtol=1e-4, atol=1e-4)

    bad = tmp_path / "fp8"
    shutil.copytree(path, bad)
    cfg["quantization_config"] = {"quant_method": "awq"}
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="awq"):
        load_model(bad, torch.float32)


def test_gpt_oss_bf16_checkpoint_and_weight_update_by_hf_names(tiny_checkpoint):
    """A BF16 gpt-oss checkpoint loads (sinks and routers kept in fp32); a weight update with
    transformers' in-memory names and layouts (gate_up_proj [E, H, 2I] interleaved, its bias,
    down_proj [E, I, H], router, sinks) gives transformers' logits for the updated model."""
    path = tiny_checkpoint("gpt_oss", dtype="bfloat16")
    model, _ = load_model(path, "bfloat16")
    assert model.model.layers[0].self_attn.attn.sinks.dtype == torch.float32
    assert model.model.layers[0].mlp.experts.w13.dtype == torch.bfloat16

    fresh = tiny_checkpoint("gpt_oss")
    model, _ = load_model(fresh, torch.float32)
    hf = hf_model(str(tiny_checkpoint("gpt_oss", seed=1)))
    update = {k: v for k, v in hf.state_dict().items() if ".mlp." in k or k.endswith(".sinks")}
    assert any(k.endswith("gate_up_proj") for k in update) and any(k.endswith("router.bias") for k in update)
    from rollout.models import load_state_dict_from_tensors
    load_state_dict_from_tensors(model, update)
    mixed = hf_model(str(fresh))
    state = {**mixed.state_dict(), **update}
    from transformers import AutoModelForCausalLM
    ref = AutoModelForCausalLM.from_config(mixed.config, dtype=torch.float32).eval()
    ref.load_state_dict(state)
    seq = random_prompts(7, [19])[0]
    with torch.no_grad():
        want = ref(torch.tensor([seq])).logits[0]
    torch.testing.assert_close(prefill_decode_logits(model, seq), want, rtol=1e-4, atol=1e-4)


# ---- through the engine ------------------------------------------------------------------------

@pytest.mark.parametrize("arch", NEW_ARCHS)
def test_engine_greedy_and_routing_match_hf(tiny_checkpoint, arch):
    """Static runners (decode buckets, piecewise prefill), chunked prefill and prefix-cache hits:
    tokens and every routing row equal transformers' routers'."""
    path = tiny_checkpoint(arch)
    batch = random_prompts(7, [5, 30, 60, 12])
    with make_engine(path, **BUCKETS) as engine:
        first = engine.generate(input_ids=batch, sampling_params=GREEDY, return_routed_experts=True)
        again = engine.generate(input_ids=batch[1:3], sampling_params=GREEDY, return_routed_experts=True)
        stats = engine.stats()
        engine.check_integrity()
    assert stats.get("forwards_decode_graph", 0) > 0 and stats.get("forwards_prefill_graph", 0) > 0
    assert all(o.cached_tokens > 0 for o in again)
    for prompt, out in zip(batch + batch[1:3], first + again):
        assert (out.routed_experts >= 0).all()
        assert_matches_hf(path, prompt, out)


@pytest.mark.parametrize("arch", NEW_ARCHS)
def test_engine_streaming_and_retraction_match_hf(tiny_checkpoint, arch):
    """A KV pool too small for the batch (retractions) with streamed requests: the streamed chunks
    add up to the non-streamed outputs, and tokens and routing rows equal transformers'."""
    path = tiny_checkpoint(arch)
    batch = random_prompts(8, [20, 25, 30, 18])
    params = dict(GREEDY, max_new_tokens=16)
    with make_engine(path, max_total_tokens=100) as engine:
        outs = engine.generate(input_ids=batch, sampling_params=params, return_routed_experts=True)
        stats = engine.stats()
        chunks = list(engine.generate(input_ids=batch[:2], sampling_params=params, return_routed_experts=True,
                                      stream=True))
        engine.check_integrity()
    assert stats["num_retractions"] > 0
    for prompt, out in zip(batch, outs):
        assert_matches_hf(path, prompt, out)
    by_rid: dict[str, list] = {}
    for c in chunks:
        by_rid.setdefault(c.rid, []).append(c)
    assert len(by_rid) == 2
    for cs in by_rid.values():
        final = cs[-1].output
        i = batch.index(final.prompt_ids)
        assert final.output_ids == outs[i].output_ids == [t for c in cs for t in c.output_ids]
        rows = torch.cat([c.routed_experts for c in cs if c.routed_experts is not None])
        assert torch.equal(rows, outs[i].routed_experts)


@pytest.mark.slow
@pytest.mark.parametrize("arch", NEW_ARCHS)
def test_dp2_expert_sharded_matches_hf(tiny_checkpoint, arch):
    """DP attention over 2 ranks with the experts (and gpt-oss's expert biases) sharded: uneven
    loads, static and eager runners; tokens and routing rows equal transformers'."""
    path = tiny_checkpoint(arch)
    batch = random_prompts(9, [7, 3, 50, 12])
    with make_engine(path, dp_size=2, **BUCKETS) as engine:
        outs = engine.generate(input_ids=batch, sampling_params=GREEDY, return_routed_experts=True,
                               routed_dp_rank=[0, 1, 0, 1])
        loads = engine.loads()
        engine.check_integrity()
    assert [row["experts_held"] for row in loads] == [[0, 4], [4, 8]]
    for prompt, out in zip(batch, outs):
        assert_matches_hf(path, prompt, out)


@pytest.mark.interpreter
@pytest.mark.parametrize("arch", NEW_ARCHS)
def test_triton_backends_match_hf(tiny_checkpoint, arch):
    """moe_backend and attention_backend 'triton' (Triton's interpreter on CPU): gpt-oss's sinks and
    sliding windows in the attention kernels, its biased clamped-SwiGLU experts in the fused MoE;
    MiniMax-M2's sigmoid router kernel; tokens and routing rows equal transformers'."""
    path = tiny_checkpoint(arch)
    batch = random_prompts(16, [9, 21])
    with make_engine(path, moe_backend="triton", attention_backend="triton", client="inproc") as engine:
        outs = engine.generate(input_ids=batch, sampling_params=dict(GREEDY, max_new_tokens=4),
                               return_routed_experts=True)
        bound = engine.debug(lambda core: core.runner.runners["eager"].attention is not None)
    assert bound
    for prompt, out in zip(batch, outs):
        assert_matches_hf(path, prompt, out)
