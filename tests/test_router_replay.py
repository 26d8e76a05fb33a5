"""RouterReplay on transformers' MoE classes (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE; gpt-oss's biased
top-k-then-softmax router and MiniMax-M2's sigmoid router with its correction bias), CPU."""
from __future__ import annotations


import pytest
import torch

from oracle import hf_model, hf_router_topk, moe_layer_ids
from rollout.models.moe.routing import grouped_sigmoid_topk
from tiny_models import ARCHS, NEW_ARCHS
from trainer_bridge import RouterReplay, Sample, enable_packed_masks, pack_samples, router_alignment_loss

T = 13


def load(path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).train()
    enable_packed_masks(model)            # gpt-oss: packed samples must not attend to each other
    return model


@pytest.fixture(params=ARCHS + NEW_ARCHS)
def arch_model(request, tiny_checkpoint):
    path = tiny_checkpoint(request.param)
    return request.param, path, load(path)


def ids_for(seed: int, shape=(2, T)) -> torch.Tensor:
    return torch.randint(3, 256, shape, generator=torch.Generator().manual_seed(seed))


def step(model, ids, rr_kwargs=None, **fwd):
    """Forward + backward (inside the context); returns logits and every parameter's gradient."""
    model.zero_grad(set_to_none=True)
    if rr_kwargs is None:
        out = model(ids, **fwd)
        (out.logits.float().pow(2).mean() + (out.aux_loss or 0)).backward()
    else:
        with RouterReplay(model, **rr_kwargs):
            out = model(ids, **fwd)
            (out.logits.float().pow(2).mean() + (out.aux_loss or 0)).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


def record(model, ids, **fwd) -> torch.Tensor:
    with RouterReplay(model, mode="record") as rr, torch.no_grad():
        model(ids, **fwd)
    return rr.routed_experts()


def other_set(live: torch.Tensor, num_experts: int, moe_layers) -> torch.Tensor:
    """Routing whose every MoE row is disjoint from the live row (dense layers stay -1)."""
    out = live.clone()
    k = live.shape[-1]
    for layer in moe_layers:
        for i in range(live.shape[0]):
            taken = set(live[i, layer].tolist())
            out[i, layer] = torch.tensor([e for e in range(num_experts) if e not in taken][:k])
    return out


def routers(model):
    rr = RouterReplay(model, mode="record")
    return rr.routers


def num_experts(model) -> int:
    return RouterReplay(model, mode="record").num_experts


def call_router(model, r, hidden):
    """r's router module on hidden [N, hidden]; MiniMax-M2's takes its block's correction bias."""
    if r.rule == "sigmoid":
        block = model.get_submodule(r.name.rsplit(".", 1)[0])
        return r.module(hidden, block.e_score_correction_bias)
    return r.module(hidden)


def oracle_topk(arch, path, seq: list[int], top_k: int, num_layers: int) -> torch.Tensor:
    """[len(seq), num_layers, top_k] transformers' router choice (as sets; -1 dense layers): the
    softmax routers' k most probable experts (gpt-oss: its k largest logits, the same set);
    MiniMax-M2: the k best sigmoid scores + correction bias, by the engine's rule with one group."""
    if arch != "minimax_m2":
        return hf_router_topk(str(path), seq, top_k, num_layers)
    model = hf_model(str(path))
    with torch.no_grad():
        logits = model(torch.tensor([seq]), output_router_logits=True).router_logits
    out = torch.full((len(seq), num_layers, top_k), -1, dtype=torch.int32)
    for layer, lg in zip(moe_layer_ids(model.config), logits):
        bias = model.model.layers[layer].mlp.e_score_correction_bias
        _, ids = grouped_sigmoid_topk(lg.reshape(len(seq), -1), bias, top_k, n_group=1, topk_group=1,
                                      renormalize=True, scaling_factor=1.0)
        out[:, layer] = ids.to(torch.int32)
    return out


