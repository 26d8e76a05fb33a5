"""FP8 weights: checkpoints with block scales (quant_method "fp8") and per-channel scales
(compressed-tensors), and online quantization of a float checkpoint (quantization="fp8"), on
every weight path. The reference is transformers' forward on the dequantized weights (W8A16 on
CPU); the weights stay in float8_e4m3fn."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from fp8_checkpoint import block_quantize, dequantized_state, make_fp8_checkpoint
from oracle import hf_model
from rollout.models import load_model, load_state_dict_from_tensors
from rollout.models.quant.fp8 import FP8_DTYPE, Fp8Linear
from tiny_models import make_engine, prefill_decode_logits, random_prompts

GREEDY = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}


def hf_on(state: dict, like: str, tmp) -> "torch.nn.Module":
    """transformers' model of checkpoint `like` with `state`'s tensors (checkpoint names, fp32)
    written over its own, loaded by transformers itself (its name conversions)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    tmp.mkdir(parents=True, exist_ok=True)
    for f in ("config.json", "generation_config.json"):
        shutil.copy(f"{like}/{f}", tmp / f)
    save_file({**load_file(f"{like}/model.safetensors"), **state}, str(tmp / "model.safetensors"))
    return AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()


def fp8_bytes(model) -> tuple[int, int]:
    """(bytes held in float8, bytes of everything)."""
    params = list(model.parameters())
    return (sum(p.numel() for p in params if p.dtype == FP8_DTYPE),
            sum(p.numel() * p.element_size() for p in params))


@pytest.fixture(scope="module")
def fp8_path(tiny_checkpoint, tmp_path_factory):
    cache = {}

    def get(arch: str, block=(16, 16)):
        key = (arch, block)
        if key not in cache:
            cache[key] = make_fp8_checkpoint(tiny_checkpoint(arch), tmp_path_factory.mktemp(f"fp8_{arch}") / "ckpt",
                                             block=block)
        return cache[key]
    return get


@pytest.mark.parametrize("arch,block", [("qwen3_moe", (16, 16)), ("deepseek_v3", (16, 16)),
                                        ("minimax_m2", (16, 16)), ("qwen3_moe", None)],
                         ids=["qwen3_moe-block", "deepseek_v3-block", "minimax_m2-block", "qwen3_moe-channel"])
def test_checkpoint_logits_equal_transformers_on_dequantized_weights(tiny_checkpoint, fp8_path, arch, block, tmp_path):
    """Attention, dense and expert weights (DeepSeek's MLA kv_b_proj included) held in FP8 with
    their scales; routers, norms, embeddings and lm_head in full precision; the logits of chunked
    prefill + paged decode equal transformers' with the dequantized weights."""
    path = fp8_path(arch, block)
    model, cfg = load_model(path, torch.float32)
    layer = model.model.layers[-1]
    assert layer.mlp.experts.w13.dtype == FP8_DTYPE and layer.mlp.experts.fp8 is not None
    assert layer.mlp.gate.weight.dtype == torch.float32
    attn = layer.self_attn
    assert isinstance(attn.o_proj, Fp8Linear) and attn.o_proj.weight.dtype == FP8_DTYPE
    held, total = fp8_bytes(model)
    float_model, _ = load_model(tiny_checkpoint(arch), torch.float32)
    assert held > 0.5 * sum(p.numel() for p in float_model.parameters())   # most weights in one byte each
    assert total < 0.5 * fp8_bytes(float_model)[1]                         # < half the fp32 model's bytes
    seq = random_prompts(5, [23])[0]
    ref = hf_on(dequantized_state(path), str(tiny_checkpoint(arch)), tmp_path / "ref")
    with torch.no_grad():
        want = ref(torch.tensor([seq])).logits[0]
    torch.testing.assert_close(prefill_decode_logits(model, seq), want, rtol=1e-4, atol=1e-4)


