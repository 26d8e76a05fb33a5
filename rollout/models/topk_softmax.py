"""gpt-oss's routing rule in torch: top-k of the router logits, then softmax over those k.

The reference of topk_softmax_triton (rollout/models/topk_triton.py) and, like softmax_topk
(rollout/models/moe.py), the capture hook: it records the ids it picked, in logical expert numbering.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from rollout import exact as exact_ops


def topk_softmax(router_logits: torch.Tensor, top_k: int, *, capture: Optional[Any] = None,
                 layer_id: int | None = None, exact: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """top-k of the logits -> softmax (fp32) over the chosen k, as HF's GptOssTopKRouter.

    router_logits [N, E] (any float dtype; gpt-oss's gate has a bias, already added) ->
    topk_weights float32 [N, K], topk_ids int64 [N, K] in order of preference. exact: the softmax
    of rollout.exact (deterministic inference).
    """
    if not 0 < top_k <= router_logits.shape[-1]:
        raise ValueError(f"top_k must be in [1, num_experts={router_logits.shape[-1]}], got {top_k}")
    # NOTE: ties. torch.topk's choice among exactly equal logits is unspecified; a stable descending
    # sort makes the lower expert id win, as in softmax_topk.
    top_logits, topk_ids = torch.sort(router_logits, dim=-1, descending=True, stable=True)
    top_logits, topk_ids = top_logits[:, :top_k], topk_ids[:, :top_k]         # [N, K]
    if exact:
        topk_weights = exact_ops.softmax(top_logits)
    else:
        topk_weights = torch.softmax(top_logits, dim=-1, dtype=torch.float32)  # [N, K]
    if capture is not None:
        capture.record(layer_id, topk_ids)
    return topk_weights, topk_ids
