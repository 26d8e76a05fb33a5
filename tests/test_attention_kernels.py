"""Triton paged attention kernels (decode, extend, cascade, merge) against PagedAttention's torch
path, under the Triton interpreter on CPU (tests/conftest.py sets TRITON_INTERPRET=1 there).

Tolerance: fp32 inputs, fp32 math in the kernels; outputs agree with torch's SDPA to 2e-5
(different summation order of the same softmax).

Attention sinks (gpt-oss: one logit per query head in the softmax denominator, no value): the
kernels against transformers' gpt-oss eager attention itself in float64 (attention_cases.
sink_reference), with windows, GQA, decode splits, prefixes and the cascade."""
import pytest
import torch

pytest.importorskip("triton")

from attention_cases import attention_case, reference, sink_reference  # noqa: E402
from rollout.models.kernels.cascade_attention import cascade_decode_attention  # noqa: E402
from rollout.models.kernels.decode_attention import decode_attention  # noqa: E402
from rollout.models.kernels.extend_attention import extend_attention  # noqa: E402
from rollout.models.kernels.merge_attention import merge_attention_states  # noqa: E402
from rollout.batch.paged_kv_metadata import paged_kv_metadata  # noqa: E402

ATOL = 2e-5
HEADS = [(4, 4), (4, 2), (6, 2), (8, 1)]          # (query heads, kv heads): MHA, GQA 2, 3 (not a power of 2), 8


def merge_attention_states_torch(out_part: torch.Tensor, lse_part: torch.Tensor) -> torch.Tensor:
    """The torch reference of merge_attention_states: [B, H, P, D], [B, H, P] -> fp32 [B, H, D]."""
    top = lse_part.amax(-1, keepdim=True)
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    w = torch.exp(lse_part - top)
    return (out_part * w[..., None]).sum(-2) / w.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)


def run_decode(layer, q, fb, splits):
    window = layer.sliding_window
    return decode_attention(q, fb.kv_pool.kv_buffers[0], fb.kv_indices, fb.seq_lens, scale=layer.scale,
                            window=window, num_splits=splits)


def run_extend(layer, q, fb):
    return extend_attention(q, fb.kv_pool.kv_buffers[0], fb.kv_indices, fb.extend_lens, fb.seq_lens,
                            max_extend=fb.max_extend, scale=layer.scale, window=layer.sliding_window)


@pytest.mark.parametrize("heads,kv_heads", HEADS)
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_kernel_matches_torch(heads, kv_heads, splits):
    # contexts of 1 key (a split with nothing to do), 2, one block, several blocks
    layer, q, fb, _ = attention_case([0, 1, 31, 70, 5], [1] * 5, heads=heads, kv_heads=kv_heads, seed=heads + splits)
    out = run_decode(layer, q, fb, splits)
    assert out.shape == (5, heads * 32) and out.dtype == torch.float32
    torch.testing.assert_close(out, reference(layer, q, fb), atol=ATOL, rtol=0)


def test_decode_kernel_one_request_and_empty_batch():
    layer, q, fb, _ = attention_case([40], [1], seed=3)
    torch.testing.assert_close(run_decode(layer, q, fb, 4), reference(layer, q, fb), atol=ATOL, rtol=0)
    kv = fb.kv_pool.kv_buffers[0]
    empty = decode_attention(q[:0], kv, fb.kv_indices[:0], fb.seq_lens[:0], scale=layer.scale, num_splits=2)
    assert empty.shape == (0, 4 * 32)


@pytest.mark.parametrize("window", [1, 4, 50])
def test_decode_kernel_sliding_window(window):
    layer, q, fb, _ = attention_case([2, 9, 60], [1] * 3, window=window, seed=window)
    torch.testing.assert_close(run_decode(layer, q, fb, 2), reference(layer, q, fb), atol=ATOL, rtol=0)


@pytest.mark.parametrize("heads,kv_heads", HEADS)
def test_extend_kernel_matches_torch(heads, kv_heads):
    # whole prompts, a chunk over a cached prefix, one new token over a long prefix (GRPO sample),
    # a prompt of one token, and a request longer than one query block
    prefix, extend = [0, 24, 45, 0, 3], [9, 7, 1, 1, 37]
    layer, q, fb, _ = attention_case(prefix, extend, heads=heads, kv_heads=kv_heads, seed=heads)
    out = run_extend(layer, q, fb)
    assert out.shape == (sum(extend), heads * 32)
    torch.testing.assert_close(out, reference(layer, q, fb), atol=ATOL, rtol=0)


def test_extend_kernel_one_token_and_empty_batch():
    layer, q, fb, _ = attention_case([0], [2], seed=5)
    torch.testing.assert_close(run_extend(layer, q, fb), reference(layer, q, fb), atol=ATOL, rtol=0)
    kv = fb.kv_pool.kv_buffers[0]
    none = torch.zeros(0, dtype=torch.int64)
    empty = extend_attention(q[:0], kv, fb.kv_indices[:0], none, none, max_extend=1, scale=layer.scale)
    assert empty.shape == (0, 4 * 32)


