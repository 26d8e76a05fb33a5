"""Sample validation, packing alignment (property test), RL losses and metrics against hand-computed values."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer_bridge import (LossConfig, Sample, grpo_advantages, k3_kl, kl_k3, logprob_abs_diff, pack_samples,
                            policy_loss, ratio_outside, response_length_mean, reward_mean, rl_loss,
                            router_alignment_loss, routing_mismatch_rate, step_metrics, token_logprobs)

L, K, E = 3, 2, 8


def routing(rows: int, dense=(0,), seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    r = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(rows * L)] or [torch.zeros(0, K)])
    r = r.reshape(rows, L, K)
    r[:, list(dense)] = -1
    return r.to(torch.int32)


def sample(p=3, r=2, rid="a", **kw) -> Sample:
    return Sample(prompt_ids=list(range(10, 10 + p)), response_ids=list(range(50, 50 + r)),
                  rollout_logprobs=[-0.5] * r, routed_experts=kw.pop("routed", routing(p + r - 1)), rid=rid, **kw)


# ---------------------------------------------------------------- Sample validation
def test_sample_validate_ok():
    s = sample().validate(E, L, K)
    assert s.num_tokens == 5 and s.response_length == 2
    assert torch.equal(s.loss_mask, torch.ones(2))
    sample().validate(E, L, K, moe_layers=[1, 2])


@pytest.mark.parametrize("mutate, match", [
    (lambda r: r[:-1],
     r"sample 'bad': routed_experts has shape \[3, 3, 2\], expected \[T-1, num_layers, top_k\] = \[4, 3, 2\]"),
    (lambda r: r[:, :2], r"sample 'bad': routed_experts has shape \[4, 2, 2\]"),
    (lambda r: r[..., :1], r"sample 'bad'.*expected"),
    (lambda r: r.index_put_((torch.tensor(1), torch.tensor(2), torch.tensor(0)), torch.tensor(8, dtype=torch.int32)),
     r"sample 'bad': routed_experts: expert id \[8, .*\] at row 1, layer 2 is outside \[0, 8\)"),
    (lambda r: r.index_put_((torch.tensor(2), torch.tensor(1), torch.tensor(1)), torch.tensor(-1, dtype=torch.int32)),
     r"sample 'bad'.*row 2, layer 1 is outside \[0, 8\) \(-1 only allowed in an all -1 dense layer\)"),
    (lambda r: r.index_put_((torch.tensor(3), torch.tensor(2)), torch.tensor([4, 4], dtype=torch.int32)),
     r"sample 'bad'.*row 3, layer 2 repeats an expert id \[4, 4\]"),
])
def test_sample_validate_routing_errors(mutate, match):
    s = sample(rid="bad", routed=mutate(routing(4)))
    with pytest.raises(ValueError, match=match):
        s.validate(E, L, K)


def test_sample_validate_other_errors():
    with pytest.raises(ValueError, match=r"sample 'x': loss_mask has 1 entries for 2 response tokens"):
        sample(rid="x", loss_mask=[1]).validate(E, L, K)
    with pytest.raises(ValueError, match=r"sample 'x': rollout_logprobs has 3 entries"):
        Sample(prompt_ids=[1, 2], response_ids=[3, 4], rollout_logprobs=[0, 0, 0], routed_experts=routing(3),
               rid="x").validate(E, L, K)
    with pytest.raises(ValueError, match="non-finite"):
        Sample(prompt_ids=[1, 2], response_ids=[3], rollout_logprobs=[float("nan")], routed_experts=routing(2),
               rid="x").validate(E, L, K)
    with pytest.raises(ValueError, match=r"sample 'x': no routed_experts"):
        Sample(prompt_ids=[1], response_ids=[2], rid="x").validate(E, L, K)
    with pytest.raises(ValueError, match=r"ids in dense layers \[0\]"):
        sample(rid="x", routed=routing(4, dense=())).validate(E, L, K, moe_layers=[1, 2])
    with pytest.raises(ValueError, match="empty prompt"):
        Sample(prompt_ids=[], response_ids=[2], routed_experts=routing(0), rid="x").validate(E, L, K)
    with pytest.raises(ValueError, match="integer"):
        Sample(prompt_ids=[1], response_ids=[2], routed_experts=torch.zeros(1, L, K), rid="x")


# ---------------------------------------------------------------- packing
@st.composite
def sample_sets(draw):
    n = draw(st.integers(1, 6))
    out = []
    for i in range(n):
        p, r = draw(st.integers(1, 7)), draw(st.integers(0, 6))
        T = p + r
        # token ids are unique (sample, position) codes; routing row j holds [token_j, token_j + 1]
        toks = [1000 * (i + 1) + j for j in range(T)]
        rows = torch.full((T - 1, L, K), -1, dtype=torch.int32)
        for j in range(T - 1):
            rows[j, 1:] = torch.tensor([toks[j], toks[j] + 1])
        out.append(Sample(prompt_ids=toks[:p], response_ids=toks[p:], loss_mask=draw(st.lists(
            st.sampled_from([0.0, 1.0]), min_size=r, max_size=r)), rollout_logprobs=[-(t % 101) / 10 for t in toks[p:]],
            routed_experts=rows, rid=f"s{i}"))
    return out


@settings(max_examples=60, deadline=None)
@given(samples=sample_sets(), mult=st.sampled_from([1, 4, 8]), cap=st.sampled_from([None, 16, 32]),
       moe_layers=st.sampled_from([None, [1, 2]]))
def test_packing_keeps_token_and_routing_rows_paired(samples, mult, cap, moe_layers):
    if cap is not None and max(s.num_tokens for s in samples) > cap:
        with pytest.raises(ValueError, match="more than max_tokens"):
            pack_samples(samples, pad_to_multiple=mult, max_tokens=cap, moe_layers=moe_layers)
        return
    batches = pack_samples(samples, pad_to_multiple=mult, max_tokens=cap, moe_layers=moe_layers)
    # without moe_layers, dense layers are inferred from the rows (none at all: every layer MoE)
    dense_known = moe_layers is not None or any(s.num_tokens > 1 for s in samples)
    seen = []
    for b in batches:
        N = b.num_tokens
        assert N % mult == 0 and (cap is None or N <= cap)
        assert b.routed_experts.shape == (N, L, K)
        for i in range(N):
            si, tok = int(b.sample_index[0, i]), int(b.input_ids[0, i])
            row = b.routed_experts[i]
            assert (row[0] == -1).all() or not dense_known  # dense layer stays -1
            assert len(set(row[1].tolist())) == K and min(row[1].tolist()) >= 0
            if si < 0:  # padding: filler ids, masked out
                assert not b.routing_mask[0, i] and b.loss_mask[0, i] == 0 and b.sample_index[0, i] == -1
                assert row[1].tolist() == list(range(K))
                continue
            s = samples[si]
            j = int(b.position_ids[0, i])
            assert tok == int(s.tokens[j])
            if j < s.num_tokens - 1:
                assert b.routing_mask[0, i]
                assert row[1:].tolist() == [[tok, tok + 1]] * (L - 1)  # token row i paired with routing row i
                assert torch.equal(row, s.routed_experts[j])
                assert int(b.target_ids[0, i]) == int(s.tokens[j + 1])
                r = j + 1 - len(s.prompt_ids)
                if r >= 0:
                    assert b.loss_mask[0, i] == s.loss_mask[r]
                    assert b.rollout_logprobs[0, i] == s.rollout_logprobs[r]
                else:
                    assert b.loss_mask[0, i] == 0
            else:  # last token: no routing row, filler ids, nothing to predict
                assert not b.routing_mask[0, i] and b.loss_mask[0, i] == 0
                assert row[1].tolist() == list(range(K))
            seen.append((si, j))
        # per-sample tokens are contiguous and in order; the padding tail restarts positions
        n_real = int((b.sample_index >= 0).sum())
        assert (b.sample_index[0, n_real:] == -1).all()
        assert torch.equal(b.position_ids[0, n_real:], torch.arange(N - n_real))
        assert b.cu_seqlens[-1] == n_real
    assert sorted(seen) == sorted((i, j) for i, s in enumerate(samples) for j in range(s.num_tokens))


def test_pack_per_token_and_errors():
    a, b = sample(3, 2, "a"), sample(2, 3, "b")
    (batch,) = pack_samples([a, b], pad_to_multiple=4)
    assert batch.num_tokens == 12 and batch.num_padding == 2
    adv = batch.per_token(torch.tensor([1.5, -2.0]))
    assert adv[0].tolist() == [1.5] * 5 + [-2.0] * 5 + [0.0, 0.0]
    assert batch.loss_mask[0].tolist() == [0, 0, 1, 1, 0, 0, 1, 1, 1, 0, 0, 0]
    with pytest.raises(ValueError, match="multiple of pad_to_multiple"):
        pack_samples([a], pad_to_multiple=4, max_tokens=10)
    with pytest.raises(ValueError, match="sample 'b' has no routed_experts"):
        pack_samples([a, Sample(prompt_ids=[1], response_ids=[2], rid="b")])
    (nr,) = pack_samples([Sample(prompt_ids=[1], response_ids=[2], rid="c")])
    assert nr.routed_experts is None


# ---------------------------------------------------------------- losses
def test_grpo_advantages():
    adv = grpo_advantages([1.0, 0.0, 1.0, 0.0, 0.0, 3.0], ["g", "g", "h", "h", "h", "solo"], eps=0.0)
    # group g: mean .5, std (n-1) = sqrt(.5); group h: mean 1/3, std = sqrt(1/3); singleton -> 0
    s = math.sqrt(0.5)
    h = math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2)
    want = [0.5 / s, -0.5 / s, (2 / 3) / h, -(1 / 3) / h, -(1 / 3) / h, 0.0]
    torch.testing.assert_close(adv, torch.tensor(want))
    assert grpo_advantages([2.0, 2.0], [0, 0]).tolist() == [0.0, 0.0]  # eps keeps it finite
    torch.testing.assert_close(grpo_advantages([1.0, 3.0], [0, 0], std_normalize=False), torch.tensor([-1.0, 1.0]))
    with pytest.raises(ValueError, match="2 rewards but 3 group ids"):
        grpo_advantages([1.0, 2.0], [0, 0, 1])


def test_policy_loss_ppo_clip_hand_computed():
    lp = torch.log(torch.tensor([0.5, 0.5, 0.5, 0.5])).requires_grad_()
    roll = torch.log(torch.tensor([0.25, 0.25, 1.0, 0.5]))  # ratios 2, 2, .5, 1
    adv = torch.tensor([1.0, -1.0, 1.0, 3.0])
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0])
    loss, stats = policy_loss(lp, roll, adv, mask, clip_eps=0.2)
    # token0: A>0, r=2 -> clipped 1.2 -> -1.2 ; token1: A<0, r=2 -> max(2, 1.2) = 2 ; token2: r=.5 -> max(-.5,-.8) = -.5
    assert loss.item() == pytest.approx((-1.2 + 2.0 - 0.5) / 3)
    assert stats["clip_frac"].item() == pytest.approx(1 / 3)
    loss.backward()
    # d/dlp of -A r = -A r for unclipped tokens; 0 for clipped; divided by 3
    torch.testing.assert_close(lp.grad, torch.tensor([0.0, 2.0 / 3, -0.5 / 3, 0.0]))
    # asymmetric clip-higher
    loss_hi, _ = policy_loss(lp.detach(), roll, adv, mask, clip_eps=0.2, clip_eps_high=0.5)
    assert loss_hi.item() == pytest.approx((-1.5 + 2.0 - 0.5) / 3)


def test_policy_loss_tis_and_aggregation():
    lp = torch.log(torch.tensor([0.5, 0.4])).requires_grad_()
    roll = torch.log(torch.tensor([0.1, 0.8]))  # p_train/p_roll = 5, .5
    adv = torch.tensor([1.0, 1.0])
    mask = torch.ones(2)
    loss, stats = policy_loss(lp, roll, adv, mask, tis_cap=2.0)
    # on-policy step: ratio 1 (no clip), weights min(5, 2) = 2 and .5
    assert loss.item() == pytest.approx((-2.0 - 0.5) / 2)
    assert stats["tis_weight_mean"].item() == pytest.approx(1.25)
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([-1.0, -0.25]))
    # with old logprobs: PPO ratio vs old, TIS weight exp(old - rollout)
    old = torch.log(torch.tensor([0.25, 0.4]))
    loss, _ = policy_loss(lp.detach(), roll, adv, mask, old_logprobs=old, tis_cap=2.0, clip_eps=0.2)
    assert loss.item() == pytest.approx((-1.2 * 2.0 - 1.0 * 0.5) / 2)
    # seq-mean-token-mean: sample 0 has tokens (-1, -3), sample 1 one token (-2) -> mean(-2, -2) = -2
    per = torch.tensor([0.0, 0.0, 0.0])
    loss, _ = policy_loss(per, per, torch.tensor([1.0, 3.0, 2.0]), torch.ones(3), loss_agg="seq-mean-token-mean",
                          sample_index=torch.tensor([0, 0, 1]))
    assert loss.item() == pytest.approx(-2.0)
    loss, _ = policy_loss(per, per, torch.tensor([1.0, 3.0, 2.0]), torch.ones(3), normalizer=6.0)
    assert loss.item() == pytest.approx(-1.0)


def test_k3_and_router_alignment_and_logprobs():
    lp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    assert kl_k3(lp, ref).item() == pytest.approx(0.5 - math.log(0.5) - 1)
    logits = torch.tensor([[[0.0, math.log(3.0)]]])
    assert token_logprobs(logits, torch.tensor([[1]])).item() == pytest.approx(math.log(0.75))
    rl = {1: torch.log(torch.tensor([[0.5, 0.25, 0.25], [0.25, 0.5, 0.25]])).requires_grad_()}
    routed = torch.tensor([[[-1, -1], [0, 1]], [[-1, -1], [2, 1]]])
    loss = router_alignment_loss(rl, routed)
    want = ((-math.log(0.5) - math.log(0.25)) / 2 + (-math.log(0.25) - math.log(0.5)) / 2) / 2
    assert loss.item() == pytest.approx(want)
    masked = router_alignment_loss(rl, routed, row_mask=torch.tensor([True, False]))
    assert masked.item() == pytest.approx((-math.log(0.5) - math.log(0.25)) / 2)
    loss.backward()
    assert rl[1].grad[:, 2].abs().sum() > 0


def test_rl_loss_combines_terms():
    a = sample(2, 2, "a")
    (batch,) = pack_samples([a])
    torch.manual_seed(0)
    logits = torch.randn(1, batch.num_tokens, 64, requires_grad=True)
    lp = token_logprobs(logits, batch.target_ids).detach()
    cfg = LossConfig(kl_coef=0.1, entropy_coef=0.01, router_align_coef=0.5)
    rlog = {1: torch.randn(batch.num_tokens, E), 2: torch.randn(batch.num_tokens, E)}
    loss, stats = rl_loss(cfg, logits=logits, batch=batch, advantages=torch.tensor([1.0]), ref_logprobs=lp,
                          router_logits=rlog)
    assert stats["kl_ref"].item() == pytest.approx(0.0, abs=1e-6)
    want = (stats["policy_loss"] + 0.1 * stats["kl_ref"] - 0.01 * stats["entropy"] + 0.5 * stats["router_align"])
    assert loss.item() == pytest.approx(want.item(), rel=1e-6)
    loss.backward()
    with pytest.raises(ValueError, match="loss_agg"):
        LossConfig(loss_agg="sum")
    with pytest.raises(ValueError, match="needs ref_logprobs"):
        rl_loss(cfg, logits=logits, batch=batch, advantages=torch.tensor([1.0]))


# ---------------------------------------------------------------- metrics
def test_metrics_hand_computed():
    train = torch.log(torch.tensor([0.5, 0.5, 0.5, 0.5]))
    roll = torch.log(torch.tensor([0.5, 0.2, 0.9, 0.1]))
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0])
    diffs = [0.0, math.log(2.5), math.log(0.9 / 0.5)]
    assert logprob_abs_diff(train, roll, mask) == pytest.approx(sum(diffs) / 3)
    ks = [r - 1 - math.log(r) for r in (1.0, 2.5, 0.5 / 0.9)]
    assert k3_kl(train, roll, mask) == pytest.approx(sum(ks) / 3)
    assert ratio_outside(train, roll, mask, tau=2.0) == pytest.approx(1 / 3)  # only 2.5 leaves [1/2, 2]
    assert ratio_outside(train, roll) == pytest.approx(2 / 4)  # unmasked: 2.5 and 5
    live = torch.tensor([[[-1, -1], [0, 1]], [[-1, -1], [2, 3]], [[-1, -1], [4, 5]]])
    rep = torch.tensor([[[-1, -1], [1, 0]], [[-1, -1], [2, 4]], [[-1, -1], [0, 1]]])
    assert routing_mismatch_rate(live, rep) == pytest.approx(2 / 3)  # order within a row is ignored
    assert routing_mismatch_rate(live, rep, mask=torch.tensor([True, True, False])) == pytest.approx(1 / 2)
    ss = [sample(2, 1, "a", reward=1.0), sample(2, 3, "b", reward=0.0)]
    assert reward_mean(ss) == 0.5 and response_length_mean(ss) == 2.0
    m = step_metrics(train_logprobs=train, rollout_logprobs=roll, loss_mask=mask, samples=ss,
                     live_experts=live, replayed_experts=rep)
    assert set(m) == {"train_rollout_logprob_abs_diff", "train_rollout_logprob_max_abs_diff", "k3_kl", "f_tau2",
                      "routing_mismatch_rate", "reward_mean", "response_length_mean"}
    assert m["train_rollout_logprob_max_abs_diff"] == pytest.approx(max(diffs))  # masked-out log 5 not counted


def test_version_mask_marks_the_tokens_each_weight_version_sampled():
    s = Sample(prompt_ids=[1, 2], response_ids=[3, 4, 5, 6, 7], weight_version="v2",
               weight_versions=[["v1", 0], ["v2", 3]])
    assert s.version_mask("v2").tolist() == [0, 0, 0, 1, 1]
    assert s.version_mask("v1").tolist() == [1, 1, 1, 0, 0]
    assert s.version_mask("v3").tolist() == [0] * 5
    # NOTE: a server without per-token versions: the whole response is weight_version's
    assert Sample(prompt_ids=[1], response_ids=[3, 4], weight_version=7).version_mask("7").tolist() == [1, 1]
