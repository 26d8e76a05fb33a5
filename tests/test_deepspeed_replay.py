"""RouterReplay over DeepSpeed MoE (TopKGate / MOELayer) on CPU with gloo, single process."""
from __future__ import annotations

import socket
import sys

import pytest
import torch

from trainer_bridge import RouterReplay

H, E = 16, 8


@pytest.fixture(scope="module")
def ds():
    """deepspeed with a world_size 1 gloo group; torch.distributed and DeepSpeed's globals reset after."""
    mp = pytest.MonkeyPatch()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in dict(DS_ACCELERATOR="cpu", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(port)).items():
        mp.setenv(k, v)
    deepspeed = pytest.importorskip("deepspeed")
    # NOTE: the shared-memory all-reduce op is JIT-compiled on first use (~50 s); one rank needs none.
    mp.setattr(sys.modules["deepspeed.comm.torch"], "build_shm_op", lambda: None)
    already = torch.distributed.is_initialized()
    deepspeed.init_distributed(dist_backend="gloo")
    yield deepspeed
    from deepspeed.comm import comm as ds_comm
    from deepspeed.utils import groups
    for name in ("_EXPERT_PARALLEL_GROUP", "_EXPERT_PARALLEL_GROUP_RANKS", "_EXPERT_DATA_PARALLEL_GROUP",
                 "_EXPERT_DATA_PARALLEL_GROUP_RANKS", "_ALL_TO_ALL_GROUP"):
        setattr(groups, name, {})
    groups._WORLD_GROUP = None
    if not already and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
        ds_comm.cdb = None
    mp.undo()


class Net(torch.nn.Module):
    def __init__(self, k: int, groups: bool = True, **moe_kw):
        from deepspeed.moe.layer import MoE

        super().__init__()
        self.emb = torch.nn.Embedding(50, H)
        kw = dict(num_experts=E, k=k, drop_tokens=False, min_capacity=0, top2_2nd_expert_sampling=False) | moe_kw
        self.layers = torch.nn.ModuleList([
            MoE(H, torch.nn.Sequential(torch.nn.Linear(H, 32), torch.nn.GELU(), torch.nn.Linear(32, H)), **kw)
            for _ in range(2)])
        self.head = torch.nn.Linear(H, 50)
        if groups:  # deepspeed.initialize does this itself
            for layer in self.layers:
                layer.set_deepspeed_parallelism()

    def forward(self, ids):
        h, aux = self.emb(ids), 0.0
        for layer in self.layers:
            out, l_aux, _ = layer(h)
            h, aux = h + out, aux + l_aux
        return self.head(h), aux


IDS = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(0))


def step(net, rr_kwargs=None):
    net.zero_grad(set_to_none=True)
    if rr_kwargs is None:
        out, aux = net(IDS)
        (out.pow(2).mean() + aux).backward()
    else:
        with RouterReplay(net, **rr_kwargs):
            out, aux = net(IDS)
            (out.pow(2).mean() + aux).backward()
    return out.detach(), aux.detach(), {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}


def record(net):
    with RouterReplay(net, mode="record") as rr, torch.no_grad():
        net(IDS)
    return rr.routed_experts()


def disjoint(live):
    out = live.clone()
    for i in range(live.shape[0]):
        for layer in range(live.shape[1]):
            free = [e for e in range(E) if e not in set(live[i, layer].tolist())]
            out[i, layer] = torch.tensor(free[:live.shape[2]])
    return out


@pytest.mark.parametrize("k", [1, 2, 4])
def test_moe_record_and_live_replay_exact(ds, k):
    torch.manual_seed(k)
    net = Net(k)
    base = step(net)
    live = record(net)
    assert live.shape == (IDS.numel(), 2, k)
    for mode_kwargs in (dict(mode="record"), dict(mode="replay", routed_experts=live)):
        out, aux, grads = step(net, mode_kwargs)
        assert torch.equal(out, base[0]) and torch.equal(aux, base[1])
        assert grads.keys() == base[2].keys()
        for n in grads:
            assert torch.equal(grads[n], base[2][n]), (mode_kwargs["mode"], n)
    assert "forward" not in vars(net.layers[0].deepspeed_moe.gate)  # patch undone


