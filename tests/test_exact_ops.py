"""rollout.exact: each op's result for a row is the same bits whatever else is in the batch."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rollout import exact


def _rows_invariant(fn, x: torch.Tensor, sizes=(1, 2, 3, 31, 32, 33, 100, 517)) -> None:
    """fn over x[:M] (M in sizes) and over x shifted by 5 rows agrees with fn over each row alone."""
    alone = torch.cat([fn(x[i:i + 1]) for i in range(40)])
    for m in sizes:
        assert torch.equal(fn(x[:m])[:min(m, 40)], alone[:min(m, 40)]), m
    assert torch.equal(fn(x[5:300])[:35], alone[5:40])


def test_plain_cpu_matmul_is_not_batch_invariant_but_exact_linear_is():
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(600, 64, generator=g), torch.randn(96, 64, generator=g), torch.randn(96, generator=g)
    # the hazard the module exists for (if torch ever fixes it, this documents the change)
    differs = sum(not torch.equal((x[:m] @ w.T)[:1], x[:1] @ w.T) for m in range(2, 64))
    assert differs > 0
    _rows_invariant(lambda t: exact.linear(t, w, b), x)
    assert torch.allclose(exact.linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    # every row position inside a tile
    for n in (1, 2, 3, 7, 9):   # narrow outputs (a shared-expert gate has one) take other GEMM paths
        _rows_invariant(lambda t: exact.linear(t, w[:n]), x)
    tile = exact.linear(x[:exact.ROW_TILE], w)
    for i in range(exact.ROW_TILE):
        assert torch.equal(exact.linear(x[i:i + 1], w), tile[i:i + 1]), i


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_exact_linear_is_batch_invariant(dtype):
    """The CPU case above on CUDA: a row's exact.linear is the same bits in any batch size and at
    any row position of a tile (whatever cuBLAS does for plain matmul, not asserted here)."""
    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*shape, generator=g).to("cuda", dtype) for shape in ((600, 64), (96, 64), (96,)))
    _rows_invariant(lambda t: exact.linear(t, w, b), x)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-3   # NOTE: loose enough for TF32 in the reference
    assert torch.allclose(exact.linear(x, w, b).float(), F.linear(x, w, b).float(), rtol=tol, atol=tol)
    for n in (1, 2, 3, 7, 9):
        _rows_invariant(lambda t: exact.linear(t, w[:n]), x)
    tile = exact.linear(x[:exact.ROW_TILE], w)
    for i in range(exact.ROW_TILE):
        assert torch.equal(exact.linear(x[i:i + 1], w), tile[i:i + 1]), i


def test_grouped_linear_matches_per_group_rows():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(4, 70, 16, generator=g), torch.randn(4, 24, 16, generator=g)
    out = exact.grouped_linear(x, w)
    for grp in range(4):
        assert torch.equal(out[grp], exact.linear(x[grp], w[grp]))
        assert torch.allclose(out[grp], x[grp] @ w[grp].T, rtol=1e-5, atol=1e-5)


def test_pointwise_and_row_ops_do_not_depend_on_tensor_size():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6000, 48, generator=g) * 4
    w = torch.rand(48, generator=g) + 0.5
    for fn in (exact.silu, exact.sigmoid, exact.softmax, exact.log_softmax,
               lambda t: exact.rms_norm(t, w, 1e-6)):
        _rows_invariant(fn, x, sizes=(1, 3, 100, 6000))
    assert torch.allclose(exact.silu(x), F.silu(x), rtol=1e-6, atol=1e-6)
    assert torch.allclose(exact.sigmoid(x), torch.sigmoid(x), rtol=1e-6, atol=1e-7)
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    assert torch.allclose(exact.rms_norm(x, w, 1e-6), ref, rtol=1e-5, atol=1e-6)


def _sdpa_reference(q, k, v, mask, scale):
    return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask, scale=scale)


def test_attention_is_split_invariant_and_correct():
    g = torch.Generator().manual_seed(3)
    s, d = 150, 8
    q, k, v = (torch.randn(1, 2, s, d, generator=g) for _ in range(3))
    causal = torch.ones(s, s, dtype=torch.bool).tril()[None, None]
    full = exact.attention(q, k, v, causal, 0.3)
    ref = _sdpa_reference(q, k, v, causal, 0.3)
    assert torch.allclose(full.double(), ref, atol=1e-5)
    # decode: query at position p over keys [0, p] only (other lengths of the key grid, padded)
    for p in (0, 1, 63, 64, 65, 149):
        for width in (p + 1, p + 7, 200):
            kk = torch.zeros(1, 2, width, d)
            vv = torch.zeros(1, 2, width, d)
            kk[:, :, :p + 1], vv[:, :, :p + 1] = k[:, :, :p + 1], v[:, :, :p + 1]
            m = torch.zeros(1, 1, 1, width, dtype=torch.bool)
            m[..., :p + 1] = True
            assert torch.equal(exact.attention(q[:, :, p:p + 1], kk, vv, m, 0.3), full[:, :, p:p + 1]), (p, width)
    # chunked extend: queries [40, 150) over all keys, next to another request in the batch
    other = torch.randn(1, 2, s, d, generator=g)
    qb = torch.cat((q[:, :, 40:], other[:, :, :110]))
    kb, vb = torch.cat((k, other)), torch.cat((v, other))
    mb = causal[:, :, 40:].expand(2, 1, 110, s)
    assert torch.equal(exact.attention(qb, kb, vb, mb, 0.3)[:1], full[:, :, 40:])


def test_fused_experts_invariant_and_correct():
    g = torch.Generator().manual_seed(4)
    n, h, i, e, topk = 300, 16, 12, 6, 2
    x = torch.randn(n, h, generator=g)
    w13, w2 = torch.randn(e, 2 * i, h, generator=g), torch.randn(e, h, i, generator=g)
    weights = torch.rand(n, topk, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:topk] for _ in range(n)])

    def run(lo, hi):
        return exact.fused_experts(x[lo:hi], w13, w2, weights[lo:hi], ids[lo:hi])

    full = run(0, n)
    for lo, hi in ((0, 1), (7, 8), (0, 33), (100, 300)):
        assert torch.equal(run(lo, hi), full[lo:hi]), (lo, hi)
    ref = torch.zeros(n, h, dtype=torch.float64)
    for t in range(n):
        for j in range(topk):
            gate, up = (w13[ids[t, j]].double() @ x[t].double()).chunk(2)
            ref[t] += weights[t, j].double() * (w2[ids[t, j]].double() @ (F.silu(gate) * up))
    assert torch.allclose(full.double(), ref, atol=1e-4)
    # expert parallel: two shards' partial sums add up to the whole
    half = exact.fused_experts(x, w13[:3], w2[:3], weights, ids) + exact.fused_experts(x, w13[3:], w2[3:], weights, ids, 3)
    assert torch.allclose(half, full, atol=1e-5)
