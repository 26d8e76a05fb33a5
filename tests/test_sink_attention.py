"""rollout.models.attention.sink_sdpa.sdpa_with_sinks against transformers' gpt-oss eager attention
itself (eager_attention_forward with a stub module holding sinks and num_key_value_groups): fp32
to 1e-5 of HF in float64 and to 1e-5 of HF run in fp32, bf16 to bf16 rounding; GQA, sliding
windows, masks per head, rows with no key; and without sinks' weight it is SDPA."""
import pytest
import torch
import torch.nn.functional as F

from attention_cases import hf_sink_attention
from rollout.models.attention.sink_sdpa import sdpa_with_sinks


def _case(seed, b=2, heads=6, kvh=2, e=9, s=40, d=16, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, heads, e, d, generator=g)
    k, v = torch.randn(b, kvh, s, d, generator=g), torch.randn(b, kvh, s, d, generator=g)
    sinks = torch.randn(heads, generator=g) * 2
    sinks[0], sinks[-1] = 6.0, -30.0
    return q.to(dtype), k.to(dtype), v.to(dtype), sinks


def _causal(e, s, window=None):
    """[1, 1, E, S]: the last E of S positions, causal, keys > q_pos - window."""
    q_pos, key_pos = torch.arange(s - e, s)[:, None], torch.arange(s)[None, :]
    return ((key_pos <= q_pos) & (key_pos > q_pos - (window or s)))[None, None]


@pytest.mark.parametrize("heads,kvh", [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("window", [None, 7])
def test_matches_hf_eager(heads, kvh, window):
    q, k, v, sinks = _case(heads + (window or 0), heads=heads, kvh=kvh)
    mask = _causal(9, 40, window)
    out = sdpa_with_sinks(q, k, v, mask, 0.25, sinks)
    assert out.shape == q.shape and out.dtype == torch.float32
    assert (out.double() - hf_sink_attention(q, k, v, mask, 0.25, sinks)).abs().max().item() <= 1e-5
    assert (out - hf_sink_attention(q, k, v, mask, 0.25, sinks, torch.float32)).abs().max().item() <= 1e-5


def test_mask_per_head_per_request_and_rows_with_no_key():
    """A bool mask [B, H, E, S] (each head its own), an additive float mask of the same cells, and
    rows that see no key: 0 (the sink takes all the weight, as in HF under a -inf mask)."""
    q, k, v, sinks = _case(3)
    g = torch.Generator().manual_seed(3)
    mask = torch.rand(2, 6, 9, 40, generator=g) > 0.5
    mask[1, 4, 2] = False
    mask[0, :, 5] = False
    out = sdpa_with_sinks(q, k, v, mask, 0.3, sinks)
    assert torch.equal(out[1, 4, 2], torch.zeros(16)) and torch.equal(out[0, :, 5], torch.zeros(6, 16))
    assert (out.double() - hf_sink_attention(q, k, v, mask, 0.3, sinks)).abs().max().item() <= 1e-5
    additive = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
    assert torch.equal(sdpa_with_sinks(q, k, v, additive, 0.3, sinks), out)


def test_bf16_agrees_with_hf_to_bf16_rounding():
    """bf16 in, bf16 out, fp32 inside: closer to HF in float64 than HF's own bf16 eager is."""
    q, k, v, sinks = _case(5, dtype=torch.bfloat16)
    mask = _causal(9, 40, 11)
    out = sdpa_with_sinks(q, k, v, mask, 0.25, sinks)
    assert out.dtype == torch.bfloat16
    ref = hf_sink_attention(q, k, v, mask, 0.25, sinks)
    err = (out.double() - ref).abs().max().item()
    hf_err = (hf_sink_attention(q, k, v, mask, 0.25, sinks, torch.bfloat16).double() - ref).abs().max().item()
    assert err <= 1e-2 and err <= hf_err, (err, hf_err)


def test_no_mask_and_negligible_sinks_is_sdpa():
    q, k, v, _ = _case(6)
    out = sdpa_with_sinks(q, k, v, None, 0.25, torch.full((6,), -1e4))
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, scale=0.25, enable_gqa=True),
                               atol=1e-6, rtol=0)
