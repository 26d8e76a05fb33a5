"""DeepSeek-V3 (MLA) and GLM-4.5 MoE against transformers: the grouped sigmoid routing rule, the
latent KV layout, greedy tokens and every routing row through the engine (static runners, prefix
cache, retraction, DP attention)."""
from __future__ import annotations

import functools
import json

import pytest
import torch
from attention_cases import slot_table
from safetensors.torch import load_file, save_file

from oracle import hf_greedy, hf_model
from rollout.batch.forward_batch import ForwardBatch
from rollout.batch.kv_pool import KVPool
from rollout.models import load_model
from rollout.models.moe.routing import grouped_sigmoid_topk
from rollout.exec.runners.piecewise_backend import PiecewiseBackend
from tiny_models import GROUPED_ARCHS, make_engine, random_prompts

GREEDY = {"temperature": 0.0, "max_new_tokens": 10, "ignore_eos": True}
BUCKETS = dict(decode_graph_batch_sizes=(1, 2, 4), prefill_graph_token_sizes=(16, 32), chunked_prefill_size=48)


class RecordingCapture:
    def __init__(self):
        self.ids: dict[int, torch.Tensor] = {}

    def record(self, layer_id, topk_ids):
        self.ids[layer_id] = topk_ids.clone()


def hf_routers(model):
    return [(int(name.split(".")[2]), m) for name, m in model.named_modules()
            if type(m).__name__ in ("DeepseekV3TopkRouter", "Glm4MoeTopkRouter")]


@functools.lru_cache(maxsize=32)
def hf_routing(path: str, seq: tuple[int, ...]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """transformers' forward over seq: ([T, L, K] router topk_indices sorted per row, -1 for dense
    layers; {layer: raw router logits [T, E]})."""
    model = hf_model(path)
    cfg = model.config
    ids = torch.full((len(seq), cfg.num_hidden_layers, cfg.num_experts_per_tok), -1, dtype=torch.int32)
    logits: dict[int, torch.Tensor] = {}
    handles = []
    for layer, router in hf_routers(model):
        def hook(module, args, out, layer=layer):
            logits[layer] = out[0].detach()
            ids[:, layer] = torch.sort(out[2], dim=-1).values.to(torch.int32)
        handles.append(router.register_forward_hook(hook))
    try:
        with torch.no_grad():
            model(torch.tensor([seq]))
    finally:
        for h in handles:
            h.remove()
    return ids, logits


def assert_matches_hf(path, prompt, out):
    """Greedy tokens equal transformers'; every routing row (prompt and output) equals its router's."""
    assert out.output_ids == hf_greedy(path, list(prompt), len(out.output_ids))
    seq = tuple(prompt) + tuple(out.output_ids)
    want, _ = hf_routing(str(path), seq[:-1])
    got = torch.sort(out.routed_experts, dim=-1).values
    assert got.shape == want.shape and torch.equal(got, want)


# ---- the routing rule --------------------------------------------------------------------------

@pytest.mark.parametrize("arch", GROUPED_ARCHS)
def test_rule_equals_hf_router(arch):
    """ids (as sets) and weights equal transformers' router on random inputs, and the capture hook
    records exactly the returned ids."""
    from tiny_models import tiny_config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    cfg = tiny_config(arch)
    router = (DeepseekV3TopkRouter if arch == "deepseek_v3" else Glm4MoeTopkRouter)(cfg)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g) * 0.3)
        router.e_score_correction_bias.copy_(torch.randn(router.num_experts, generator=g) * 0.1)
    x = torch.randn(200, cfg.hidden_size, generator=g)
    logits, hf_w, hf_ids = router(x)
    cap = RecordingCapture()
    w, ids = grouped_sigmoid_topk(logits, router.e_score_correction_bias, cfg.num_experts_per_tok,
                                  n_group=cfg.n_group, topk_group=cfg.topk_group, renormalize=cfg.norm_topk_prob,
                                  scaling_factor=cfg.routed_scaling_factor, capture=cap, layer_id=5)
    assert torch.equal(cap.ids[5], ids)
    order, hf_order = ids.argsort(-1), hf_ids.argsort(-1)
    assert torch.equal(ids.gather(1, order), hf_ids.gather(1, hf_order))
    torch.testing.assert_close(w.gather(1, order), hf_w.gather(1, hf_order), rtol=1e-6, atol=1e-7)
    # the bias changes the choice of some rows, and the groups restrict it
    _, unbiased = grouped_sigmoid_topk(logits, torch.zeros(router.num_experts), cfg.num_experts_per_tok,
                                       n_group=cfg.n_group, topk_group=cfg.topk_group, renormalize=True,
                                       scaling_factor=1.0)
    assert not torch.equal(ids.sort(-1).values, unbiased.sort(-1).values)
    groups = ids // (router.num_experts // cfg.n_group)
    assert all(len(set(row)) <= cfg.topk_group for row in groups.tolist())


