"""Exact mode: the trainer's forward computes the deterministic engine's numbers, bit for bit.

Samples come from Rollout(..., enable_deterministic_inference=True) on the tiny checkpoints; the
trainer is the transformers model with make_trainer_exact. Its logprobs and live router choices
must equal the rollout's (torch.equal) in packed micro-batches of any composition and padding;
its gradients must match the same model in float64 with transformers' own ops.
"""
from __future__ import annotations

import pytest
import torch

from tiny_models import ARCHS, GROUPED_ARCHS, NEW_ARCHS, make_engine, random_prompts

PROMPT_LENGTHS = [7, 30, 70, 3, 45, 66]
# (max_tokens, pad_to_multiple): one micro-batch; tiles cut mid-sample; odd padding; one sample each
PACKINGS = [(None, 1), (112, 16), (301, 7), (91, 1)]


def _rollout_samples(path, seed: int = 5, max_new_tokens: int = 10, **engine_kw):
    from trainer_bridge import Sample

    prompts = random_prompts(seed, PROMPT_LENGTHS)
    with make_engine(path, enable_deterministic_inference=True, **engine_kw) as engine:
        outs = engine.generate(input_ids=prompts, return_logprob=True, return_routed_experts=True,
                               sampling_params={"temperature": 1.0, "max_new_tokens": max_new_tokens,
                                                "ignore_eos": True})
    return [Sample(prompt_ids=p, response_ids=o.output_ids, rollout_logprobs=o.output_logprobs,
                   routed_experts=o.routed_experts, group_id=i // 2, rid=f"r{i}", reward=float(i % 2))
            for i, (p, o) in enumerate(zip(prompts, outs))]


def _load(path, exact: bool, dtype=torch.float32, fp8: bool = False):
    """The trainer's model: exact mode (over FP8 rollouts: fp8), or transformers' own forward."""
    from transformers import AutoModelForCausalLM

    from trainer_bridge import enable_packed_masks
    from trainer_bridge.exact_fp8 import make_trainer_fp8
    from trainer_bridge.exact_model import make_trainer_exact

    # NOTE: transformers' grouped-GEMM experts have no float64 kernel; its per-expert loop has
    kw = {} if dtype == torch.float32 else {"experts_implementation": "eager"}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kw)
    if exact:
        assert make_trainer_exact(model) > 0
        if fp8:
            assert make_trainer_fp8(model) > 0
    else:
        enable_packed_masks(model)          # gpt-oss: transformers' own masks would mix packed samples
    return model


def _forward(model, mb, mode: str = "record"):
    from trainer_bridge import RouterReplay
    from trainer_bridge.losses import token_logprobs

    kw = {"routed_experts": mb.routed_experts} if mode == "replay" else {}
    with RouterReplay(model, mode=mode, **kw) as rr:
        logits = model(**mb.model_inputs()).logits
    return logits, token_logprobs(logits, mb.target_ids), rr.live_experts()


@pytest.fixture(scope="module")
def qwen3(tiny_checkpoint):
    path = tiny_checkpoint("qwen3_moe")
    return path, _rollout_samples(path)


@pytest.fixture(scope="module")
def deepseek(tiny_checkpoint):
    """DeepSeek-V3: MLA with q_lora and YaRN, grouped sigmoid routing with correction bias, a
    shared expert, layer 0 dense (tests/tiny_models.py)."""
    path = tiny_checkpoint("deepseek_v3")
    return path, _rollout_samples(path)


@pytest.fixture(scope="module")
def gpt_oss(tiny_checkpoint):
    """gpt-oss: sinks, sliding window 8 on layers 0 and 2 (samples up to 80 tokens), q/k/v/o bias,
    YaRN, the biased top-k-then-softmax router, experts with biases and the clamped SwiGLU."""
    path = tiny_checkpoint("gpt_oss")
    return path, _rollout_samples(path)


@pytest.fixture(scope="module")
def minimax_m2(tiny_checkpoint):
    """MiniMax-M2: q/k norm over the whole projection, partial rotary, sigmoid routing with a
    correction bias in one group."""
    path = tiny_checkpoint("minimax_m2")
    return path, _rollout_samples(path)


