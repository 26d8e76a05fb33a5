"""paged_kv_metadata (FlashInfer's paged layout, page size 1): its arrays, and the CPU reference
attention over them against PagedAttention's torch path, for plain steps and the cascade."""
import pytest
import torch

from attention_cases import attention_case, reference
from rollout.models.attention.paged_reference import paged_reference_attention
from rollout.batch.paged_kv_metadata import paged_kv_metadata

ATOL = 2e-5


def meta_of(fb, groups=()):
    return paged_kv_metadata(extend_lens=fb.extend_lens.tolist(), seq_lens=fb.seq_lens.tolist(),
                             kv_indices=fb.kv_indices, prefix_groups=groups)


def test_plain_step_arrays():
    _, _, fb, _ = attention_case([0, 24, 3], [9, 1, 4], seed=1)
    meta = meta_of(fb)
    assert not meta.is_cascade and meta.order is None and meta.causal
    (level,) = meta.levels
    assert level.qo_indptr.tolist() == [0, 9, 10, 14]
    assert level.kv_indptr.tolist() == [0, 9, 34, 41]
    assert level.kv_last_page_len.tolist() == [1, 1, 1]
    assert level.kv_indices.dtype == torch.int32 and level.max_qo_len == 9
    for b, n in enumerate([9, 25, 7]):
        lo = level.kv_indptr[b].item()
        assert level.kv_indices[lo:lo + n].tolist() == fb.kv_indices[b, :n].tolist()


def test_cascade_arrays_put_members_side_by_side():
    groups = [(20, (0, 3)), (12, (1, 4, 2))]
    _, _, fb, groups = attention_case([22, 15, 13, 21, 14, 6], [1] * 6, shared=groups, seed=2)
    meta = meta_of(fb, groups)
    assert meta.is_cascade and not meta.causal
    prefix, own = meta.levels
    assert meta.order.tolist() == [0, 3, 1, 4, 2, 5]          # request 5 is a group of its own
    assert prefix.qo_indptr.tolist() == [0, 2, 5, 6]
    assert prefix.kv_indptr.tolist() == [0, 20, 32, 33]        # its "prefix": its first key
    assert prefix.kv_indices[:20].tolist() == fb.kv_indices[0, :20].tolist()
    assert own.qo_indptr.tolist() == list(range(7))
    seq = fb.seq_lens.tolist()
    assert own.kv_indptr.diff().tolist() == [seq[0] - 20, seq[3] - 20, seq[1] - 12, seq[4] - 12, seq[2] - 12,
                                             seq[5] - 1]
    assert own.kv_last_page_len.tolist() == [1] * 6


def test_groups_ignored_outside_decode_and_for_single_members():
    _, _, fb, _ = attention_case([10, 10], [3, 1], seed=3)
    assert not meta_of(fb, [(5, (0, 1))]).is_cascade
    _, _, fb, _ = attention_case([10, 10], [1, 1], seed=3)
    assert not meta_of(fb, [(5, (0,))]).is_cascade


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 2)])
@pytest.mark.parametrize("prefix,extend", [([0, 24, 45, 3], [9, 7, 1, 1]), ([5, 1, 40], [1, 1, 1])])
def test_reference_over_metadata_matches_torch(heads, kv_heads, prefix, extend):
    layer, q, fb, _ = attention_case(prefix, extend, heads=heads, kv_heads=kv_heads, seed=4)
    out = paged_reference_attention(q, fb.kv_pool.kv_buffers[0], meta_of(fb), scale=layer.scale)
    torch.testing.assert_close(out, reference(layer, q, fb), atol=ATOL, rtol=0)


@pytest.mark.parametrize("window", [1, 6])
def test_reference_over_metadata_sliding_window(window):
    layer, q, fb, _ = attention_case([0, 13, 30], [12, 6, 1], window=window, seed=5)
    out = paged_reference_attention(q, fb.kv_pool.kv_buffers[0], meta_of(fb), scale=layer.scale, window=window)
    torch.testing.assert_close(out, reference(layer, q, fb), atol=ATOL, rtol=0)


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 4)])
def test_reference_over_cascade_matches_torch(heads, kv_heads):
    groups = [(40, (0, 2, 4)), (17, (1, 3))]
    own = [3, 1, 8, 2, 5]
    prefix = [40 + own[0], 17 + own[1], 40 + own[2], 17 + own[3], 40 + own[4], 29]
    layer, q, fb, groups = attention_case(prefix, [1] * 6, heads=heads, kv_heads=kv_heads, shared=groups, seed=6)
    meta = meta_of(fb, groups)
    out = paged_reference_attention(q, fb.kv_pool.kv_buffers[0], meta, scale=layer.scale)
    torch.testing.assert_close(out, reference(layer, q, fb), atol=ATOL, rtol=0)


@pytest.mark.parametrize("heads,kv_heads,extend", [(4, 2, [37]), (4, 4, [20, 20, 20]), (6, 2, [300])])
def test_whole_prompts_take_sdpa_causal_with_the_masked_bits(monkeypatch, heads, kv_heads, extend):
    """Prompts with no prefix and no padding (queries = keys): the torch path asks SDPA for its own
    causal masking (is_causal: the blocks above the diagonal are skipped) instead of a mask, with the
    same bits as the masked grid, and the reference over the metadata agrees."""
    import torch.nn.functional as F

    from rollout.models.attention import paged

    layer, q, fb, _ = attention_case([0] * len(extend), extend, heads=heads, kv_heads=kv_heads, seed=7)
    causal = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(paged.F, "scaled_dot_product_attention",
                        lambda *a, **kw: causal.append(kw.get("is_causal", False)) or sdpa(*a, **kw))
    got = reference(layer, q, fb)
    assert causal == [True]
    bsz, width = len(extend), extend[0]
    masked = layer._grid(q, fb.kv_indices.reshape(-1), bsz, width, width, None,
                         fb.grid_mask(0, bsz, width, width, keep=True), fb.kv_pool)
    assert causal == [True, False] and torch.equal(got, masked)
    out = paged_reference_attention(q, fb.kv_pool.kv_buffers[0], meta_of(fb), scale=layer.scale)
    torch.testing.assert_close(out, got, atol=ATOL, rtol=0)