def test_live_replay_is_exact(arch_model):
    """Replaying the model's own live top-k gives bit-identical logits and gradients."""
    arch, path, model = arch_model
    ids = ids_for(0)
    base, g_base = step(model, ids)
    live = record(model, ids)
    cfg = model.config
    moe = moe_layer_ids(cfg)
    assert live.shape == (2 * T, cfg.num_hidden_layers, cfg.num_experts_per_tok)
    assert live.dtype == torch.int32
    dense = [i for i in range(cfg.num_hidden_layers) if i not in moe]
    assert (live[:, dense] == -1).all()
    # the recorded ids are transformers' own router top-k (per sequence, as sets)
    oracle = oracle_topk(arch, path, ids[1].tolist(), cfg.num_experts_per_tok, cfg.num_hidden_layers)
    assert torch.equal(live[T:].sort(-1).values, oracle.sort(-1).values)

    replayed, g_rep = step(model, ids, dict(mode="replay", routed_experts=live))
    assert torch.equal(replayed.logits, base.logits)
    assert g_rep.keys() == g_base.keys()
    router_params = {n for r in routers(model) for n, p in model.named_parameters()
                     if any(p is q for q in r.module.parameters())}
    assert router_params and router_params <= g_base.keys()   # router weights (gpt-oss: and bias) included
    for n in g_base:
        assert torch.equal(g_rep[n], g_base[n]), n


def test_hooks_are_scoped(arch_model):
    _, _, model = arch_model
    ids = ids_for(1)
    with torch.no_grad():
        base = model(ids).logits
        live = record(model, ids)
        with RouterReplay(model, mode="replay",
                          routed_experts=other_set(live, num_experts(model), moe_layer_ids(model.config))):
            changed = model(ids).logits
        after = model(ids).logits
    assert not torch.equal(changed, base)
    assert torch.equal(after, base)
    assert all(not r.module._forward_hooks and "_router_replay_active" not in vars(r.module)
               for r in routers(model))


def test_replay_other_set_changes_output_and_trains_router(arch_model):
    arch, _, model = arch_model
    ids = ids_for(2)
    base, g_base = step(model, ids)
    live = record(model, ids)
    E, moe = num_experts(model), moe_layer_ids(model.config)
    other = other_set(live, E, moe)
    out, g = step(model, ids, dict(mode="replay", routed_experts=other))
    assert not torch.allclose(out.logits, base.logits)
    for r in routers(model):
        name = next(n for n, p in model.named_parameters() if p is r.module.weight)
        grad = g[name]  # [E, hidden]
        # every expert the replay used gets router gradient (each row is disjoint from the live one)
        for e in other[:, r.layer].unique().tolist():
            assert grad[e].abs().sum() > 0, (arch, r.layer, e)
    with RouterReplay(model, mode="replay", routed_experts=other) as rr, torch.no_grad():
        model(ids)
        assert rr.mismatch_rate() > 0.5
        first = moe[0]  # later layers' live choice depends on the replayed earlier layers
        assert torch.equal(rr.live_experts()[:, first], live[:, first])
    with RouterReplay(model, mode="replay", routed_experts=live) as rr, torch.no_grad():
        model(ids)
        assert rr.mismatch_rate() == 0.0


def test_gate_weight_rule(arch_model):
    """Replayed weights follow the model's rule: gathered from the *full* softmax (Qwen, Mixtral,
    OLMoE), the softmax over the replayed ids' logits (gpt-oss), the sigmoid scores at the ids
    normalised (MiniMax-M2)."""
    arch, _, model = arch_model
    r = routers(model)[-1]
    renorm = {"qwen3_moe": True, "mixtral": True, "qwen2_moe": False, "olmoe": False, "gpt_oss": True,
              "minimax_m2": True}[arch]
    rule = {"gpt_oss": "topk_softmax", "minimax_m2": "sigmoid"}.get(arch, "softmax")
    assert r.renormalize is renorm and r.rule == rule
    N, L, K, E = 7, model.config.num_hidden_layers, model.config.num_experts_per_tok, num_experts(model)
    hidden = torch.randn(N, model.config.hidden_size)
    routed = torch.full((N, L, K), -1)
    for layer in moe_layer_ids(model.config):
        routed[:, layer] = torch.stack([torch.randperm(E)[:K] for _ in range(N)])
    with RouterReplay(model, mode="replay", routed_experts=routed):
        logits, w, ids = call_router(model, r, hidden)
    assert torch.equal(ids, routed[:, r.layer].long())
    if rule == "topk_softmax":
        want = torch.softmax(logits.float().gather(1, ids), -1)
    elif rule == "sigmoid":
        s = logits.float().sigmoid().gather(1, ids)
        want = s / s.sum(-1, keepdim=True)
    else:
        probs = torch.softmax(logits.float(), -1).gather(1, ids)
        want = probs / probs.sum(-1, keepdim=True) if renorm else probs
    torch.testing.assert_close(w, want, rtol=0, atol=1e-7)


