"""Router kernel (Triton): router logits -> (top-k weights, top-k expert ids), one launch per layer.

The same rules as softmax_topk (rollout/models/moe/) and grouped_sigmoid_topk (moe/routing.py), which
stay the reference:
- softmax_topk_triton: fp32 softmax -> top-k -> optional renormalisation (Qwen2/3-MoE, Mixtral, OLMoE);
- topk_softmax_triton: top-k of the logits -> fp32 softmax over those k (gpt-oss; reference:
  rollout/models/topk_softmax.py);
- grouped_sigmoid_topk_triton: DeepSeek-V3's rule, a variant of the same kernel: sigmoid scores, the
  choice made on scores + e_score_correction_bias within the topk_group best of n_group groups (a
  group's score is the sum of its two best biased scores), weights = the unbiased scores at the
  chosen ids, normalised when norm_topk_prob, times routed_scaling_factor.
Ties: among exactly equal values the lower expert (and group) id wins, as in softmax_topk. Ids come out
in order of preference. The kernel is the capture hook: it stores the ids straight into this layer's
rows of the capture buffer (RoutedExpertsBuffer.layer_rows) as it stores them for the caller. Nothing
reads back to the host, so it runs inside CUDA graphs.

Triton is imported by this module: import it only where the triton backend is chosen.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import triton
import triton.language as tl

_MAX_TILE = 4096    # logits held per program: BLOCK_M rows x BLOCK_E experts


@triton.jit
def _pick(key, taken, cols, BLOCK: tl.constexpr):
    """Per row: the best not-yet-taken column of key [M, BLOCK] (lowest column among equals)."""
    best = tl.max(tl.where(taken, float("-inf"), key), axis=1)                      # [M]
    cand = (~taken) & (key == best[:, None])
    return tl.min(tl.where(cand, cols[None, :], BLOCK), axis=1)                     # [M]


@triton.jit
def _router_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, capture_ptr,
                   n_rows, n_experts, stride_logits, stride_capture, scale,
                   TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
                   SIGMOID: tl.constexpr, RENORMALIZE: tl.constexpr, N_GROUP: tl.constexpr,
                   TOPK_GROUP: tl.constexpr, GROUP_SIZE: tl.constexpr, BLOCK_G: tl.constexpr,
                   HAS_CAPTURE: tl.constexpr, SOFTMAX_AFTER: tl.constexpr = False):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)                       # [M]
    cols = tl.arange(0, BLOCK_E)                                                    # [E]
    row_ok = rows < n_rows
    col_ok = cols < n_experts
    x = tl.load(logits_ptr + rows[:, None].to(tl.int64) * stride_logits + cols[None, :],
                mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)   # [M, E]
    taken = (~col_ok[None, :]) | (rows[:, None] < 0)                                # [M, E] (padding columns)
    if SIGMOID:
        score = 1.0 / (1.0 + tl.exp(-x))                                            # [M, E]
        bias = tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        key = tl.where(col_ok[None, :], score + bias[None, :], float("-inf"))       # choice on biased scores
        if N_GROUP > 1:
            gcols = tl.arange(0, BLOCK_G)
            group_of = cols // GROUP_SIZE
            gscore = tl.full([BLOCK_M, BLOCK_G], float("-inf"), tl.float32)
            for g in tl.static_range(N_GROUP):
                in_g = (group_of == g)[None, :] & col_ok[None, :]
                first = _pick(key, ~in_g, cols, BLOCK_E)
                top1 = tl.max(tl.where(in_g, key, float("-inf")), axis=1)
                top2 = tl.max(tl.where(in_g & (cols[None, :] != first[:, None]), key, float("-inf")), axis=1)
                gscore = tl.where(gcols[None, :] == g, (top1 + top2)[:, None], gscore)
            gtaken = (gcols >= N_GROUP)[None, :] | (rows[:, None] < 0)              # [M, G]
            allowed = cols[None, :] < 0                                             # [M, E] all False
            for _ in tl.static_range(TOPK_GROUP):
                g_best = _pick(gscore, gtaken, gcols, BLOCK_G)
                gtaken = gtaken | (gcols[None, :] == g_best[:, None])
                allowed = allowed | (group_of[None, :] == g_best[:, None])
            taken = taken | ~allowed
        value = score
    elif SOFTMAX_AFTER:
        key = tl.where(col_ok[None, :], x, float("-inf"))
        value = x                                                                   # the chosen logits
    else:
        x = tl.where(col_ok[None, :], x, float("-inf"))
        e = tl.exp(x - tl.max(x, axis=1)[:, None])
        value = e / tl.sum(e, axis=1)[:, None]                                      # [M, E] softmax
        # NOTE: the choice is made on the logits, which softmax orders the same way: equal logits give
        # equal probabilities (lower id wins, as in softmax_topk), and the ids never depend on how
        # exp rounds. Distinct logits that round to one probability (fp32 logits a few ulps apart)
        # are the only case where softmax_topk could pick otherwise.
        key = x
    kcols = tl.arange(0, BLOCK_K)
    out_w = tl.zeros([BLOCK_M, BLOCK_K], tl.float32)
    out_id = tl.zeros([BLOCK_M, BLOCK_K], tl.int32)
    for k in tl.static_range(TOP_K):
        best = _pick(key, taken, cols, BLOCK_E)                                     # [M]
        hit = cols[None, :] == best[:, None]
        w = tl.sum(tl.where(hit, value, 0.0), axis=1)
        out_w = tl.where(kcols[None, :] == k, w[:, None], out_w)
        out_id = tl.where(kcols[None, :] == k, best[:, None], out_id)
        taken = taken | hit
    if SOFTMAX_AFTER:
        k_ok = (kcols < TOP_K)[None, :]
        top = tl.where(k_ok, out_w, float("-inf"))                                  # [M, BLOCK_K]
        e = tl.where(k_ok, tl.exp(top - tl.max(top, axis=1)[:, None]), 0.0)
        out_w = e / tl.sum(e, axis=1)[:, None]
    if RENORMALIZE:
        if SIGMOID:
            out_w = out_w / (tl.sum(out_w, axis=1)[:, None] + 1e-20)
        else:
            out_w = out_w / tl.sum(out_w, axis=1)[:, None]
    out_w = out_w * scale
    store = row_ok[:, None] & (kcols < TOP_K)[None, :]
    offs = rows[:, None].to(tl.int64) * TOP_K + kcols[None, :]
    tl.store(weights_ptr + offs, out_w, mask=store)
    tl.store(ids_ptr + offs, out_id.to(tl.int64), mask=store)
    if HAS_CAPTURE:
        tl.store(capture_ptr + rows[:, None].to(tl.int64) * stride_capture + kcols[None, :], out_id, mask=store)


def _capture_rows(capture: Optional[Any], layer_id: Optional[int], n: int, top_k: int) -> Optional[torch.Tensor]:
    """The [n, top_k] int32 view the kernel stores into, or None (no capture, or a target without rows)."""
    if capture is None or not hasattr(capture, "layer_rows"):
        return None
    rows = capture.layer_rows(layer_id, n)
    assert rows.shape == (n, top_k) and rows.dtype == torch.int32 and rows.stride(1) == 1, (rows.shape, rows.stride())
    return rows


def _route(logits: torch.Tensor, top_k: int, *, bias: Optional[torch.Tensor], renormalize: bool, scale: float,
           n_group: int, topk_group: int, capture: Optional[Any],
           layer_id: Optional[int], softmax_after: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    n, num_experts = logits.shape
    weights = torch.empty((n, top_k), dtype=torch.float32, device=logits.device)    # [N, K]
    ids = torch.empty((n, top_k), dtype=torch.int64, device=logits.device)          # [N, K]
    rows = _capture_rows(capture, layer_id, n, top_k)
    if n > 0:
        if logits.stride(1) != 1:
            logits = logits.contiguous()
        block_e = triton.next_power_of_2(num_experts)
        block_m = min(64, max(1, _MAX_TILE // block_e), triton.next_power_of_2(n))
        _router_kernel[(triton.cdiv(n, block_m),)](
            logits, bias if bias is not None else logits, weights, ids, rows if rows is not None else ids,
            n, num_experts, logits.stride(0), rows.stride(0) if rows is not None else 0, float(scale),
            TOP_K=top_k, BLOCK_K=triton.next_power_of_2(top_k), BLOCK_M=block_m, BLOCK_E=block_e,
            SIGMOID=bias is not None, RENORMALIZE=renormalize, N_GROUP=n_group, TOPK_GROUP=topk_group,
            GROUP_SIZE=num_experts // n_group, BLOCK_G=triton.next_power_of_2(n_group),
            HAS_CAPTURE=rows is not None, SOFTMAX_AFTER=softmax_after)
    if capture is not None and rows is None:
        capture.record(layer_id, ids)
    return weights, ids


def softmax_topk_triton(router_logits: torch.Tensor, top_k: int, renormalize: bool, *,
                        capture: Optional[Any] = None,
                        layer_id: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax_topk's rule in one kernel. router_logits [N, E] (any float dtype) ->
    topk_weights float32 [N, K], topk_ids int64 [N, K]; the ids also land in capture's rows of layer_id."""
    if not 0 < top_k <= router_logits.shape[-1]:
        raise ValueError(f"top_k must be in [1, num_experts={router_logits.shape[-1]}], got {top_k}")
    return _route(router_logits, top_k, bias=None, renormalize=renormalize, scale=1.0, n_group=1, topk_group=1,
                  capture=capture, layer_id=layer_id)


