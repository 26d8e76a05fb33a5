"""Triton paged attention kernels (decode, extend, cascade, merge) against PagedAttention's torch
path, under the Triton interpreter on CPU (tests/conftest.py sets TRITON_INTERPRET=1 there).

Tolerance: fp32 inputs, fp32 math in the kernels; outputs agree with torch's SDPA to 2e-5
(different summation order of the same softmax)."""
import pytest
import torch

pytest.importorskip("triton")

from attention_cases import attention_case, reference  # noqa: E402
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