def test_batch_layouts_and_token_count(arch_model):
    _, _, model = arch_model
    ids = ids_for(3)
    live = record(model, ids)
    four_d = live.reshape(2, T, *live.shape[1:])
    with torch.no_grad():
        with RouterReplay(model, mode="replay", routed_experts=live):
            a = model(ids).logits
        with RouterReplay(model, mode="replay", routed_experts=four_d):
            b = model(ids).logits
    assert torch.equal(a, b)
    # rows follow b * T + t: replaying sequence 1 alone uses rows T..2T-1
    with RouterReplay(model, mode="replay", routed_experts=live[T:]), torch.no_grad():
        c = model(ids[1:]).logits
    torch.testing.assert_close(c[0], a[1], rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="saw 13 token rows but routed_experts has 26"):
        with RouterReplay(model, mode="replay", routed_experts=live), torch.no_grad():
            model(ids[:1])


def test_gradient_checkpointing_replays_same_ids(arch_model):
    arch, _, model = arch_model
    ids = ids_for(4)
    live = record(model, ids)
    other = other_set(live, num_experts(model), moe_layer_ids(model.config))
    plain, g_plain = step(model, ids, dict(mode="replay", routed_experts=other))
    model.activation_checkpointing_enable()
    try:
        model.zero_grad(set_to_none=True)
        with RouterReplay(model, mode="replay", routed_experts=other) as rr:
            out = model(ids)
            out.logits.float().pow(2).mean().backward()
        assert all(r.recompute_calls >= 1 and r.forward_calls == 1 for r in rr.routers)
        g = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        assert torch.equal(out.logits, plain.logits)
        for n in g_plain:
            assert torch.equal(g[n], g_plain[n]), n
        # leaving the context before backward is flagged (recompute would use live routing)
        with pytest.warns(RuntimeWarning, match="before backward"):
            with RouterReplay(model, mode="replay", routed_experts=other):
                out = model(ids)
        del out  # its backward would recompute with live routing
    finally:
        model.activation_checkpointing_disable()


def test_aux_loss_uses_live_topk(arch_model):
    """Documented choice: the load-balancing aux loss is computed from the live top-k."""
    import importlib

    arch, _, model = arch_model
    lb = importlib.import_module(type(model).__module__).load_balancing_loss_func
    cfg = model.config
    E, K = num_experts(model), cfg.num_experts_per_tok
    ids = ids_for(5)
    live = record(model, ids)
    other = other_set(live, E, moe_layer_ids(cfg))
    with torch.no_grad(), RouterReplay(model, mode="replay", routed_experts=other):
        out = model(ids, output_router_logits=True)
    assert torch.equal(out.aux_loss, lb(out.router_logits, E, K))  # live top-k of the trainer's logits
    counts = sum(torch.nn.functional.one_hot(other[:, layer].long(), E).sum(1).float().sum(0)
                 for layer in moe_layer_ids(cfg))
    probs = sum(torch.softmax(lg, -1).sum(0) for lg in out.router_logits)
    rows = 2 * T * len(out.router_logits)
    with_replayed = (counts / rows * probs / rows).sum() * E
    assert not torch.allclose(out.aux_loss, with_replayed)