def test_rule_ties_lower_id_wins():
    """Equal group scores: the lower group wins; equal expert scores: the lower id wins."""
    logits = torch.zeros(1, 8)                       # 4 groups of 2, all scores equal
    _, ids = grouped_sigmoid_topk(logits, torch.zeros(8), 3, n_group=4, topk_group=2, renormalize=True,
                                  scaling_factor=1.0)
    assert ids.tolist() == [[0, 1, 2]]
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.5])   # group 3 best, then group 0
    w, ids = grouped_sigmoid_topk(logits, bias, 3, n_group=4, topk_group=2, renormalize=False,
                                  scaling_factor=2.0)
    assert ids.tolist() == [[6, 7, 0]]
    assert torch.allclose(w, torch.full((1, 3), 2 * 0.5))          # unbiased sigmoid(0) x scaling
    with pytest.raises(ValueError, match="n_group=3 must divide num_experts=8"):
        grouped_sigmoid_topk(logits, torch.zeros(8), 2, n_group=3, topk_group=1, renormalize=True,
                             scaling_factor=1.0)


# ---- the model layer ---------------------------------------------------------------------------

def _pool(model, slots=96):
    info = model.info
    return KVPool(num_slots=slots, num_layers=info.num_hidden_layers, num_kv_heads=info.num_kv_heads,
                  head_dim=info.head_dim, dtype=torch.float32, latent_dim=info.kv_latent_dim)