def test_block_dequantization_equals_transformers_own(fp8_path, tiny_checkpoint):
    """transformers' FP8 loader (FineGrainedFP8Config(dequantize=True)) reads the same weights."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    path = fp8_path("qwen3_moe")
    model, _ = load_model(path, torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                              quantization_config=FineGrainedFP8Config(dequantize=True)).eval()
    q = model.model.layers[1].self_attn.q_proj
    assert torch.equal(q.dense_weight(torch.float32), hf.model.layers[1].self_attn.q_proj.weight.float())
    seq = random_prompts(6, [19])[0]
    with torch.no_grad():
        want = hf(torch.tensor([seq])).logits[0]
    torch.testing.assert_close(prefill_decode_logits(model, seq), want, rtol=1e-4, atol=1e-4)


def test_engine_greedy_and_routing_on_fp8_checkpoint(fp8_path, tiny_checkpoint, tmp_path):
    """Through the engine (static runners, chunked prefill, prefix hits): greedy tokens and every
    routing row equal transformers' on the dequantized weights."""
    from test_gpt_oss_minimax import BUCKETS

    path = fp8_path("qwen3_moe")
    ref = hf_on(dequantized_state(path), str(tiny_checkpoint("qwen3_moe")), tmp_path / "ref")
    batch = random_prompts(7, [5, 30, 60])
    with make_engine(path, **BUCKETS) as engine:
        outs = engine.generate(input_ids=batch, sampling_params=GREEDY, return_routed_experts=True)
        again = engine.generate(input_ids=batch[1:2], sampling_params=GREEDY, return_routed_experts=True)
        engine.check_integrity()
    assert again[0].cached_tokens > 0 and again[0].output_ids == outs[1].output_ids
    for prompt, out in zip(batch, outs):
        with torch.no_grad():
            gen = ref.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                               eos_token_id=None, pad_token_id=0)
        assert out.output_ids == gen[0, len(prompt):].tolist()
        seq = torch.tensor([prompt + out.output_ids[:-1]])
        with torch.no_grad():
            logits = ref(seq, output_router_logits=True).router_logits
        for layer, lg in enumerate(logits):
            probs = torch.softmax(lg.reshape(seq.shape[1], -1).float(), dim=-1)
            want = torch.sort(torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :2], dim=-1).values
            assert torch.equal(torch.sort(out.routed_experts[:, layer], dim=-1).values, want.to(torch.int32))


def test_online_quantization_on_load_and_on_update(tiny_checkpoint, tmp_path):
    """quantization="fp8" on a float checkpoint: every linear but the lm_head and every expert
    weight held in FP8 (blocks of 128: the amax of each block / 448); a weight update with float
    tensors by transformers' names is quantized the same way; the dequantized weights are the
    pushed ones' quantize-dequantize."""
    path = tiny_checkpoint("qwen3_moe")
    model, _ = load_model(path, torch.float32, quantization="fp8")
    assert isinstance(model.model.layers[0].self_attn.q_proj, Fp8Linear)
    assert not isinstance(getattr(model, "lm_head", None), Fp8Linear)
    hf = hf_model(str(path))
    w = hf.model.layers[0].self_attn.q_proj.weight.detach()
    q, s = block_quantize(w, (128, 128))
    assert torch.equal(model.model.layers[0].self_attn.q_proj.dense_weight(torch.float32), q.float() * s)

    pushed = hf_model(str(tiny_checkpoint("qwen3_moe", seed=3)))
    update = {k: v for k, v in pushed.state_dict().items() if ".layers.1." in k}
    load_state_dict_from_tensors(model, update)
    new = pushed.model.layers[1]
    q, s = block_quantize(new.self_attn.o_proj.weight.detach(), (128, 128))
    assert torch.equal(model.model.layers[1].self_attn.o_proj.dense_weight(torch.float32), q.float() * s)
    experts = model.model.layers[1].mlp.experts
    gate_up = experts._held(0, experts.num_experts, torch.float32)[0]              # [E, 2I, H]
    q, s = block_quantize(new.mlp.experts.gate_up_proj[3, :32].detach(), (128, 128))
    assert torch.equal(gate_up[3, :32], q.float() * s)
    state = {}      # the engine's dequantized weights under the checkpoint's names
    for name, module in model.named_modules():
        if isinstance(module, Fp8Linear):
            state[f"{name}.weight"] = module.dense_weight(torch.float32)
    for i, layer in enumerate(model.model.layers):
        w13, w2, _, _ = layer.mlp.experts._held(0, 8, torch.float32)
        for e in range(8):
            prefix = f"model.layers.{i}.mlp.experts.{e}"
            state[f"{prefix}.gate_proj.weight"], state[f"{prefix}.up_proj.weight"] = w13[e].chunk(2)
            state[f"{prefix}.down_proj.weight"] = w2[e]
    state.update({k: v for k, v in update.items() if ".experts." not in k and k not in state})   # norms, router
    seq = random_prompts(8, [20])[0]
    ref = hf_on({k: v.contiguous() for k, v in state.items()}, str(path), tmp_path / "ref")
    with torch.no_grad():
        want = ref(torch.tensor([seq])).logits[0]
    torch.testing.assert_close(prefill_decode_logits(model, seq), want, rtol=1e-4, atol=1e-4)


