"""gpt-oss's experts (biases, clamped SwiGLU) and routing (top-k, then softmax) in the torch ops.

The reference is transformers' own GptOssExperts / GptOssTopKRouter: a tiny module from a
GptOssConfig, run in float64, its weights copied into our layout (gate_up_proj [E, H, 2I] with gate
and up interleaved -> w13 [E, 2I, H] gate rows then up rows; down_proj [E, I, H] -> w2 [E, H, I]).
The batch-invariant rollout.exact.fused_experts keeps its invariants with biases: a row alone is the
same bits as in any batch, and the expert-parallel per-slot terms add up to the whole bitwise.
The Triton kernels are checked against the same reference in test_triton_moe.py and test_triton_exact.py.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Optional

import pytest
import torch
from transformers import GptOssConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts, GptOssTopKRouter

from rollout.exact import fused_experts, silu, sum_slots, swiglu
from rollout.models.moe.routing import softmax_topk
from rollout.models.moe.routing import topk_softmax

# NOTE: fp32 against a float64 reference: |diff| <= FP32_TOL * (1 + max |reference|)
FP32_TOL = 1e-5


@dataclass(frozen=True)
class GptOssCase:
    """A tiny GptOssExperts (float64) and the same weights in our layout (float32)."""

    hf: GptOssExperts
    w13: torch.Tensor        # [E, 2I, H]
    w2: torch.Tensor         # [E, H, I]
    b13: torch.Tensor        # [E, 2I]
    b2: torch.Tensor         # [E, H]
    limit: float
    alpha: float

    @property
    def kwargs(self) -> dict:
        return dict(b13=self.b13, b2=self.b2, swiglu_limit=self.limit, swiglu_alpha=self.alpha)

    def shard(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """The held experts [lo, hi): (w13, w2, kwargs with their biases)."""
        return self.w13[lo:hi], self.w2[lo:hi], dict(self.kwargs, b13=self.b13[lo:hi], b2=self.b2[lo:hi])

    def reference(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """HF's forward in float64 -> [N, H] float64."""
        with torch.no_grad():
            return self.hf(x.double(), topk_ids, topk_weights.double())

    def rounded(self, dtype: torch.dtype, device: str = "cpu") -> "GptOssCase":
        """Our-layout weights in dtype on device, and a reference on those same (rounded) values."""
        hf = copy.deepcopy(self.hf)
        with torch.no_grad():
            for p in hf.parameters():
                p.copy_(p.to(dtype).double())
        return GptOssCase(hf, *(t.to(device, dtype) for t in (self.w13, self.w2, self.b13, self.b2)),
                          self.limit, self.alpha)

    def gate_up(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W_gu + b_gu for every expert, float64 [E, N, 2I] (HF's interleaved order)."""
        hf = self.hf
        return torch.einsum("nh,ehi->eni", x.double(), hf.gate_up_proj.detach()) + hf.gate_up_proj_bias.detach()[:, None]


def gpt_oss_case(hidden: int, inter: int, experts: int, seed: int, limit: float = 7.0,
                 alpha: float = 1.702, scale: float = 1.0) -> GptOssCase:
    """Random weights and biases; scale > 1 pushes gate / up past the limit (the clamps engage)."""
    config = GptOssConfig(hidden_size=hidden, intermediate_size=inter, num_local_experts=experts,
                          num_experts_per_tok=2, swiglu_limit=limit, experts_implementation="eager")
    hf = GptOssExperts(config)
    hf.alpha = alpha
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        hf.gate_up_proj.copy_(torch.randn(experts, hidden, 2 * inter, generator=g) * scale / hidden ** 0.5)
        hf.gate_up_proj_bias.copy_(torch.randn(experts, 2 * inter, generator=g) * scale)
        hf.down_proj.copy_(torch.randn(experts, inter, hidden, generator=g) / inter ** 0.5)
        hf.down_proj_bias.copy_(torch.randn(experts, hidden, generator=g))
    hf = hf.double()
    gu, gub = hf.gate_up_proj.detach().float(), hf.gate_up_proj_bias.detach().float()
    w13 = torch.cat((gu[..., ::2], gu[..., 1::2]), dim=-1).transpose(1, 2).contiguous()       # [E, 2I, H]
    b13 = torch.cat((gub[:, ::2], gub[:, 1::2]), dim=-1).contiguous()                        # [E, 2I]
    w2 = hf.down_proj.detach().float().transpose(1, 2).contiguous()                           # [E, H, I]
    b2 = hf.down_proj_bias.detach().float().clone()                                           # [E, H]
    return GptOssCase(hf, w13, w2, b13, b2, limit, alpha)


def routed(n: int, hidden: int, experts: int, top_k: int, seed: int,
           device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [N, H] float32 and gpt-oss routing (top-k logits, softmax over them) of random logits."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, hidden, generator=g)
    w, ids = topk_softmax(torch.randn(n, experts, generator=g), top_k)
    return x.to(device), w.to(device), ids.to(device)


def assert_close_to(out: torch.Tensor, ref: torch.Tensor, tol: float = FP32_TOL) -> None:
    """out (fp32) against a float64 reference."""
    assert out.dtype == torch.float32 and out.shape == ref.shape, (out.dtype, out.shape, ref.shape)
    bound = tol * (1 + ref.abs().max().item())
    err = (out.double() - ref).abs().max().item()
    assert err <= bound, (err, bound)


def assert_clamps_engage(case: GptOssCase, x: torch.Tensor) -> None:
    """Some gate values above the limit and some up values outside [-limit, limit] (else the test
    would not tell a clamped SwiGLU from a plain one)."""
    gu = case.gate_up(x)
    assert (gu[..., ::2] > case.limit).any() and (gu[..., 1::2].abs() > case.limit).any()


# ---- the experts ----------------------------------------------------------------------------------

@pytest.mark.parametrize("n,hidden,inter,experts,top_k,limit,alpha,scale", [
    (1, 24, 16, 4, 2, 7.0, 1.702, 1.0),          # one token (one tile per expert)
    (9, 40, 20, 6, 3, 1.5, 1.702, 1.0),          # odd sizes, a small limit: the clamps engage
    (100, 32, 24, 4, 2, 7.0, 1.702, 6.0),        # experts past one ROW_TILE (per-tile weights and biases)
    (33, 48, 40, 8, 4, 2.0, 1.1, 2.0),           # another alpha
])
def test_fused_experts_match_hf_gpt_oss_experts(n, hidden, inter, experts, top_k, limit, alpha, scale):
    case = gpt_oss_case(hidden, inter, experts, seed=n, limit=limit, alpha=alpha, scale=scale)
    x, w, ids = routed(n, hidden, experts, top_k, seed=n + 1)
    if n > 1:
        assert_clamps_engage(case, x)
    ref = case.reference(x, w, ids)
    assert_close_to(fused_experts(x, case.w13, case.w2, w, ids, **case.kwargs), ref)
    terms = fused_experts(x, case.w13, case.w2, w, ids, per_slot=True, **case.kwargs)     # [N, K, H]
    assert torch.equal(sum_slots(terms), fused_experts(x, case.w13, case.w2, w, ids, **case.kwargs))


def test_the_reference_would_tell_each_part_missing():
    """Leaving out either bias or the clamp (or using the plain SwiGLU) is far outside the tolerance."""
    case = gpt_oss_case(32, 24, 4, seed=3, limit=1.5)
    x, w, ids = routed(20, 32, 4, 2, seed=4)
    ref = case.reference(x, w, ids)
    bound = 100 * FP32_TOL * (1 + ref.abs().max().item())
    for drop in (dict(b13=None), dict(b2=None), dict(swiglu_limit=1e9), dict(swiglu_limit=None)):
        out = fused_experts(x, case.w13, case.w2, w, ids, **dict(case.kwargs, **drop))
        assert (out.double() - ref).abs().max().item() > bound, drop


def test_swiglu_is_hf_apply_gate():
    """The activation alone against GptOssExperts._apply_gate on the interleaved [.., 2I] input."""
    case = gpt_oss_case(8, 16, 2, seed=0, limit=2.0, alpha=1.3)
    gu = torch.randn(50, 32, generator=torch.Generator().manual_seed(1)) * 4                # interleaved
    ref = case.hf._apply_gate(gu.double())
    out = swiglu(gu[:, ::2], gu[:, 1::2], limit=2.0, alpha=1.3)
    assert_close_to(out, ref, tol=1e-6)
    assert torch.equal(swiglu(gu[:, ::2], gu[:, 1::2]), silu(gu[:, ::2]) * gu[:, 1::2])       # limit None


@pytest.mark.parametrize("experts,total", [(6, 100), (3, 200)])   # 3 experts x 200 x 2: several tiles each
def test_a_row_is_the_same_bits_in_any_batch_with_biases(experts, total):
    case = gpt_oss_case(40, 24, experts, seed=experts, limit=2.0, scale=2.0)
    x, w, ids = routed(total, 40, experts, 2, seed=experts + 1)
    full = fused_experts(x, case.w13, case.w2, w, ids, **case.kwargs)
    for n in (1, 7, 33, total):
        for start in sorted({0, (total - n) // 2, total - n}):
            rows = slice(start, start + n)
            assert torch.equal(fused_experts(x[rows], case.w13, case.w2, w[rows], ids[rows], **case.kwargs),
                               full[rows]), (n, start)


@pytest.mark.parametrize("ranks", [2, 3])
def test_expert_parallel_per_slot_terms_add_up_to_the_whole_bitwise(ranks):
    experts = 6
    case = gpt_oss_case(32, 16, experts, seed=ranks, limit=1.5)
    x, w, ids = routed(45, 32, experts, 3, seed=ranks + 10)
    bounds = [experts * r // ranks for r in range(ranks + 1)]
    total = None
    for lo, hi in zip(bounds, bounds[1:]):
        w13, w2, kwargs = case.shard(lo, hi)
        part = fused_experts(x, w13, w2, w, ids, lo, per_slot=True, **kwargs)             # [N, K, H]
        total = part if total is None else total + part                                   # one nonzero term per slot
    assert torch.equal(sum_slots(total), fused_experts(x, case.w13, case.w2, w, ids, **case.kwargs))


def test_defaults_are_the_plain_swiglu_without_biases():
    """No new arguments: the same bits as naming the defaults, and as zero biases (x + 0 == x)."""
    case = gpt_oss_case(32, 16, 4, seed=5)
    x, w, ids = routed(40, 32, 4, 2, seed=6)
    plain = fused_experts(x, case.w13, case.w2, w, ids)
    assert torch.equal(plain, fused_experts(x, case.w13, case.w2, w, ids, b13=None, b2=None, swiglu_limit=None))
    zeros = fused_experts(x, case.w13, case.w2, w, ids, b13=torch.zeros_like(case.b13), b2=torch.zeros_like(case.b2))
    assert torch.equal(plain, zeros)
    gate, up = torch.einsum("nh,eih->eni", x, case.w13).chunk(2, dim=-1)                  # [E, N, I]
    y = torch.einsum("eni,ehi->enh", torch.nn.functional.silu(gate) * up, case.w2)          # [E, N, H]
    ref = sum(w[:, j, None] * y[ids[:, j], torch.arange(40)] for j in range(2))
    torch.testing.assert_close(plain, ref, atol=1e-5, rtol=1e-5)


# ---- the routing ----------------------------------------------------------------------------------

class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[Optional[int], torch.Tensor]] = []

    def record(self, layer_id: Optional[int], topk_ids: torch.Tensor) -> None:
        self.calls.append((layer_id, topk_ids.clone()))


@pytest.mark.parametrize("n,experts,top_k", [(50, 32, 4), (7, 6, 6), (20, 128, 8), (3, 5, 1)])
@pytest.mark.parametrize("exact", [False, True])
def test_topk_softmax_matches_hf_gpt_oss_router(n, experts, top_k, exact):
    config = GptOssConfig(hidden_size=24, intermediate_size=8, num_local_experts=experts, num_experts_per_tok=top_k)
    router = GptOssTopKRouter(config)
    g = torch.Generator().manual_seed(n * experts)
    with torch.no_grad():
        router.weight.copy_(torch.randn(experts, 24, generator=g))
        router.bias.copy_(torch.randn(experts, generator=g))
    x = torch.randn(n, 24, generator=g)
    with torch.no_grad():
        logits, scores, hf_ids = router(x)
    rec = Recorder()
    w, ids = topk_softmax(logits, top_k, capture=rec, layer_id=3, exact=exact)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32 and ids.shape == w.shape == (n, top_k)
    assert len(rec.calls) == 1 and rec.calls[0][0] == 3 and torch.equal(rec.calls[0][1], ids)
    kth = logits.sort(dim=-1, descending=True).values                                     # [N, E]
    no_tie = (kth[:, top_k - 1] != kth[:, top_k]) if top_k < experts else torch.ones(n, dtype=torch.bool)
    assert no_tie.float().mean() > 0.9
    for row in no_tie.nonzero().flatten().tolist():
        assert set(ids[row].tolist()) == set(hf_ids[row].tolist()), row
        mine = dict(zip(ids[row].tolist(), w[row].tolist()))
        theirs = dict(zip(hf_ids[row].tolist(), scores[row].tolist()))
        assert all(abs(mine[e] - theirs[e]) <= 1e-6 for e in mine), (mine, theirs)
    assert (w[:, :-1] >= w[:, 1:]).all()                                                  # order of preference
    torch.testing.assert_close(w.sum(-1), torch.ones(n), atol=1e-6, rtol=0)


def test_topk_softmax_ties_go_to_the_lower_id_and_bf16_logits():
    logits = torch.tensor([[0.5, 1.0, 1.0, 0.5, 1.0], [2.0, 2.0, 2.0, 2.0, 2.0], [0.0, 3.0, -1.0, 3.0, 3.0]])
    w, ids = topk_softmax(logits, 3)
    assert ids.tolist() == [[1, 2, 4], [0, 1, 2], [1, 3, 4]]
    torch.testing.assert_close(w, torch.full((3, 3), 1 / 3))
    w, ids = topk_softmax(logits, 4)
    assert ids.tolist() == [[1, 2, 4, 0], [0, 1, 2, 3], [1, 3, 4, 0]]
    lb = torch.randn(9, 12, generator=torch.Generator().manual_seed(0)).bfloat16()
    wb, ib = topk_softmax(lb, 3)
    wf, i_f = topk_softmax(lb.float(), 3)
    assert wb.dtype == torch.float32 and torch.equal(ib, i_f) and torch.equal(wb, wf)
    with pytest.raises(ValueError, match="top_k"):
        topk_softmax(logits, 6)


def test_topk_softmax_differs_from_softmax_topk_only_in_the_weights():
    """The same ids as softmax then top-k (softmax is monotone); the weights are softmax_topk's
    renormalised ones (mathematically equal, within fp32 rounding)."""
    logits = torch.randn(30, 16, generator=torch.Generator().manual_seed(2))
    w, ids = topk_softmax(logits, 4)
    w_ref, ids_ref = softmax_topk(logits, 4, renormalize=True)
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, atol=1e-6, rtol=1e-6)