@pytest.mark.parametrize("arch,overrides", [
    ("deepseek_v3", {}), ("glm4_moe", {}),
    # no q LoRA, plain rope layout and no YaRN; GLM without q/k norm, full groups (n_group 1)
    ("deepseek_v3", {"q_lora_rank": None, "rope_interleave": False, "rope_scaling": None}),
    ("glm4_moe", {"use_qk_norm": False, "n_group": 1, "topk_group": 1}),
], ids=["deepseek_v3", "glm4_moe", "deepseek_v3-no_q_lora-no_yarn", "glm4_moe-no_qk_norm-one_group"])
def test_prefill_then_decode_match_hf(tiny_checkpoint, arch, overrides):
    """Logits of a chunked prefill + paged decode over the pool equal transformers' full forward;
    DeepSeek's pool holds kv_lora_rank + qk_rope_head_dim values per token and layer."""
    path = tiny_checkpoint(arch, **overrides)
    model, cfg = load_model(path, torch.float32)
    pool = _pool(model)
    if arch == "deepseek_v3" and not overrides:
        assert model.info.kv_latent_dim == cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"] == 40
        assert pool.kv_buffers[0].shape == (97, 40)
        assert KVPool.bytes_per_slot(num_layers=3, num_kv_heads=4, head_dim=24, dtype=torch.float32,
                                     latent_dim=40) == 3 * 40 * 4
    seq = random_prompts(5, [23])[0]
    with torch.no_grad():
        want = hf_model(str(path))(torch.tensor([seq])).logits[0]
    slots = pool.alloc(len(seq))
    got = []
    for lo, hi in ((0, 9), (9, 20), (20, 21), (21, 22), (22, 23)):
        fb = ForwardBatch.build(input_ids=seq[lo:hi], out_cache_loc=slots[lo:hi], prefix_lens=[lo],
                                extend_lens=[hi - lo], kv_indices=slot_table([slots[:hi]]), kv_pool=pool)
        got.append(model(fb, return_all_logits=True))
    torch.testing.assert_close(torch.cat(got), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", GROUPED_ARCHS)
def test_idle_rank_forward_has_no_tokens(tiny_checkpoint, arch):
    """An idle DP rank's forward (ForwardBatch.empty: 0 tokens) runs through MLA / GQA and the
    grouped router and returns 0 rows (MLA's output reshape once raised on it, killing both
    ranks of a dp=2 engine whenever one rank had nothing to do)."""
    model, _ = load_model(tiny_checkpoint(arch), torch.float32)
    with torch.no_grad():
        out = model(ForwardBatch.empty(kv_pool=_pool(model)))
    assert out.shape[0] == 0


@pytest.mark.parametrize("arch", GROUPED_ARCHS)
def test_segments_and_pieces_equal_one_forward(tiny_checkpoint, arch):
    """AttentionSegments and the piecewise prefill runner (static buffers, padding into the sink)
    give the logits, KV and routing of one whole-grid forward."""
    path = tiny_checkpoint(arch)
    model, _ = load_model(path, torch.float32)
    reqs = random_prompts(6, [40, 3, 2])
    results = []
    for how in ("grid", "segments", "pieces"):
        pool, cap = _pool(model), RecordingCapture()
        slots = [pool.alloc(len(r)) for r in reqs]
        fb = ForwardBatch.build(input_ids=sum(reqs, []), out_cache_loc=torch.cat(slots), prefix_lens=[0, 0, 0],
                                extend_lens=[len(r) for r in reqs], kv_indices=slot_table(slots), kv_pool=pool, capture=cap,
                                segment_attention=how == "segments")
        assert bool(fb.segments) == (how == "segments")
        if how == "pieces":
            logits = PiecewiseBackend(model, max_tokens=64, device=torch.device("cpu"), use_graphs=False).run(None, fb)
        else:
            logits = model(fb)
        results.append((logits, torch.stack(pool.kv_buffers), torch.stack([cap.ids[k] for k in sorted(cap.ids)])))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        assert torch.equal(results[0][2], other[2])


@pytest.mark.parametrize("arch", GROUPED_ARCHS)
def test_decode_with_cascade_equals_one_grid(tiny_checkpoint, arch):
    """A GRPO-shaped decode batch that gets a DecodeCascade (8 samples over one cached 300-token
    prompt): GLM-4.5 (GQA) attends through it, DeepSeek's MLA layers attend over the whole grid;
    either way logits, KV and routing equal the one-grid forward."""
    path = tiny_checkpoint(arch)
    model, _ = load_model(path, torch.float32)
    prompt = random_prompts(14, [300])[0]
    tails = random_prompts(15, [2 + i for i in range(8)])
    results = []
    for cascade in (False, True):
        pool = _pool(model, slots=512)
        shared = pool.alloc(len(prompt))
        model(ForwardBatch.build(input_ids=prompt, out_cache_loc=shared, prefix_lens=[0], extend_lens=[len(prompt)],
                                 kv_indices=slot_table([shared]), kv_pool=pool))
        rows = []
        for tail in tails:
            own = pool.alloc(len(tail))
            slots = torch.cat([shared, own])
            model(ForwardBatch.build(input_ids=tail[:-1], out_cache_loc=own[:-1], prefix_lens=[len(prompt)],
                                     extend_lens=[len(tail) - 1], kv_indices=slot_table([slots[:-1]]), kv_pool=pool))
            rows.append(slots)
        cap = RecordingCapture()
        fb = ForwardBatch.build(input_ids=[t[-1] for t in tails], out_cache_loc=torch.stack([r[-1] for r in rows]),
                                prefix_lens=[len(r) - 1 for r in rows], extend_lens=[1] * len(rows), kv_indices=slot_table(rows),
                                kv_pool=pool, capture=cap, segment_attention=cascade,
                                prefix_groups=((len(prompt), tuple(range(len(rows)))),) if cascade else ())
        assert (fb.cascade is not None) == cascade
        results.append((model(fb), torch.stack(pool.kv_buffers), torch.stack([cap.ids[k] for k in sorted(cap.ids)])))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert torch.equal(results[0][2], results[1][2])


def test_bf16_keeps_router_fp32_and_skips_mtp_layers(tiny_checkpoint, tmp_path):
    """The router weight and correction bias stay fp32 in a bf16 model (as transformers keeps
    them); a checkpoint's multi-token-prediction layer (num_nextn_predict_layers) is skipped."""
    src = tiny_checkpoint("deepseek_v3")
    for f in src.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["model.layers.3.self_attn.kv_b_proj.weight"] = torch.zeros(4)   # the MTP layer (index 3)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 1
    model, _ = load_model(tmp_path, "bfloat16")
    gate = model.model.layers[1].mlp.gate
    assert gate.weight.dtype == gate.e_score_correction_bias.dtype == torch.float32
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert torch.equal(gate.e_score_correction_bias, tensors["model.layers.1.mlp.gate.e_score_correction_bias"])
    cfg["num_nextn_predict_layers"] = 0
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="1 unexpected tensor"):
        load_model(tmp_path, "float32")


