"""RouterReplay on transformers' DeepseekV3TopkRouter / Glm4MoeTopkRouter (sigmoid scores, correction
bias, groups), and one GRPO step of trainer_bridge.train on a tiny DeepSeek-V3 checkpoint."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from rollout.models.moe.routing import grouped_sigmoid_topk
from tiny_models import GROUPED_ARCHS, make_tiny_checkpoint
from trainer_bridge import RouterReplay

ROOT = Path(__file__).resolve().parent.parent
T = 11


@pytest.fixture(params=GROUPED_ARCHS)
def arch_model(request, tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoint(request.param)
    return request.param, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).train()


def tokens(seed: int) -> torch.Tensor:
    return torch.randint(3, 256, (2, T), generator=torch.Generator().manual_seed(seed))


def step(model, ids, **rr):
    """Forward + backward inside the context -> (logits, {name: grad}, the context)."""
    model.zero_grad(set_to_none=True)
    with RouterReplay(model, **rr) as ctx:
        out = model(ids)
        out.logits.float().pow(2).mean().backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, ctx


def moe_layers(model) -> list[int]:
    return list(range(model.config.first_k_dense_replace, model.config.num_hidden_layers))


def test_record_is_the_routers_choice_and_replay_is_exact(arch_model):
    """record returns the router's own choice (= the engine's rule on the same logits, dense layer
    -1); replaying it reproduces logits and every gradient bit for bit."""
    _, model = arch_model
    ids = tokens(0)
    base, g_base, rec = step(model, ids, mode="record", keep_router_logits=True)
    live = rec.routed_experts()
    cfg = model.config
    assert live.shape == (2 * T, cfg.num_hidden_layers, cfg.num_experts_per_tok)
    assert (live[:, 0] == -1).all()
    for r in rec.routers:
        _, want = grouped_sigmoid_topk(rec.router_logits()[r.layer].detach(), r.module.e_score_correction_bias,
                                       r.top_k, n_group=cfg.n_group, topk_group=cfg.topk_group,
                                       renormalize=cfg.norm_topk_prob, scaling_factor=cfg.routed_scaling_factor)
        assert torch.equal(live[:, r.layer].sort(-1).values, want.sort(-1).values.to(torch.int32))
    replayed, g_rep, ctx = step(model, ids, mode="replay", routed_experts=live)
    assert torch.equal(replayed, base)
    assert g_rep.keys() == g_base.keys() and any(n.endswith("mlp.gate.weight") for n in g_rep)
    for n in g_base:
        assert torch.equal(g_rep[n], g_base[n]), n


def test_replaying_other_ids_changes_logits_and_trains_the_router(arch_model):
    """Ids outside the live choice (other groups too): the output changes, each replayed expert's
    router row gets gradient, the weights are the unbiased sigmoid scores normalised and scaled,
    and the correction bias plays no part (it is not a gradient-trained parameter)."""
    _, model = arch_model
    ids = tokens(1)
    base, _, rec = step(model, ids, mode="record")
    live = rec.routed_experts()
    k, n_exp = model.config.num_experts_per_tok, model.config.n_routed_experts
    other = live.clone()
    for layer in moe_layers(model):
        for i in range(live.shape[0]):
            taken = set(live[i, layer].tolist())
            other[i, layer] = torch.tensor([e for e in range(n_exp) if e not in taken][:k])
    out, grads, ctx = step(model, ids, mode="replay", routed_experts=other, keep_router_logits=True)
    assert not torch.allclose(out, base)
    for r in ctx.routers:
        name = next(n for n, p in model.named_parameters() if p is r.module.weight)
        for e in other[:, r.layer].unique().tolist():
            assert grads[name][e].abs().sum() > 0, (r.layer, e)
        assert not r.module.e_score_correction_bias.requires_grad
    r = ctx.routers[-1]
    hidden = torch.randn(5, model.config.hidden_size)
    routed = other[:5]
    with RouterReplay(model, mode="replay", routed_experts=routed), torch.no_grad():
        logits, w, got = r.module(hidden)
        r.module.e_score_correction_bias.add_(1.0)          # the bias never enters the replayed weights
        _, w_shifted, _ = r.module(hidden)
        r.module.e_score_correction_bias.sub_(1.0)
    assert torch.equal(got, routed[:, r.layer].long())
    s = logits.sigmoid().gather(1, got)
    torch.testing.assert_close(w, s / s.sum(-1, keepdim=True) * model.config.routed_scaling_factor, rtol=0, atol=1e-6)
    assert torch.equal(w, w_shifted)
    with RouterReplay(model, mode="replay", routed_experts=other) as rr, torch.no_grad():
        model(ids)
        assert rr.mismatch_rate() > 0.5


@pytest.fixture(scope="module")
def tiny_deepseek_with_tokenizer(tmp_path_factory):
    """A tiny DeepSeek-V3 checkpoint on the embedded model's tokenizer (the GRPO loop needs one)."""
    path = tmp_path_factory.mktemp("tiny_deepseek_tok")
    make_tiny_checkpoint("deepseek_v3", path, vocab_size=576, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(ROOT / "configs" / "tiny-moe" / name, path / name)
    return path


@pytest.mark.slow
def test_grpo_step_on_deepseek_v3_replays_with_mismatch_0(tiny_deepseek_with_tokenizer, tmp_path):
    """trainer_bridge.train's loop: a rollout-serve process on the DeepSeek-V3 checkpoint, one GRPO
    step with router replay (weights synced back by tensor): the trainer used exactly the
    rollout's experts."""
    from trainer_bridge.train import run
    from trainer_bridge.train_config import load_train_config

    cfg = load_train_config(ROOT / "configs" / "train" / "tiny-test.yaml", [
        f"model_path={tiny_deepseek_with_tokenizer}", f"run_dir={tmp_path / 'run'}", "num_servers=1", "steps=1",
        "prompts_per_step=4", "samples_per_prompt=2", "num_eval_prompts=4", "zero_stage=0",
        "micro_batch_tokens=512", "server_dtype=float32", "compare_no_replay=false"])
    result = run(cfg)
    assert len(result.history) == 1
    rec = result.history[0]
    assert rec["routing_mismatch_rate"] == 0.0
    assert rec["routing_bytes_per_sample"] > 0
    assert rec["train_rollout_logprob_abs_diff"] < 1e-3
