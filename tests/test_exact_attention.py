"""rollout.exact.attention: a query's bits depend only on its own row and the keys it may see
(and its sink), whatever the grid around it (rows sharing its tile, extra masked key tiles, heads
as rows). With sinks: close to transformers' gpt-oss eager attention in float64."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attention_cases import hf_sink_attention
from rollout import exact
from rollout.exact.attention import tree_sum


def _causal_full(q, k, v, scale, sinks=None):
    s = q.shape[2]
    causal = torch.ones(s, s, dtype=torch.bool).tril()[None, None]
    return exact.attention(q, k, v, causal, scale, sinks)


def _head_sinks(heads: int, seed: int) -> torch.Tensor:
    """[H] sink logits around the scores' range: one dominating, one negligible."""
    sinks = torch.randn(heads, generator=torch.Generator().manual_seed(seed)) * 2
    sinks[0], sinks[-1] = 6.0, -30.0
    return sinks


def test_tree_sum_ignores_appended_zeros():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 13, 5, generator=g) * 100
    base = tree_sum(x, 1)
    assert base.shape == (3, 1, 5)
    assert torch.allclose(base.double(), x.double().sum(1, keepdim=True), atol=1e-3)
    for extra in (1, 2, 3, 19, 51):
        padded = torch.cat((x, torch.zeros(3, extra, 5)), 1)
        assert torch.equal(tree_sum(padded, 1), base), extra
    assert torch.equal(tree_sum(x[:, :1], 1), x[:, :1])


@pytest.mark.parametrize("with_sinks", [False, True])
def test_decode_row_equals_its_row_in_a_full_sequence_at_many_lengths(with_sinks):
    """GQA as the engine runs it (each kv head's query heads as rows) against the trainer's form
    (keys repeated per head, one row per token), at lengths across tile edges and grid widths
    with more (masked) key tiles than the query sees, odd and even tile counts; with sinks too
    (per head in the trainer's form, per row in the engine's)."""
    g = torch.Generator().manual_seed(1)
    heads, kvh, d, s = 4, 2, 16, 300
    grp = heads // kvh
    q = torch.randn(1, heads, s, d, generator=g)
    k, v = torch.randn(1, kvh, s, d, generator=g), torch.randn(1, kvh, s, d, generator=g)
    sinks = _head_sinks(heads, 1) if with_sinks else None
    full = _causal_full(q, k.repeat_interleave(grp, 1), v.repeat_interleave(grp, 1), 0.25,
                        None if sinks is None else sinks.view(1, heads, 1))           # [1, H, S, D]
    if sinks is None:
        ref = F.scaled_dot_product_attention(q.double(), k.double().repeat_interleave(grp, 1),
                                             v.double().repeat_interleave(grp, 1), is_causal=True, scale=0.25)
    else:
        ref = hf_sink_attention(q, k, v, torch.ones(s, s, dtype=torch.bool).tril()[None, None], 0.25, sinks)
    assert torch.allclose(full.double(), ref, atol=1e-5)
    row_sinks = None if sinks is None else sinks.view(1, kvh, grp)
    for p in (0, 1, 2, 3, 4, 5, 63, 64, 65, 127, 128, 191, 255, 256, 299):
        for width in (p + 1, p + 64, 64 * 5, 64 * 9):
            kk, vv = torch.zeros(1, kvh, width, d), torch.zeros(1, kvh, width, d)
            seen = min(p + 1, width)
            kk[:, :, :seen], vv[:, :, :seen] = k[:, :, :seen], v[:, :, :seen]
            mask = torch.zeros(1, 1, grp, width, dtype=torch.bool)
            mask[..., :p + 1] = True
            rows = q[:, :, p].reshape(1, kvh, grp, d)                           # heads of kv head j as rows
            out = exact.attention(rows, kk, vv, mask, 0.25, row_sinks).reshape(1, heads, d)
            assert torch.equal(out, full[:, :, p]), (p, width)


@pytest.mark.parametrize("with_sinks", [False, True])
def test_rows_do_not_depend_on_their_tile_neighbours_or_batch(with_sinks):
    """With sinks: one per row ([B, G, R]), a row alone takes its own."""
    g = torch.Generator().manual_seed(2)
    b, heads, r, s, d = 3, 2, 11, 90, 8
    q = torch.randn(b, heads, r, d, generator=g)
    k, v = torch.randn(b, heads, s, d, generator=g), torch.randn(b, heads, s, 12, generator=g)
    sinks = torch.randn(b, heads, r, generator=g) * 2 if with_sinks else None
    lens = torch.tensor([90, 40, 7])
    mask = (torch.arange(s)[None, None, None, :] < lens[:, None, None, None]).expand(b, 1, r, s).clone()
    mask[1, 0, 3] = False                                                       # a row that sees nothing
    out = exact.attention(q, k, v, mask, 0.5, sinks)
    assert out.shape == (b, heads, r, 12)
    assert torch.equal(out[1, :, 3], torch.zeros(heads, 12))
    for i in range(b):
        for j in (0, 2, 10):
            alone = exact.attention(q[i:i + 1, :, j:j + 1], k[i:i + 1, :, :lens[i]], v[i:i + 1, :, :lens[i]],
                                    mask[i:i + 1, :, j:j + 1, :lens[i]], 0.5,
                                    None if sinks is None else sinks[i:i + 1, :, j:j + 1])
            assert torch.equal(alone[0, :, 0], out[i, :, j]), (i, j)