def test_weight_update_by_hf_names(tiny_checkpoint):
    """HF names reach the MLA projections, the correction bias, shared and per-expert weights; the
    updated model equals transformers' with the same update."""
    from rollout.models import load_state_dict_from_tensors
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoint("deepseek_v3")
    model, _ = load_model(path, torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(11)
    update = {}
    for name in ("model.layers.1.self_attn.kv_b_proj.weight", "model.layers.2.mlp.gate.e_score_correction_bias",
                 "model.layers.2.mlp.experts.5.down_proj.weight", "model.layers.1.mlp.shared_experts.up_proj.weight"):
        current = hf.state_dict()[name] if "experts.5" not in name else hf.model.layers[2].mlp.experts.down_proj[5]
        update[name] = current + 0.3 * torch.randn(current.shape, generator=g)
    assert load_state_dict_from_tensors(model, update) == len(update)
    with torch.no_grad():
        for name, value in update.items():
            if "experts.5" in name:
                hf.model.layers[2].mlp.experts.down_proj[5].copy_(value)
            elif name.endswith("e_score_correction_bias"):          # a buffer in transformers
                hf.get_buffer(name).copy_(value)
            else:
                hf.get_parameter(name).copy_(value)
    seq = random_prompts(12, [17])[0]
    pool = _pool(model)
    slots = pool.alloc(len(seq))
    cap = RecordingCapture()
    fb = ForwardBatch.build(input_ids=seq, out_cache_loc=slots, prefix_lens=[0], extend_lens=[len(seq)],
                            kv_indices=slot_table([slots]), kv_pool=pool, capture=cap)
    got = model(fb, return_all_logits=True)
    with torch.no_grad():
        want = hf(torch.tensor([seq])).logits[0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    bias = model.model.layers[2].mlp.gate.e_score_correction_bias
    assert torch.equal(bias, update["model.layers.2.mlp.gate.e_score_correction_bias"])


# ---- through the engine ------------------------------------------------------------------------

@pytest.mark.parametrize("arch", GROUPED_ARCHS)
def test_engine_greedy_and_routing_match_hf(tiny_checkpoint, arch):
    """Static runners (decode buckets, piecewise prefill), chunked prefill and prefix-cache hits:
    tokens and every routing row equal transformers'; dense layer 0 is -1."""
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
        assert (out.routed_experts[:, 0] == -1).all() and (out.routed_experts[:, 1:] >= 0).all()
        assert_matches_hf(path, prompt, out)
    # the correction bias decides some of these rows: without it transformers' logits pick otherwise
    _, logits = hf_routing(str(path), tuple(batch[2]) + tuple(first[2].output_ids[:-1]))
    model = hf_model(str(path))
    changed = 0
    for layer, router in hf_routers(model):
        biased = grouped_sigmoid_topk(logits[layer], router.e_score_correction_bias, router.top_k,
                                      n_group=router.num_group, topk_group=router.topk_group,
                                      renormalize=True, scaling_factor=1.0)[1].sort(-1).values
        plain = grouped_sigmoid_topk(logits[layer], torch.zeros_like(router.e_score_correction_bias),
                                     router.top_k, n_group=router.num_group, topk_group=router.topk_group,
                                     renormalize=True, scaling_factor=1.0)[1].sort(-1).values
        changed += int((biased != plain).any(-1).sum())
    assert changed > 0


def test_engine_retraction_matches_hf(tiny_checkpoint):
    """A KV pool too small for the batch: requests are retracted and resume; tokens and routing
    still equal transformers' (rows saved before the latent KV slots were freed)."""
    path = tiny_checkpoint("deepseek_v3")
    batch = random_prompts(8, [20, 25, 30, 18])
    with make_engine(path, max_total_tokens=100) as engine:
        outs = engine.generate(input_ids=batch, sampling_params=dict(GREEDY, max_new_tokens=16),
                               return_routed_experts=True)
        stats = engine.stats()
        engine.check_integrity()
    assert stats["num_retractions"] > 0
    for prompt, out in zip(batch, outs):
        assert_matches_hf(path, prompt, out)


@pytest.mark.slow
@pytest.mark.parametrize("arch", GROUPED_ARCHS)
def test_dp2_expert_sharded_matches_hf(tiny_checkpoint, arch):
    """DP attention over 2 ranks with the experts sharded: uneven loads, static and eager runners;
    tokens and routing rows equal transformers'."""
    path = tiny_checkpoint(arch)
    batch = random_prompts(9, [7, 3, 50, 12])
    with make_engine(path, dp_size=2, **BUCKETS) as engine:
        outs = engine.generate(input_ids=batch, sampling_params=GREEDY, return_routed_experts=True,
                               routed_dp_rank=[0, 1, 0, 1])
        loads = engine.loads()
        engine.check_integrity()
    assert [row["experts_held"] for row in loads] == [[0, 8], [8, 16]]
    for prompt, out in zip(batch, outs):
        assert_matches_hf(path, prompt, out)


@pytest.mark.interpreter
@pytest.mark.parametrize("arch", GROUPED_ARCHS)
def test_triton_backends_match_hf(tiny_checkpoint, arch):
    """moe_backend and attention_backend 'triton' (Triton's interpreter on CPU): the grouped
    sigmoid router kernel and fused MoE, GLM-4.5's GQA through the attention kernels, DeepSeek's
    MLA on its torch latent path (no backend is bound for it); tokens and routing rows equal
    transformers'."""
    path = tiny_checkpoint(arch)
    batch = random_prompts(16, [9, 21])
    with make_engine(path, moe_backend="triton", attention_backend="triton", client="inproc") as engine:
        outs = engine.generate(input_ids=batch, sampling_params=dict(GREEDY, max_new_tokens=4),
                               return_routed_experts=True)
        bound = engine.debug(lambda core: core.runner.runners["eager"].attention is not None)
        backends = engine.debug(lambda core: {m.moe_backend for m in core.model.modules() if hasattr(m, "moe_backend")})
    assert backends == {"triton"} and bound == (arch == "glm4_moe")
    for prompt, out in zip(batch, outs):
        assert_matches_hf(path, prompt, out)
