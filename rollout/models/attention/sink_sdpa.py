"""Attention with per-head sinks (gpt-oss) in torch: the default-mode torch path of a sink layer.

Query head h has a learned logit sinks[h] that joins its softmax denominator and contributes no
value, as transformers' gpt-oss eager_attention_forward computes it (a sink column concatenated to
the logits, the max over keys and sink subtracted, softmax, the column dropped):

    out = sum_s exp(l_s - m) v_s / (sum_s exp(l_s - m) + exp(sink - m)),  m = max(max_s l_s, sink)

Here without the concatenation (no copy of the logits): the row max takes the sink, and its
exp(sink - m) is added to the key sum. A row whose mask admits no key gets 0 (the sink takes all
its weight; HF's eager does the same under a -inf mask).

Dtypes: logits, softmax and the weighted sum are computed in fp32 and the output cast to q's
dtype. For fp32 inputs that is HF eager's computation. For bf16 / fp16 inputs HF eager computes
the logits and the softmax in the inputs' dtype (F.softmax(..., dtype=logits.dtype)) and
multiplies bf16 probabilities by bf16 values; this path rounds only its output, so it agrees with
HF eager to bf16 rounding, not bitwise (as SDPA and the Triton kernels, also fp32 inside).
"""
from __future__ import annotations

import torch


def sdpa_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
                    sinks: torch.Tensor) -> torch.Tensor:
    """q [B, H, E, D], k [B, kvH, S, D], v [B, kvH, S, Dv] (GQA as SDPA's enable_gqa: query head h
    reads kv head h // (H // kvH)), mask broadcastable to [B, 1 or H, E, S] (bool, True = attend;
    or additive float; None: every key), sinks [H] (any float dtype) -> [B, H, E, Dv] in q's dtype."""
    b, h, e, d = q.shape
    kvh, s = k.shape[1], k.shape[2]
    assert h % kvh == 0 and sinks.shape == (h,), (h, kvh, tuple(sinks.shape))
    grp = h // kvh
    # each kv head's query heads as rows: no copy of the keys per head
    rows = q.float().reshape(b, kvh, grp * e, d)
    logits = torch.matmul(rows, k.float().transpose(-1, -2)).mul_(scale).view(b, kvh, grp, e, s)
    if mask is not None:
        mask = _grouped(mask, h, kvh)                                            # [B|1, kvH|1, G|1, E|1, S]
        if mask.dtype == torch.bool:
            logits.masked_fill_(~mask, float("-inf"))
        else:
            logits.add_(mask.float())
    sink = sinks.float().view(1, kvh, grp, 1, 1)
    m = torch.maximum(logits.amax(-1, keepdim=True), sink)                      # [B, kvH, G, E, 1]
    # NOTE: m is -inf only for a row with no key and a -inf sink: shift by 0 there, and its 0 / 0 -> 0
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = logits.sub_(m).exp_()                                                    # [B, kvH, G, E, S]
    denom = p.sum(-1, keepdim=True) + torch.exp(sink - m)                       # [B, kvH, G, E, 1]
    denom = torch.where(denom == 0, torch.ones_like(denom), denom)
    dv = v.shape[-1]                                                             # NOTE: B may be 0
    out = torch.matmul(p.view(b, kvh, grp * e, s), v.float()).view(b, kvh, grp, e, dv) / denom
    return out.view(b, h, e, dv).to(q.dtype)


def _grouped(mask: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    """mask broadcastable to [B, 1 or H, E, S] -> a view [B|1, kvH|1, G|1, E|1, S]."""
    while mask.dim() < 4:
        mask = mask.unsqueeze(0)
    if mask.shape[1] == 1:
        return mask.unsqueeze(2)
    assert mask.shape[1] == heads, (tuple(mask.shape), heads)
    return mask.unflatten(1, (kv_heads, heads // kv_heads))