def _check_equal_to_rollout(path, samples, packings=PACKINGS, fp8: bool = False) -> None:
    """The exact trainer's logprobs and live routing equal the rollout's in every packing; the
    other model differs (transformers' own ops; for FP8 rollouts, exact mode on the float weights)."""
    from trainer_bridge.packing import pack_samples

    exact, plain = _load(path, exact=True, fp8=fp8), _load(path, exact=fp8)
    differs = 0.0
    with torch.no_grad():
        for max_tokens, pad in packings:
            batches = pack_samples(samples, max_tokens=max_tokens, pad_to_multiple=pad)
            assert sum(len(mb.samples) for mb in batches) == len(samples)
            for mb in batches:
                m, rows = mb.loss_mask.bool(), mb.routing_mask[0]
                logits, lp, live = _forward(exact, mb)
                assert torch.equal(lp[m], mb.rollout_logprobs[m]), (max_tokens, pad)
                assert torch.equal(live[rows], mb.routed_experts[rows]), (max_tokens, pad)
                # replay of the rollout's own routing changes nothing (rows without a routing row,
                # a sample's last token and padding, replay the filler ids instead)
                logits_r, _, _ = _forward(exact, mb, mode="replay")
                assert torch.equal(logits_r[0, rows], logits[0, rows])
                _, lp_plain, _ = _forward(plain, mb)
                differs = max(differs, float((lp_plain[m] - mb.rollout_logprobs[m]).abs().max()))
    assert differs > 0, "the other model gave the rollout's bits too: the comparison tells nothing"


def test_exact_logprobs_and_routing_equal_rollout_qwen3(qwen3):
    _check_equal_to_rollout(*qwen3)


@pytest.mark.slow
@pytest.mark.parametrize("arch, overrides", [(a, {}) for a in ARCHS if a != "qwen3_moe"]
                         + [("qwen3_moe", {"use_sliding_window": True, "sliding_window": 20})])
def test_exact_logprobs_and_routing_equal_rollout_other_archs(tiny_checkpoint, arch, overrides):
    path = tiny_checkpoint(arch, **overrides)
    _check_equal_to_rollout(path, _rollout_samples(path, seed=9))


def test_exact_logprobs_and_routing_equal_rollout_deepseek_v3(deepseek):
    # NOTE: two of the packings in the default suite (tiles cut mid-sample with padding to 16; all
    # samples in one micro-batch padded to 7); every packing in the slow cases
    _check_equal_to_rollout(*deepseek, packings=PACKINGS[1:3])


@pytest.mark.slow
@pytest.mark.parametrize("arch", GROUPED_ARCHS)
def test_exact_logprobs_and_routing_equal_rollout_grouped_archs(tiny_checkpoint, arch):
    path = tiny_checkpoint(arch)
    _check_equal_to_rollout(path, _rollout_samples(path, seed=9))


def test_exact_logprobs_and_routing_equal_rollout_gpt_oss(gpt_oss):
    _check_equal_to_rollout(*gpt_oss, packings=PACKINGS[1:3])


def test_exact_logprobs_and_routing_equal_rollout_minimax_m2(minimax_m2):
    _check_equal_to_rollout(*minimax_m2, packings=PACKINGS[1:3])


@pytest.mark.slow
@pytest.mark.parametrize("arch", NEW_ARCHS)
def test_exact_logprobs_and_routing_equal_rollout_new_archs(tiny_checkpoint, arch):
    path = tiny_checkpoint(arch)
    _check_equal_to_rollout(path, _rollout_samples(path, seed=9))


@pytest.mark.slow
def test_exact_deepseek_v3_without_q_lora_and_interleave(tiny_checkpoint):
    """The other MLA layout: q_proj instead of q_a/q_b, rotary dims in halves (rope_interleave
    false), no YaRN."""
    path = tiny_checkpoint("deepseek_v3", q_lora_rank=None, rope_interleave=False,
                           rope_scaling={"rope_type": "default", "rope_theta": 10000.0})
    _check_equal_to_rollout(path, _rollout_samples(path, seed=11))


def test_exact_gradients_match_float64_reference(qwen3):
    """Both models replay the rollout's routing (no flip from float64 rounding); the loss is a
    weighted sum of target logprobs; every parameter's gradient agrees to float32 accuracy."""
    _check_gradients(*qwen3)