@pytest.mark.parametrize("k", [1, 2, 4])
def test_moe_replay_other_set(ds, k):
    torch.manual_seed(10 + k)
    net = Net(k)
    base = step(net)
    live = record(net)
    other = disjoint(live)
    out, aux, grads = step(net, dict(mode="replay", routed_experts=other))
    assert not torch.allclose(out, base[0])
    for layer in range(2):
        g = grads[f"layers.{layer}.deepspeed_moe.gate.wg.weight"]
        for e in other[:, layer].unique().tolist():
            assert g[e].abs().sum() > 0
    with RouterReplay(net, mode="replay", routed_experts=other) as rr, torch.no_grad():
        net(IDS)
        assert torch.equal(rr.live_experts()[:, 0], live[:, 0])
        assert rr.mismatch_rate() > 0.5


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("sparse", [False, True])
def test_gate_formats_and_weight_rule(ds, k, sparse):
    """Direct TopKGate calls (dense and sparse_routes outputs) match the original; replayed weights
    follow DeepSpeed's rule (top-1: full-softmax probability; top-2/top-k: renormalised)."""
    from deepspeed.moe.sharded_moe import TopKGate

    torch.manual_seed(20 + k)
    gate = TopKGate(H, E, k=k, min_capacity=0, drop_tokens=False, top2_2nd_expert_sampling=False)
    x = torch.randn(11, H)
    want = gate(x, None, sparse)
    with RouterReplay(gate, mode="record") as rr:
        got = gate(x, None, sparse)
    for a, b in zip(want, got):
        assert torch.equal(torch.as_tensor(a), torch.as_tensor(b))
    other = disjoint(rr.routed_experts())
    with RouterReplay(gate, mode="replay", routed_experts=other):
        out = gate(x, None, sparse)
    probs = torch.softmax(x @ gate.wg.weight.t(), -1).gather(1, other[:, 0].long())
    rule = probs if k == 1 else probs / probs.sum(-1, keepdim=True)
    if sparse:
        indices, gates = out[3].t(), out[5].t()  # [k, s] -> [s, k]
        assert torch.equal(indices, other[:, 0])
        torch.testing.assert_close(gates, rule, rtol=0, atol=1e-6)
    else:
        combine = out[1].sum(-1)  # [s, e]
        torch.testing.assert_close(combine.gather(1, other[:, 0].long()), rule, rtol=0, atol=1e-6)
        assert torch.equal((combine > 0).sum(-1), torch.full((11,), k))


def test_gate_requirements(ds):
    with pytest.raises(ValueError, match="drop_tokens=False"):
        RouterReplay(Net(2, drop_tokens=True), mode="record")
    with pytest.raises(ValueError, match="noisy gate"):
        RouterReplay(Net(1, noisy_gate_policy="Jitter"), mode="record")
    with pytest.raises(ValueError, match="top2_2nd_expert_sampling"):
        RouterReplay(Net(2, top2_2nd_expert_sampling=True), mode="record")
    net = Net(2, top2_2nd_expert_sampling=True)  # replay does not care how the live 2nd expert is chosen
    RouterReplay(net, mode="replay", routed_experts=disjoint(record(Net(2))))
    with pytest.raises(ValueError, match="saw 9 token rows but routed_experts has 18"):
        with RouterReplay(net, mode="replay", routed_experts=disjoint(record(Net(2)))), torch.no_grad():
            net(IDS[:1])


def test_deepspeed_engine_train_step_under_replay(ds):
    """deepspeed.initialize (ZeRO-1, torch AdamW, gloo): a replayed step matches the un-hooked loss."""
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer as moe_groups

    torch.manual_seed(3)
    net = Net(2, groups=False)
    opt = torch.optim.AdamW(moe_groups({"params": list(net.parameters()), "name": "all"}), lr=1e-2)
    engine, *_ = ds.initialize(model=net, optimizer=opt, config={
        "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1},
        "zero_allow_untested_optimizer": True})
    with torch.no_grad():
        out0, aux0 = engine(IDS)
    live = record(engine)
    with RouterReplay(engine, mode="replay", routed_experts=live) as rr:
        out, aux = engine(IDS)
        loss = out.pow(2).mean() + aux
        engine.backward(loss)
        engine.step()
        assert rr.mismatch_rate() == 0.0
    assert torch.equal(out.detach(), out0) and torch.equal(aux.detach(), aux0)
    with torch.no_grad():
        out1, _ = engine(IDS)
    assert not torch.equal(out1, out0)  # the step changed the weights