def topk_softmax_triton(router_logits: torch.Tensor, top_k: int, capture: Optional[Any] = None,
                        layer_id: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss's routing (rollout.models.moe.routing.topk_softmax's rule) in one kernel: the top_k largest
    logits (lower id first among equals), weights = fp32 softmax over those k. router_logits [N, E]
    (any float dtype) -> topk_weights float32 [N, K], topk_ids int64 [N, K]; the ids also land in
    capture's rows of layer_id."""
    if not 0 < top_k <= router_logits.shape[-1]:
        raise ValueError(f"top_k must be in [1, num_experts={router_logits.shape[-1]}], got {top_k}")
    return _route(router_logits, top_k, bias=None, renormalize=False, scale=1.0, n_group=1, topk_group=1,
                  capture=capture, layer_id=layer_id, softmax_after=True)


def grouped_sigmoid_topk_triton(router_logits: torch.Tensor, top_k: int, *, correction_bias: torch.Tensor,
                                n_group: int, topk_group: int, norm_topk_prob: bool,
                                routed_scaling_factor: float, capture: Optional[Any] = None,
                                layer_id: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's routing in one kernel. router_logits [N, E] (fp32 in DeepSeek-V3), correction_bias [E]
    -> topk_weights float32 [N, K], topk_ids int64 [N, K]; the ids also land in capture's rows of layer_id."""
    num_experts = router_logits.shape[-1]
    if not (isinstance(n_group, int) and n_group >= 1 and num_experts % n_group == 0
            and (n_group == 1 or num_experts // n_group >= 2)):
        raise ValueError(f"n_group must divide num_experts={num_experts} into groups of at least 2 experts, "
                         f"got {n_group}")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group must be in [1, n_group={n_group}], got {topk_group}")
    if not 0 < top_k <= topk_group * (num_experts // n_group):
        raise ValueError(f"top_k must be in [1, topk_group * experts per group = "
                         f"{topk_group * (num_experts // n_group)}], got {top_k}")
    if tuple(correction_bias.shape) != (num_experts,):
        raise ValueError(f"correction_bias must have shape ({num_experts},), got {tuple(correction_bias.shape)}")
    return _route(router_logits, top_k, bias=correction_bias.contiguous(), renormalize=norm_topk_prob,
                  scale=routed_scaling_factor, n_group=n_group, topk_group=topk_group, capture=capture,
                  layer_id=layer_id)