def test_router_logits_and_alignment_loss(arch_model):
    _, _, model = arch_model
    ids = ids_for(6)
    live = record(model, ids)
    other = other_set(live, num_experts(model), moe_layer_ids(model.config))
    model.zero_grad(set_to_none=True)
    with RouterReplay(model, mode="replay", routed_experts=other, keep_router_logits=True) as rr:
        out = model(ids, output_router_logits=True)
        logits = rr.router_logits()
        assert sorted(logits) == moe_layer_ids(model.config)
        for got, want in zip(logits.values(), out.router_logits):
            assert torch.equal(got, want)
        loss = router_alignment_loss(logits, other)
        loss.backward()
    assert loss > 0
    for r in rr.routers:
        assert r.module.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="keep_router_logits"):
        RouterReplay(model, mode="replay", routed_experts=other).router_logits()


def test_validation_errors(tiny_checkpoint):
    model = load(tiny_checkpoint("qwen2_moe"))
    N, L, K = 5, 3, 2
    good = torch.stack([torch.randperm(8)[:K] for _ in range(N * L)]).reshape(N, L, K)
    good[:, 0] = -1  # dense layer 0: ignored
    RouterReplay(model, mode="replay", routed_experts=good)
    garbage_dense = good.clone()
    garbage_dense[:, 0] = 99
    RouterReplay(model, mode="replay", routed_experts=garbage_dense)  # dense rows are ignored
    with pytest.raises(ValueError, match=r"num_layers=3, top_k=2"):
        RouterReplay(model, mode="replay", routed_experts=good[:, :2])
    with pytest.raises(ValueError, match=r"num_layers=3, top_k=2"):
        RouterReplay(model, mode="replay", routed_experts=good[..., :1])
    bad = good.clone()
    bad[2, 1, 0] = 8
    with pytest.raises(ValueError, match=r"row 2, layer 1 is outside \[0, 8\)"):
        RouterReplay(model, mode="replay", routed_experts=bad)
    bad = good.clone()
    bad[3, 2, 0] = -1
    with pytest.raises(ValueError, match=r"row 3, layer 2 is outside"):
        RouterReplay(model, mode="replay", routed_experts=bad)
    bad = good.clone()
    bad[4, 2] = torch.tensor([5, 5])
    with pytest.raises(ValueError, match=r"row 4, layer 2 repeats an expert id \[5, 5\]"):
        RouterReplay(model, mode="replay", routed_experts=bad)
    RouterReplay(model, mode="replay", routed_experts=bad, validate=False)  # caller validated on arrival
    with pytest.raises(ValueError, match="integer"):
        RouterReplay(model, mode="replay", routed_experts=good.float())
    with pytest.raises(ValueError, match="needs routed_experts"):
        RouterReplay(model, mode="replay")
    with pytest.raises(ValueError, match="mode must be one of"):
        RouterReplay(model, mode="live")
    with pytest.raises(ValueError, match="no supported MoE router"):
        RouterReplay(torch.nn.Linear(2, 2), mode="record")
    rr = RouterReplay(model, mode="replay", routed_experts=good)
    with rr, pytest.raises(RuntimeError, match="another RouterReplay"):
        with RouterReplay(model, mode="record"):
            pass
    with RouterReplay(model, mode="off"):  # touches nothing
        pass