def test_refusals_name_the_setting(fp8_path, tiny_checkpoint, tmp_path):
    from mxfp4_checkpoint import make_mxfp4_checkpoint

    path = fp8_path("qwen3_moe")
    model, _ = load_model(path, torch.float32, quantization="fp8")    # an FP8 checkpoint: as it is
    assert model.model.layers[0].mlp.experts.fp8.granularity == "block"
    mxfp4 = make_mxfp4_checkpoint(tiny_checkpoint("gpt_oss"), tmp_path / "mxfp4")
    with pytest.raises(ValueError, match="already quantized"):
        load_model(mxfp4, torch.float32, quantization="fp8")
    with pytest.raises(ValueError, match="quantization must be one of"):
        load_model(tiny_checkpoint("qwen3_moe"), torch.float32, quantization="int4")
    bad = tmp_path / "static"
    shutil.copytree(path, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["quantization_config"]["activation_scheme"] = "static"
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="activation_scheme 'static'"):
        load_model(bad, torch.float32)


@pytest.mark.slow
def test_engine_quantization_flag_and_deterministic_fp8(tiny_checkpoint):
    """`quantization="fp8"` through the engine (the server's --quantization fp8): the experts it
    reports are FP8-sized; with deterministic inference a request alone and among others, and its
    decode vs the same tokens scored as a prompt, give the same bits."""
    from test_deterministic_engine import check_batch_invariance

    path = tiny_checkpoint("qwen3_moe")
    with make_engine(path, quantization="fp8") as fp8, make_engine(path) as full:
        held = fp8.loads()[0]["expert_weight_bytes"]
        assert held < 0.3 * full.loads()[0]["expert_weight_bytes"]
    check_batch_invariance(path, quantization="fp8")


def test_get_weights_by_name_reads_the_dequantized_weight(fp8_path):
    """SGLang's /get_weights_by_name on an FP8 model returns the weight its scales make (what the
    model computes with), for a linear and for one expert's gate_proj."""
    from rollout.models.weight_reader import read_hf_weight
    from fp8_checkpoint import dequantized_state

    path = fp8_path("qwen3_moe")
    model, _ = load_model(path, torch.float32)
    want = dequantized_state(path)
    for name in ("model.layers.1.self_attn.q_proj.weight", "model.layers.2.mlp.experts.5.gate_proj.weight"):
        got = torch.tensor(read_hf_weight(model, name, 1000))
        assert torch.equal(got, want[name])


@pytest.mark.gpu
def test_gpu_w8a8_logits_close_to_w8a16(fp8_path):
    """On CUDA an FP8 block-scaled checkpoint runs W8A8 (activations quantized per token group,
    the Triton block-scaled GEMM and FP8 fused MoE); its logits stay within the activation
    quantization's error of the CPU's W8A16 ones."""
    from rollout.models.moe.block import set_moe_backend

    path = fp8_path("qwen3_moe")
    seq = random_prompts(9, [24])[0]
    cpu, _ = load_model(path, torch.float32)
    want = prefill_decode_logits(cpu, seq)
    gpu, _ = load_model(path, torch.float32, device="cuda")
    set_moe_backend(gpu, "triton")
    got = prefill_decode_logits(gpu, seq).cpu()
    rel = ((got - want).pow(2).mean() / want.pow(2).mean()).sqrt()
    assert rel < 2 ** -5, rel
