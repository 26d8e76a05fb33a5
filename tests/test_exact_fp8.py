"""Exact on-policy over FP8 rollouts: a deterministic engine with `quantization="fp8"` (the
server's --quantization fp8: the float weights quantized on load and at every update) and the
exact trainer computing with the same FP8 weights (trainer_bridge.exact_fp8) give the same bits;
its gradient reaches the float master weights straight through the quantization.
"""
from __future__ import annotations

import pytest
import torch

from test_exact_trainer import (PACKINGS, _check_equal_to_rollout, _check_grpo_step, _forward, _load,
                                _rollout_samples, check_exact_loop)
from tiny_models import ARCHS, GROUPED_ARCHS, NEW_ARCHS

FP8 = {"quantization": "fp8"}


@pytest.fixture(scope="module")
def qwen3_fp8(tiny_checkpoint):
    path = tiny_checkpoint("qwen3_moe")
    return path, _rollout_samples(path, **FP8)


def test_fake_quantize_is_what_the_engine_computes_with(tiny_checkpoint):
    """Every weight the engine holds in FP8 (online), dequantized as its layers do, equals
    fake_quantize of the float weight the trainer holds; the weights it keeps float are untouched."""
    from rollout.models.quant.fp8 import FP8_DTYPE, Fp8Linear, fake_quantize

    path = tiny_checkpoint("qwen3_moe")
    trainer = _load(path, exact=True, fp8=True)
    hf = {k: v for k, v in trainer.state_dict().items()}
    from rollout.models.registry import load_model

    model, _ = load_model(path, dtype=torch.float32, **FP8)                # as the engine loads it
    held = {f"{n}.weight": m.dense_weight(torch.float32) for n, m in model.named_modules()
            if isinstance(m, Fp8Linear)}
    for n, m in model.named_modules():
        if getattr(m, "fp8", None) is not None and hasattr(m, "w13"):
            held[f"{n.rpartition('.')[0]}.experts.gate_up_proj"] = m.dense("w13", 0, m.num_experts, torch.float32)
            held[f"{n.rpartition('.')[0]}.experts.down_proj"] = m.dense("w2", 0, m.num_experts, torch.float32)
    held["fp8"] = sum(p.dtype == FP8_DTYPE for p in model.parameters())
    assert held.pop("fp8") == len(held)
    for name, weight in held.items():
        master = hf[name]
        want = fake_quantize(master, halves=2 if name.endswith("gate_up_proj") else 1)
        assert torch.equal(weight, want), name
        assert not torch.equal(want, master), name                     # FP8 really rounds them
    # what the trainer's forward reads: the same FP8 form; its parameters stay float
    attn = trainer.model.layers[0].self_attn
    assert torch.equal(attn.q_proj.weight, held["model.layers.0.self_attn.q_proj.weight"])
    assert attn.q_proj._parameters["weight"].dtype == torch.float32
    assert torch.equal(trainer.state_dict()["model.layers.0.self_attn.q_proj.weight"], hf[
        "model.layers.0.self_attn.q_proj.weight"])
    assert not any(name.startswith("lm_head") or "norm" in name or "router" in name for name in held)


def test_exact_fp8_logprobs_and_routing_equal_rollout_qwen3(qwen3_fp8):
    _check_equal_to_rollout(*qwen3_fp8, fp8=True)


@pytest.mark.slow
@pytest.mark.parametrize("arch", [a for a in ARCHS + GROUPED_ARCHS + NEW_ARCHS
                                  if a not in ("qwen3_moe", "gpt_oss")])
def test_exact_fp8_logprobs_and_routing_equal_rollout_other_archs(tiny_checkpoint, arch):
    path = tiny_checkpoint(arch)
    _check_equal_to_rollout(path, _rollout_samples(path, seed=9, **FP8), packings=PACKINGS[1:3], fp8=True)


def test_straight_through_gradient(qwen3_fp8):
    """The FP8 trainer's gradient on each master weight is the gradient the same exact forward
    gives on the FP8 weights themselves (a float model loaded with them), bit for bit."""
    from trainer_bridge.packing import pack_samples

    path, samples = qwen3_fp8
    fp8 = _load(path, exact=True, fp8=True)
    quantized = _load(path, exact=True)
    with torch.no_grad():
        for (name, p), q in zip(fp8.named_parameters(), quantized.parameters()):
            module_name, _, attr = name.rpartition(".")
            q.copy_(getattr(fp8.get_submodule(module_name), attr))      # the FP8 form where it has one
    mb = pack_samples(samples, pad_to_multiple=16)[0]
    weights = torch.linspace(-1.0, 1.0, mb.num_tokens)[None] * mb.loss_mask
    for model in (fp8, quantized):
        _, lp, _ = _forward(model, mb, mode="replay")
        (lp * weights).sum().backward()
    changed = 0
    for (name, p), q in zip(fp8.named_parameters(), quantized.parameters()):
        assert p.grad is not None and torch.equal(p.grad, q.grad), name
        changed += not torch.equal(p, q)
    assert changed > 0                                                  # some weights are FP8-rounded


def test_grpo_step_under_deepspeed_is_exactly_on_policy_fp8(qwen3_fp8):
    _check_grpo_step(*qwen3_fp8, **FP8)


@pytest.mark.parametrize("sync", ["tensor", pytest.param("disk", marks=pytest.mark.slow),
                                  pytest.param("distributed", marks=pytest.mark.slow)])
def test_exact_fp8_loop_stays_exact_across_weight_syncs(tmp_path, capsys, sync):
    """configs/train/exact-fp8.yaml end to end: FP8 deterministic servers re-quantizing every push,
    the exact trainer on the same FP8 weights."""
    cfg = check_exact_loop("exact-fp8.yaml", tmp_path, capsys, sync)
    assert cfg.quantization == "fp8"


def test_refusals_name_the_key(tiny_checkpoint):
    from trainer_bridge.exact_fp8 import make_trainer_fp8
    from trainer_bridge.train import _server_flags
    from trainer_bridge.train_config import ConfigError, load_train_config

    cfg = load_train_config(None, quantization="fp8")
    assert _server_flags(cfg)[-2:] == ["--quantization", "fp8"]
    with pytest.raises(ConfigError, match=r"quantization must be one of \('fp8',\) or None.*got 'int8'"):
        load_train_config(None, quantization="int8")
    with pytest.raises(ConfigError, match="server_flags: give the servers' quantization as the quantization key"):
        load_train_config(None, server_flags=["--quantization", "fp8"])
    with pytest.raises(ConfigError, match="quantization: exact mode with FP8 rollouts does not support "
                                          "GptOssForCausalLM"):
        load_train_config(None, exact=True, server_dtype="float32", quantization="fp8",
                          model_path=str(tiny_checkpoint("gpt_oss")))
    with pytest.raises(ValueError, match="does not support GptOssForCausalLM"):
        make_trainer_fp8(_load(tiny_checkpoint("gpt_oss"), exact=True))