def test_exact_gradients_match_float64_reference_deepseek_v3(deepseek):
    """As for Qwen3: the float64 reference is transformers' own DeepseekV3 (per-head K/V expanded
    from the latent, transformers' YaRN), so the absorbed-MLA exact form is checked against an
    independent computation."""
    _check_gradients(*deepseek)


def test_exact_gradients_match_float64_reference_gpt_oss(gpt_oss):
    """The reference is transformers' own GptOss in float64 (interleaved gate/up experts, its
    sinks and YaRN): the de-interleaved expert layout and the sink attention are checked against
    an independent computation, gradients reaching the sinks, the router bias and expert biases."""
    _check_gradients(*gpt_oss)


def test_exact_gradients_match_float64_reference_minimax_m2(minimax_m2):
    _check_gradients(*minimax_m2)


def _check_gradients(path, samples) -> None:
    from trainer_bridge.packing import pack_samples

    exact, ref = _load(path, exact=True), _load(path, exact=False, dtype=torch.float64)
    mb = pack_samples(samples, pad_to_multiple=16)[0]
    weights = torch.linspace(-1.0, 1.0, mb.num_tokens)[None] * mb.loss_mask
    for model in (exact, ref):
        _, lp, _ = _forward(model, mb, mode="replay")
        (lp * weights.to(lp.dtype)).sum().backward()
    grads = dict(ref.named_parameters())
    checked = 0
    for name, p in exact.named_parameters():
        g, g64 = p.grad, grads[name].grad
        assert g is not None and g64 is not None, name
        scale = float(g64.abs().max())
        if scale == 0:
            continue
        err = float((g.double() - g64).abs().max()) / scale
        assert err < 2e-5, (name, err)      # float32 vs float64 rounding: ~2e-6 here
        checked += 1
    assert checked == len(list(exact.parameters()))


def test_grpo_step_under_deepspeed_is_exactly_on_policy(qwen3):
    _check_grpo_step(*qwen3)


@pytest.mark.slow
def test_grpo_step_under_deepspeed_is_exactly_on_policy_deepseek_v3(deepseek):
    _check_grpo_step(*deepseek)


@pytest.mark.slow
@pytest.mark.parametrize("arch", NEW_ARCHS)
def test_grpo_step_under_deepspeed_is_exactly_on_policy_new_archs(request, arch):
    _check_grpo_step(*request.getfixturevalue(arch))


def test_grpo_step_without_exact_mode_keeps_gpt_oss_samples_apart(gpt_oss):
    """The default (non-exact) trainer on gpt-oss: PolicyTrainer hooks transformers' GptOssModel
    (enable_packed_masks) so packed samples do not attend to each other; its log-probs then agree
    with the rollout's to float32 rounding in micro-batches of several samples."""
    from trainer_bridge import grpo_advantages
    from trainer_bridge.policy_trainer import PolicyTrainer
    from trainer_bridge.train_config import load_train_config

    path, samples = gpt_oss
    cfg = load_train_config(None, exact=False, server_dtype="float32", model_path=str(path), zero_stage=0,
                            micro_batch_tokens=256, compare_no_replay=False, router_replay=True)
    trainer = PolicyTrainer(cfg, eos_id=2)
    m = trainer.train_step(samples, grpo_advantages([s.reward for s in samples], [s.group_id for s in samples]))
    assert m["micro_batches"] < len(samples)                         # samples share micro-batches
    assert m["routing_mismatch_rate"] == 0
    assert m["train_rollout_logprob_max_abs_diff"] < 1e-4, m["train_rollout_logprob_max_abs_diff"]


def _check_grpo_step(path, samples, **overrides) -> None:
    from trainer_bridge import grpo_advantages
    from trainer_bridge.policy_trainer import PolicyTrainer
    from trainer_bridge.train_config import load_train_config

    cfg = load_train_config(None, exact=True, server_dtype="float32", model_path=str(path), zero_stage=2,
                            micro_batch_tokens=128, compare_no_replay=True, router_replay=True, **overrides)
    trainer = PolicyTrainer(cfg, eos_id=2)
    before = {k: v.clone() for k, v in trainer.named_weights().items()}
    adv = grpo_advantages([s.reward for s in samples], [s.group_id for s in samples])
    m = trainer.train_step(samples, adv)
    assert m["micro_batches"] > 1
    assert m["train_rollout_logprob_max_abs_diff"] == 0
    assert m["no_replay/train_rollout_logprob_max_abs_diff"] == 0
    assert m["no_replay/routing_mismatch_rate"] == 0
    assert m["routing_mismatch_rate"] == 0 and m["replay_replace_rate"] == 0
    assert m["k3_kl"] == 0
    after = trainer.named_weights()
    assert any(not torch.equal(before[k], after[k]) for k in before)   # the step really updated