def test_attention_gradients_match_float64():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, 70, 8, generator=g, requires_grad=True) for _ in range(3))
    causal = torch.ones(70, 70, dtype=torch.bool).tril()[None, None]
    up = torch.randn(2, 2, 70, 8, generator=g)
    grads = torch.autograd.grad((exact.attention(q, k, v, causal, 0.3) * up).sum(), (q, k, v))
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = torch.autograd.grad((F.scaled_dot_product_attention(q64, k64, v64, is_causal=True, scale=0.3)
                               * up.double()).sum(), (q64, k64, v64))
    for got, want in zip(grads, ref):
        assert torch.allclose(got.double(), want, atol=1e-4)


@pytest.mark.parametrize("window", [None, 5, 70])
def test_sinks_match_hf_eager_as_the_engine_lays_out_rows(window):
    """The engine's extend grid (each kv head's (token, head) pairs as rows, keys not repeated,
    sinks mapped to rows) over a cached prefix, with gpt-oss's sliding window, against HF's eager
    attention in float64; a -inf sink is no sink, bitwise."""
    g = torch.Generator().manual_seed(4)
    heads, kvh, d, prefix, ext = 6, 2, 16, 83, 21
    grp, s = heads // kvh, prefix + ext
    q = torch.randn(1, heads, ext, d, generator=g)
    k, v = torch.randn(1, kvh, s, d, generator=g), torch.randn(1, kvh, s, d, generator=g)
    sinks = _head_sinks(heads, 4)
    q_pos, key_pos = torch.arange(prefix, s)[:, None], torch.arange(s)[None, :]
    see = (key_pos <= q_pos) & (key_pos > q_pos - (window or s))                 # [E, S]
    rows = q.view(1, kvh, grp, ext, d).transpose(2, 3).reshape(1, kvh, ext * grp, d)
    row_mask = see[:, None].expand(ext, grp, s).reshape(1, 1, ext * grp, s)
    row_sinks = sinks.view(kvh, 1, grp).expand(kvh, ext, grp).reshape(1, kvh, ext * grp)
    out = exact.attention(rows, k, v, row_mask, 0.3, row_sinks)                  # [1, kvH, E*G, D]
    out = out.view(1, kvh, ext, grp, d).transpose(2, 3).reshape(1, heads, ext, d)
    ref = hf_sink_attention(q, k, v, see[None, None], 0.3, sinks)
    assert (out.double() - ref).abs().max().item() <= 1e-5
    assert not torch.allclose(out, exact.attention(rows, k, v, row_mask, 0.3).view(1, kvh, ext, grp, d)
                              .transpose(2, 3).reshape(1, heads, ext, d), atol=1e-3)
    none = torch.full((1, kvh, ext * grp), float("-inf"))
    assert torch.equal(exact.attention(rows, k, v, row_mask, 0.3, none), exact.attention(rows, k, v, row_mask, 0.3))


def test_attention_gradients_with_sinks_match_hf_float64():
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 4, 70, 8, generator=g, requires_grad=True) for _ in range(3))
    sinks = (torch.randn(4, generator=g) * 2).requires_grad_()
    causal = torch.ones(70, 70, dtype=torch.bool).tril()[None, None]
    up = torch.randn(2, 4, 70, 8, generator=g)
    grads = torch.autograd.grad((exact.attention(q, k, v, causal, 0.3, sinks.view(1, 4, 1)) * up).sum(),
                                (q, k, v, sinks))
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, sinks)]
    ref = torch.autograd.grad((hf_sink_attention(*leaves[:3], causal, 0.3, leaves[3]) * up.double()).sum(), leaves)
    for got, want in zip(grads, ref):
        assert torch.allclose(got.double(), want, atol=1e-4)


def test_sinks_on_an_empty_batch():
    """A DP rank's static runner may attend over no request at all (B = 0), sinks included."""
    from rollout.exact.attention import attention as exact_attention

    q, k = torch.zeros(0, 2, 5, 8), torch.zeros(0, 2, 7, 8)
    out = exact_attention(q, k, k, torch.ones(0, 1, 5, 7, dtype=torch.bool), 0.3, sinks=torch.zeros(1, 2, 1))
    assert out.shape == (0, 2, 5, 8)
    from rollout.models.attention.sink_sdpa import sdpa_with_sinks                  # the default mode's path

    kv = torch.zeros(0, 2, 2, 8)
    assert sdpa_with_sinks(torch.zeros(0, 4, 3, 8), kv, kv, None, 0.3, torch.zeros(4)).shape == (0, 4, 3, 8)
