"""Exact mode in bfloat16: a bf16 deterministic engine and the exact trainer's bf16 forward (under
DeepSpeed's bf16 mode: fp32 master weights, their bf16 rounding in the module) give the same bits.

The fp32 versions of these checks are in tests/test_exact_trainer.py; here every side is bf16:
the engine (`dtype="bfloat16"`), the trainer's module, the weights pushed after a step.
"""
from __future__ import annotations

import pytest
import torch

from test_exact_trainer import PACKINGS, PROMPT_LENGTHS, _forward, check_exact_loop
from tiny_models import ARCHS, GROUPED_ARCHS, NEW_ARCHS, make_engine, random_prompts

BF16 = torch.bfloat16


def _samples(engine, seed: int, max_new_tokens: int = 10):
    from trainer_bridge import Sample

    prompts = random_prompts(seed, PROMPT_LENGTHS)
    outs = engine.generate(input_ids=prompts, return_logprob=True, return_routed_experts=True,
                           sampling_params={"temperature": 1.0, "max_new_tokens": max_new_tokens,
                                            "ignore_eos": True})
    return [Sample(prompt_ids=p, response_ids=o.output_ids, rollout_logprobs=o.output_logprobs,
                   routed_experts=o.routed_experts, group_id=i // 2, rid=f"r{i}", reward=float(i % 2),
                   weight_version=engine.weight_version)
            for i, (p, o) in enumerate(zip(prompts, outs))]


def _bf16_engine(path):
    return make_engine(path, enable_deterministic_inference=True, dtype="bfloat16")


def _bf16_checkpoint(tiny_checkpoint, arch, **overrides):
    # NOTE: a BF16 release: the engine keeps the sigmoid routers' gate and gpt-oss's sinks in fp32
    # and the trainer's DeepSpeed module holds every parameter in bf16; they agree on bf16 values
    return tiny_checkpoint(arch, dtype="bfloat16", **overrides)


def _check_bf16_equal_to_rollout(path, packings=PACKINGS, seed: int = 5) -> None:
    from transformers import AutoModelForCausalLM

    from trainer_bridge import enable_packed_masks
    from trainer_bridge.exact_model import make_trainer_exact
    from trainer_bridge.packing import pack_samples

    with _bf16_engine(path) as engine:
        samples = _samples(engine, seed)
    exact = AutoModelForCausalLM.from_pretrained(path, dtype=BF16)
    make_trainer_exact(exact)
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=BF16)
    enable_packed_masks(plain)
    differs = 0.0
    with torch.no_grad():
        for max_tokens, pad in packings:
            for mb in pack_samples(samples, max_tokens=max_tokens, pad_to_multiple=pad):
                m, rows = mb.loss_mask.bool(), mb.routing_mask[0]
                logits, lp, live = _forward(exact, mb)
                assert logits.dtype == BF16
                assert torch.equal(lp[m], mb.rollout_logprobs[m]), (max_tokens, pad)
                assert torch.equal(live[rows], mb.routed_experts[rows]), (max_tokens, pad)
                logits_r, _, _ = _forward(exact, mb, mode="replay")
                assert torch.equal(logits_r[0, rows], logits[0, rows])
                _, lp_plain, _ = _forward(plain, mb)
                differs = max(differs, float((lp_plain[m] - mb.rollout_logprobs[m]).abs().max()))
    assert differs > 0, "transformers' own bf16 ops gave the rollout's bits too: the comparison tells nothing"


def test_exact_bf16_logprobs_and_routing_equal_bf16_rollout_qwen3(tiny_checkpoint):
    _check_bf16_equal_to_rollout(tiny_checkpoint("qwen3_moe"), packings=PACKINGS[:2])


@pytest.mark.slow
@pytest.mark.parametrize("arch", [a for a in ARCHS if a != "qwen3_moe"] + list(GROUPED_ARCHS) + list(NEW_ARCHS))
def test_exact_bf16_logprobs_and_routing_equal_bf16_rollout_other_archs(tiny_checkpoint, arch):
    _check_bf16_equal_to_rollout(_bf16_checkpoint(tiny_checkpoint, arch), seed=9)


def _masters(optimizer) -> list[torch.Tensor]:
    """DeepSpeed's fp32 master weights: ZeRO-1/2's flat fp32 partitions, stage 0's fp32 copies."""
    if hasattr(optimizer, "single_partition_of_fp32_groups"):
        return list(optimizer.single_partition_of_fp32_groups)
    return [p for group in optimizer.fp32_groups for p in group]