@pytest.mark.parametrize("window", [1, 5, 20])
def test_extend_kernel_sliding_window(window):
    layer, q, fb, _ = attention_case([0, 13, 30], [21, 6, 2], window=window, seed=window)
    torch.testing.assert_close(run_extend(layer, q, fb), reference(layer, q, fb), atol=ATOL, rtol=0)


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (6, 2), (4, 4)])
def test_cascade_kernel_matches_torch(heads, kv_heads):
    """Two GRPO groups with prompts of different lengths (40 and 17 shared slots), members with
    continuations of different lengths, and two requests in no group."""
    own = [3, 1, 8, 2, 5, 1, 4]
    prefix = [40 + own[0], 17 + own[1], 40 + own[2], 17 + own[3], 40 + own[4], 29, 6]
    groups = [(40, (0, 2, 4)), (17, (1, 3))]
    layer, q, fb, groups = attention_case(prefix, [1] * 7, heads=heads, kv_heads=kv_heads, shared=groups, seed=11)
    meta = paged_kv_metadata(extend_lens=[1] * 7, seq_lens=fb.seq_lens.tolist(), kv_indices=fb.kv_indices,
                             prefix_groups=groups)
    assert meta.is_cascade
    for splits in (1, 2):
        out = cascade_decode_attention(q, fb.kv_pool.kv_buffers[0], meta, scale=layer.scale, num_splits=splits)
        torch.testing.assert_close(out, reference(layer, q, fb), atol=ATOL, rtol=0)


def test_merge_kernel_matches_torch_and_ignores_empty_parts():
    g = torch.Generator().manual_seed(2)
    out_part = torch.randn(3, 4, 5, 32, generator=g)
    lse_part = torch.randn(3, 4, 5, generator=g) * 4
    lse_part[0, :, 1:] = float("-inf")          # request 0: only part 0 has keys
    lse_part[1, 2, ::2] = float("-inf")
    merged = merge_attention_states(out_part, lse_part, torch.empty(3, 4, 32))
    torch.testing.assert_close(merged, merge_attention_states_torch(out_part, lse_part), atol=1e-6, rtol=0)
    torch.testing.assert_close(merged[0], out_part[0, :, 0], atol=1e-6, rtol=0)


def test_decode_kernel_is_batch_invariant():
    """A request's keys are split by its own length only: its output is bitwise the same alone
    and in any batch (as eager steps and CUDA graph buckets need)."""
    layer, q, fb, _ = attention_case([5, 40, 70], [1] * 3, seed=9)
    kv = fb.kv_pool.kv_buffers[0]
    batch = decode_attention(q, kv, fb.kv_indices, fb.seq_lens, scale=layer.scale, num_splits=3)
    alone = decode_attention(q[1:2], kv, fb.kv_indices[1:2, :41], fb.seq_lens[1:2], scale=layer.scale, num_splits=3)
    assert torch.equal(batch[1:2], alone)


def head_sinks(heads: int, seed: int) -> torch.Tensor:
    """fp32 [H] sink logits around the scores' range (~N(0, 1) here): one head's sink dominating
    its keys, one negligible, the rest comparable."""
    sinks = torch.randn(heads, generator=torch.Generator().manual_seed(seed)) * 2
    sinks[0], sinks[-1] = 6.0, -30.0
    return sinks