@pytest.mark.parametrize("arch", ("qwen3_moe",) + NEW_ARCHS)
def test_packed_batch_replay_matches_per_sample(tiny_checkpoint, arch):
    """Routing packed by pack_samples replays each sample's own routing inside a packed row
    (gpt-oss: its full and sliding-window masks built from the restarts by enable_packed_masks)."""
    model = load(tiny_checkpoint(arch)).eval()
    assert enable_packed_masks(model) == 0          # already done by load(): idempotent
    samples = []
    for i, (p, r) in enumerate([(5, 4), (3, 6), (7, 1)]):
        toks = ids_for(10 + i, (1, p + r))[0]
        routing = record(model, toks[None, :-1])  # [T-1, L, K]: the last token never went forward
        samples.append(Sample(prompt_ids=toks[:p], response_ids=toks[p:], rollout_logprobs=torch.zeros(r),
                              routed_experts=routing, rid=f"s{i}"))
    (batch,) = pack_samples(samples, pad_to_multiple=8)
    assert batch.num_tokens == 32
    with torch.no_grad():
        live = record(model, batch.input_ids, position_ids=batch.position_ids, use_cache=False)
        with RouterReplay(model, mode="replay", routed_experts=batch.routed_experts) as rr:
            packed = model(**batch.model_inputs()).logits[0]
        assert rr.mismatch_rate(batch.routing_mask) == 0.0
    real = batch.routing_mask[0]
    assert torch.equal(live[real].sort(-1).values, batch.routed_experts[real].sort(-1).values)
    for i, s in enumerate(samples):
        with torch.no_grad():
            alone = model(s.tokens[None]).logits[0]
        pos = (batch.sample_index[0] == i).nonzero().flatten()
        torch.testing.assert_close(packed[pos[:-1]], alone[:-1], rtol=0, atol=1e-5)


@pytest.mark.parametrize("arch", NEW_ARCHS)
def test_router_bias_and_correction_bias(tiny_checkpoint, arch):
    """gpt-oss: replaying ids outside the live top-k trains the router's bias entries of every
    replayed expert (its weights are a softmax over the replayed ids' biased logits). MiniMax-M2:
    the block's e_score_correction_bias (a buffer) only chose experts; the replayed weights never
    read it."""
    model = load(tiny_checkpoint(arch))
    ids = ids_for(7)
    live = record(model, ids)
    other = other_set(live, num_experts(model), moe_layer_ids(model.config))
    _, g = step(model, ids, dict(mode="replay", routed_experts=other))
    for r in routers(model):
        if arch == "gpt_oss":
            name = next(n for n, p in model.named_parameters() if p is r.module.bias)
            used = other[:, r.layer].unique()
            assert (g[name][used] != 0).all(), (r.layer, g[name])
        else:
            block = model.get_submodule(r.name.rsplit(".", 1)[0])
            assert not block.e_score_correction_bias.requires_grad
    if arch != "minimax_m2":
        return
    r = routers(model)[-1]
    block = model.get_submodule(r.name.rsplit(".", 1)[0])
    hidden = torch.randn(5, model.config.hidden_size)
    with RouterReplay(model, mode="replay", routed_experts=other[:5]), torch.no_grad():
        _, w, got = r.module(hidden, block.e_score_correction_bias)
        _, w_shifted, got_shifted = r.module(hidden, block.e_score_correction_bias + 1.0)
    assert torch.equal(got, other[:5, r.layer].long()) and torch.equal(got_shifted, got)
    assert torch.equal(w, w_shifted)


def test_enable_packed_masks_is_needed_for_gpt_oss(tiny_checkpoint):
    """transformers' GptOssModel builds its masks without position_ids: a packed row's samples
    attend to each other unless enable_packed_masks hooks it; hooked, a packed sample's logits are
    its own (full and sliding-window layers), and an unpacked forward is unchanged."""
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoint("gpt_oss")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    a, b = ids_for(20, (1, 12)), ids_for(21, (1, 11))                # longer than the window (8)
    packed = dict(input_ids=torch.cat([a, b], 1), position_ids=torch.cat([torch.arange(12), torch.arange(11)])[None],
                  use_cache=False)
    with torch.no_grad():
        alone = model(b).logits[0]
        plain_ab = model(torch.cat([a, b], 1)).logits
        leaked = model(**packed).logits[0, 12:]
        assert not torch.allclose(leaked, alone, atol=1e-3)          # transformers' own masks: b sees a
        assert enable_packed_masks(model) == 1 and enable_packed_masks(model) == 0
        torch.testing.assert_close(model(**packed).logits[0, 12:], alone, rtol=0, atol=1e-5)
        assert torch.equal(model(torch.cat([a, b], 1)).logits, plain_ab)   # no position_ids: untouched
    assert enable_packed_masks(load(tiny_checkpoint("qwen3_moe"))) == 0  # the others mask by positions already