def test_exact_mode_refuses_what_it_cannot_match(tiny_checkpoint):
    from trainer_bridge.exact_model import check_exact_support, exact_attention_forward, make_trainer_exact
    from trainer_bridge.train_config import ConfigError, load_train_config

    with pytest.raises(ConfigError, match="server_dtype"):
        load_train_config(None, exact=True, server_dtype="bfloat16")
    with pytest.raises(ValueError, match="exact mode supports"):
        make_trainer_exact(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    with pytest.raises(ValueError, match="router_jitter_noise 0"):      # the engine routes without noise
        check_exact_support("MiniMaxM2ForCausalLM", {"router_jitter_noise": 0.01})
    model = _load(tiny_checkpoint("qwen3_moe"), exact=True)
    attn = model.model.layers[0].self_attn
    q = torch.zeros(1, 4, 5, 32)
    k = torch.zeros(1, 2, 5, 32)
    with pytest.raises(ValueError, match="start at position 0"):
        exact_attention_forward(attn, q, k, k, position_ids=torch.tensor([[0, 1, 2, 5, 6]]))
    with pytest.raises(ValueError, match="position_ids"):
        exact_attention_forward(attn, q, k, k)


@pytest.mark.parametrize("sync", ["tensor", pytest.param("disk", marks=pytest.mark.slow),
                                  pytest.param("distributed", marks=pytest.mark.slow)])
def test_exact_loop_stays_exact_across_weight_syncs(tmp_path, capsys, sync):
    """configs/train/exact.yaml end to end: deterministic servers, exact trainer; every step's
    rollouts come from the weights the trainer pushed after the step before (an inexact round
    trip would show as max |dlp| > 0 from step 2 on)."""
    check_exact_loop("exact.yaml", tmp_path, capsys, sync)


def check_exact_loop(config_name: str, tmp_path, capsys, sync: str):
    """Runs configs/train/<config_name> with the given weight sync (2 steps for tensor, else 3):
    every step's logprobs and routing equal the rollout's, with and without replay, in the
    history and in the printed step lines. Returns the config."""
    from pathlib import Path

    from trainer_bridge.step_report import step_header, step_line
    from trainer_bridge.train import run
    from trainer_bridge.train_config import load_train_config

    config = Path(__file__).resolve().parent.parent / "configs" / "train" / config_name
    steps = 2 if sync == "tensor" else 3         # NOTE: step 2 already samples from pushed weights
    cfg = load_train_config(config, [f"run_dir={tmp_path / 'run'}", f"weight_sync={sync}", f"steps={steps}",
                                     "prompts_per_step=4", "num_eval_prompts=0", "micro_batch_tokens=128",
                                     "progress=false", "wandb_mode=disabled", "lr=1e-3"])
    result = run(cfg)
    out = capsys.readouterr().out
    assert len(result.history) == steps
    for step, rec in enumerate(result.history, start=1):
        assert rec["weight_version"] == str(step - 1)
        assert rec["micro_batches"] >= 2
        assert rec["train_rollout_logprob_max_abs_diff"] == 0, (step, rec["train_rollout_logprob_max_abs_diff"])
        assert rec["no_replay/train_rollout_logprob_max_abs_diff"] == 0
        assert rec["no_replay/routing_mismatch_rate"] == 0 and rec["routing_mismatch_rate"] == 0
    assert step_header(result.history[0], exact=True) in out
    for rec in result.history:
        line = step_line(rec, exact=True)
        cells = dict(zip(step_header(rec, exact=True).split(), line.split()))
        assert line in out and len(line) < 120
        assert cells["mismatch"] == cells["mism(noR)"] == cells["max|dlp|"] == cells["max(noR)"] == "0", line
    return cfg


def test_max_dlp_metric_and_printout_are_exact():
    from trainer_bridge.metrics import logprob_max_abs_diff
    from trainer_bridge.step_report import exact_number, step_header, step_line

    train = torch.tensor([[0.5, -1.0, -2.0, 7.0]])
    roll = torch.tensor([[0.5, -1.0 - 2.0 ** -20, -2.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])                    # the last (7.0 away) is not a loss token
    assert logprob_max_abs_diff(train, roll, mask) == 2.0 ** -20
    assert logprob_max_abs_diff(train, roll, torch.zeros_like(mask)) == 0.0
    assert exact_number(0.0) == "0" and exact_number(2.0 ** -20) == repr(2.0 ** -20) == "9.5367431640625e-07"
    rec = {"step": 3, "reward_mean": 0.5, "response_length_mean": 4.0, "routing_mismatch_rate": 0.0,
           "no_replay/routing_mismatch_rate": 1e-6, "train_rollout_logprob_max_abs_diff": 0.0,
           "no_replay/train_rollout_logprob_max_abs_diff": 2.0 ** -20, "train_rollout_logprob_abs_diff": 0.0,
           "k3_kl": 0.0, "f_tau2": 0.0, "rollout_s": 1.0, "train_s": 1.0, "sync_s": 0.1}
    for exact in (True, False):
        line = step_line(rec, exact=exact)
        cells = dict(zip(step_header(rec, exact=exact).split(), line.split()))
        agreement = [cells[k] for k in ("mismatch", "mism(noR)", "max|dlp|", "max(noR)")]
        assert agreement == (["0", "1e-06", "0", "9.5367431640625e-07"] if exact
                             else ["0.0000", "0.0000", "0", "9.54e-07"]), line
        assert cells["step"] == "3" and cells["eval"] == "-"
        assert exact or len(line) < 120     # exact digits may widen the row; rounded ones never do


def test_exact_config_refuses_an_architecture_it_cannot_match(tiny_checkpoint, tmp_path, capsys):
    """exact: true with a checkpoint exact mode cannot match is a config error naming `exact`, the
    architecture and the supported list, raised when the config is loaded: `python -m
    trainer_bridge.train` stops at argument parsing, before any server starts."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM, Qwen3Config

    from trainer_bridge.exact_model import EXACT_ARCHITECTURES
    from trainer_bridge.train import main
    from trainer_bridge.train_config import ConfigError, load_train_config

    dense = tmp_path / "dense"
    AutoModelForCausalLM.from_config(Qwen3Config(vocab_size=64, hidden_size=16, intermediate_size=32,
                                                 num_hidden_layers=1, num_attention_heads=2,
                                                 num_key_value_heads=1, head_dim=8)).save_pretrained(dense)
    with pytest.raises(ConfigError, match=r"^exact: exact mode supports .*DeepseekV3ForCausalLM.*"
                                          r"Glm4MoeForCausalLM.*, not Qwen3ForCausalLM"):
        load_train_config(None, exact=True, server_dtype="float32", model_path=str(dense))
    load_train_config(None, exact=False, server_dtype="float32", model_path=str(dense))   # fine without exact
    for arch in ("qwen3_moe", "deepseek_v3", "glm4_moe", "gpt_oss", "minimax_m2"):
        load_train_config(None, exact=True, server_dtype="float32", model_path=str(tiny_checkpoint(arch)))
    # an architecture it supports, with a feature it cannot match: YaRN on a softmax-routed model
    yarn = tiny_checkpoint("qwen3_moe", rope_parameters={"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e6,
                                                         "original_max_position_embeddings": 256})
    with pytest.raises(ConfigError, match="^exact: exact mode needs default RoPE for Qwen3MoeForCausalLM"):
        load_train_config(None, exact=True, server_dtype="float32", model_path=str(yarn))
    config = Path(__file__).resolve().parent.parent / "configs" / "train" / "exact.yaml"
    with pytest.raises(SystemExit) as stop:
        main(["--config", str(config), "--set", f"model_path={dense}", "--set", f"run_dir={tmp_path / 'run'}"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "exact: exact mode supports" in err and "Qwen3ForCausalLM" in err
    assert not (tmp_path / "run").exists()
    assert len(EXACT_ARCHITECTURES) == 8