def close_to(out: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(out.double(), ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("heads,kv_heads", HEADS)
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("window", [None, 4])
def test_decode_kernel_with_sinks_matches_hf(heads, kv_heads, splits, window):
    layer, q, fb, _ = attention_case([0, 1, 31, 70, 5], [1] * 5, heads=heads, kv_heads=kv_heads, seed=heads + splits)
    sinks = head_sinks(heads, splits)
    out = decode_attention(q, fb.kv_pool.kv_buffers[0], fb.kv_indices, fb.seq_lens, scale=layer.scale, window=window,
                           num_splits=splits, sinks=sinks)
    close_to(out, sink_reference(q, fb, layer.scale, sinks, window))


@pytest.mark.parametrize("splits", [1, 3])
def test_decode_kernel_with_sinks_a_request_with_no_key_gets_zero(splits):
    layer, q, fb, _ = attention_case([40, 7, 20], [1] * 3, seed=4)
    sinks = head_sinks(4, 4)
    lens = fb.seq_lens.clone()
    lens[1] = 0
    out = decode_attention(q, fb.kv_pool.kv_buffers[0], fb.kv_indices, lens, scale=layer.scale, num_splits=splits,
                           sinks=sinks)
    assert torch.equal(out[1], torch.zeros(4 * 32))
    close_to(out, sink_reference(q, fb, layer.scale, sinks, seq_lens=lens))


@pytest.mark.parametrize("heads,kv_heads", HEADS)
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("exact", [False, True])
def test_extend_kernel_with_sinks_matches_hf(heads, kv_heads, window, exact):
    prefix, extend = [0, 24, 45, 0, 3], [9, 7, 1, 1, 37]
    layer, q, fb, _ = attention_case(prefix, extend, heads=heads, kv_heads=kv_heads, seed=heads)
    sinks = head_sinks(heads, heads)
    out = extend_attention(q, fb.kv_pool.kv_buffers[0], fb.kv_indices, fb.extend_lens, fb.seq_lens,
                           max_extend=fb.max_extend, scale=layer.scale, window=window, exact=exact, sinks=sinks)
    close_to(out, sink_reference(q, fb, layer.scale, sinks, window))


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (6, 2)])
def test_cascade_kernel_with_sinks_matches_hf(heads, kv_heads):
    """The sink is counted once: in each request's level-1 split 0, also for a member whose own
    keys are one (its decode token) and with several splits."""
    own = [3, 1, 8, 2, 5, 1, 4]
    prefix = [40 + own[0], 17 + own[1], 40 + own[2], 17 + own[3], 40 + own[4], 29, 6]
    groups = [(40, (0, 2, 4)), (17, (1, 3))]
    layer, q, fb, groups = attention_case(prefix, [1] * 7, heads=heads, kv_heads=kv_heads, shared=groups, seed=12)
    meta = paged_kv_metadata(extend_lens=[1] * 7, seq_lens=fb.seq_lens.tolist(), kv_indices=fb.kv_indices,
                             prefix_groups=groups)
    sinks = head_sinks(heads, 12)
    ref = sink_reference(q, fb, layer.scale, sinks)
    for splits in (1, 3):
        close_to(cascade_decode_attention(q, fb.kv_pool.kv_buffers[0], meta, scale=layer.scale, num_splits=splits,
                                          sinks=sinks), ref)


def test_minus_inf_sinks_are_no_sinks_bitwise():
    """A -inf sink starts a row from the empty state: the kernels' bits are those without sinks."""
    layer, q, fb, _ = attention_case([0, 24, 45, 3], [9, 7, 1, 37], heads=6, kv_heads=2, seed=7)
    kv, none = fb.kv_pool.kv_buffers[0], torch.full((6,), float("-inf"))
    for exact in (False, True):
        args = (q, kv, fb.kv_indices, fb.extend_lens, fb.seq_lens)
        kw = dict(max_extend=fb.max_extend, scale=layer.scale, window=20, exact=exact)
        assert torch.equal(extend_attention(*args, **kw, sinks=none), extend_attention(*args, **kw)), exact
    layer, q, fb, _ = attention_case([0, 31, 70], [1] * 3, heads=6, kv_heads=2, seed=8)
    args = (q, fb.kv_pool.kv_buffers[0], fb.kv_indices, fb.seq_lens)
    assert torch.equal(decode_attention(*args, scale=layer.scale, num_splits=3, sinks=none),
                       decode_attention(*args, scale=layer.scale, num_splits=3))


@pytest.mark.parametrize("window", [None, 40])
def test_exact_extend_kernel_with_sinks_is_batch_invariant(window):
    """exact=True with sinks: a query's bits are the same in the whole prompt, decoded alone over
    its prefix, in a chunk of a chunked prefill and next to other requests (rows of other heads'
    sinks around it); and close to HF's eager attention."""
    heads, kv_heads = 4, 2
    prefix, extend = [0, 0, 0], [150, 70, 9]
    layer, q, fb, _ = attention_case(prefix, extend, heads=heads, kv_heads=kv_heads, seed=21)
    kv, sinks = fb.kv_pool.kv_buffers[0], head_sinks(heads, 21)
    table = fb.kv_indices

    def attend(rows, queries, starts):
        ext = torch.tensor([x.shape[0] for x in queries])
        seq = torch.tensor(starts) + ext
        return extend_attention(torch.cat(queries), kv, table[rows], ext, seq, max_extend=int(ext.max()),
                                scale=layer.scale, window=window, exact=True, sinks=sinks)

    mine, others = q[:150], (q[150:220], q[220:])
    whole = attend([0], [mine], [0])                                                # [150, H*D]
    close_to(whole, sink_reference(q, fb, layer.scale, sinks, window)[:150])
    for p in (0, 31, 32, 63, 64, 100, 149):
        assert torch.equal(attend([0], [mine[p:p + 1]], [p]), whole[p:p + 1]), p
    assert torch.equal(attend([0], [mine[30:50]], [30]), whole[30:50])
    batch = attend([1, 0, 2], [others[0][60:], mine[90:], others[1]], [60, 90, 0])
    assert torch.equal(batch[10:70], whole[90:])