def _check_bf16_grpo_step_then_push(path, zero_stage: int = 2) -> None:
    """Rollouts from a bf16 deterministic engine; a GRPO step of the exact trainer under DeepSpeed
    bf16 (several micro-batches); its weights pushed into the engine; rollouts again, and
    a second step: every logprob and routing row equal to the rollout's, before and after the push."""
    from rollout.server.weight_updater import WeightUpdater
    from trainer_bridge import grpo_advantages
    from trainer_bridge.policy_trainer import PolicyTrainer
    from trainer_bridge.train_config import load_train_config

    cfg = load_train_config(None, exact=True, server_dtype="bfloat16", train_dtype="bfloat16", model_path=str(path),
                            zero_stage=zero_stage, micro_batch_tokens=128, compare_no_replay=True, router_replay=True,
                            lr=1e-3)
    trainer = PolicyTrainer(cfg, eos_id=2)
    params = dict(trainer.model.named_parameters())
    assert all(p.dtype == BF16 for p in params.values())
    masters = _masters(trainer.optimizer)
    assert masters and all(t.dtype == torch.float32 for t in masters)
    with _bf16_engine(path) as engine:
        updater = WeightUpdater(engine, ())
        for step in (1, 2):
            # NOTE: before step 1 as the loop does (the engine's fp32 routers and sinks hold an fp32
            # checkpoint unrounded); before step 2 the weights of step 1
            named = trainer.named_weights()
            assert all(named[k].dtype == BF16 for k in params)                    # pushed as bf16
            updater.update_from_tensors(named, weight_version=str(step - 1), source="trainer")
            samples = _samples(engine, seed=step)
            assert {s.weight_version for s in samples} == {engine.weight_version}
            before = {k: v.clone() for k, v in trainer.named_weights().items()}
            m = trainer.train_step(samples, grpo_advantages([s.reward for s in samples],
                                                            [s.group_id for s in samples]))
            assert m["micro_batches"] > 1
            assert m["train_rollout_logprob_max_abs_diff"] == 0, (step, m["train_rollout_logprob_max_abs_diff"])
            assert m["no_replay/train_rollout_logprob_max_abs_diff"] == 0
            assert m["no_replay/routing_mismatch_rate"] == 0 and m["routing_mismatch_rate"] == 0
            assert m["k3_kl"] == 0
            after = trainer.named_weights()
            assert any(not torch.equal(before[k], after[k]) for k in before)      # the step really updated
            # the module holds the masters' bf16 rounding; the masters keep the bits bf16 drops
            flat = torch.cat([t.reshape(-1) for t in masters])
            assert not torch.equal(flat, flat.to(BF16).float())


@pytest.mark.parametrize("zero_stage", [2, pytest.param(0, marks=pytest.mark.slow)])
def test_bf16_grpo_step_under_deepspeed_bf16_then_push_stays_exact(tiny_checkpoint, zero_stage):
    _check_bf16_grpo_step_then_push(tiny_checkpoint("qwen3_moe"), zero_stage)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["deepseek_v3", "gpt_oss", "minimax_m2"])
def test_bf16_grpo_step_under_deepspeed_bf16_then_push_stays_exact_other_archs(tiny_checkpoint, arch):
    """fp32 checkpoints: the first push brings the engine's fp32-kept tensors to the trainer's bf16."""
    _check_bf16_grpo_step_then_push(tiny_checkpoint(arch))


def test_exact_bf16_config_needs_the_trainer_dtype_on_the_servers():
    from trainer_bridge.train_config import ConfigError, load_train_config

    with pytest.raises(ConfigError, match=r"server_dtype: .*\(train_dtype bfloat16\), got 'float32'"):
        load_train_config(None, exact=True, server_dtype="float32", train_dtype="bfloat16")
    with pytest.raises(ConfigError, match="train_dtype must be one of"):
        load_train_config(None, train_dtype="float16")
    load_train_config(None, exact=False, server_dtype="bfloat16", train_dtype="bfloat16")


@pytest.mark.parametrize("sync", ["tensor", pytest.param("disk", marks=pytest.mark.slow),
                                  pytest.param("distributed", marks=pytest.mark.slow)])
def test_exact_bf16_loop_stays_exact_across_weight_syncs(tmp_path, capsys, sync):
    """configs/train/exact-bf16.yaml end to end: bf16 deterministic servers, the exact trainer in
    DeepSpeed bf16; from step 2 on the rollouts come from the bf16 weights the trainer pushed."""
    cfg = check_exact_loop("exact-bf16.yaml", tmp_path, capsys, sync)
    assert cfg.train_dtype == cfg.server_dtype == "bfloat16"
