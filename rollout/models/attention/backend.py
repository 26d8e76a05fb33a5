"""Attention backends: which kernels PagedAttention.attend runs (torch, Triton or FlashInfer).

torch is PagedAttention's own SDPA path (the reference); it needs no backend object. The Triton
and FlashInfer backends are imported only when chosen, never at package import. A backend
`bind`s each forward's ForwardBatch before the model runs (eager, or a static-shape bucket just
loaded into its buffers, before a CUDA graph capture or replay) and then serves every layer's
`attend`. bind must not make tensors a captured graph would read: static buckets get nothing
but the backend itself (Triton) or plan into the wrapper's own fixed buffers (FlashInfer).
"""
from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from typing import Any, Optional

import torch

from rollout.config.backends import check_attention_backend
from rollout.batch.forward_batch import ForwardBatch
from rollout.batch.paged_kv_metadata import paged_kv_metadata

logger = logging.getLogger(__name__)


class TritonAttentionBackend:
    """The Triton kernels: split-KV decode, extend (prefill over cached prefixes) and, for an
    eager decode step whose requests share prefixes, the cascade. exact (deterministic inference):
    every step, decode included, through the extend kernel in its batch-invariant form (no splits,
    no cascade), so a query's bits are the same in decode, chunked prefill and a whole prompt."""

    name = "triton"
    reads_mask = False   # the kernels mask by seq_lens / extend_lens and the layer's window

    def __init__(self, *, num_splits: Optional[int] = None, exact: bool = False):
        self.num_splits = num_splits   # decode splits over the KV length; None: by device and batch
        self.exact = exact
        # layer calls per path ("decode", "extend", "cascade"); Python calls, so under CUDA graphs
        # only the captures count
        self.calls: Counter = Counter()

    def bind(self, fb: ForwardBatch, *, static: bool) -> ForwardBatch:
        plan = None
        if not static and fb.prefix_groups and fb.max_extend == 1 and not self.exact:
            meta = paged_kv_metadata(extend_lens=[1] * fb.batch_size, seq_lens=fb.lens_on_host()[0],
                                     kv_indices=fb.kv_indices, prefix_groups=fb.prefix_groups,
                                     device=fb.kv_indices.device)
            plan = meta if meta.is_cascade else None
        return dataclasses.replace(fb, attention=self, attention_plan=plan)

    def attend(self, attn: Any, q: torch.Tensor, fb: ForwardBatch, attn_mask: Optional[torch.Tensor]) -> torch.Tensor:
        """attn: the layer's PagedAttention (its sliding_window is the kernels' window); attn_mask is
        None (attention_masks makes none for a backend that reads none)."""
        from rollout.models.kernels.cascade_attention import cascade_decode_attention  # noqa: PLC0415
        from rollout.models.kernels.decode_attention import decode_attention  # noqa: PLC0415
        from rollout.models.kernels.extend_attention import extend_attention  # noqa: PLC0415

        kv = fb.kv_pool.kv_buffers[attn.layer_id]
        window = attn.sliding_window
        if fb.num_tokens == 0:
            return q.new_zeros(0, q.shape[1] * q.shape[2])
        if fb.attention_plan is not None and window is None:
            self.calls["cascade"] += 1
            return cascade_decode_attention(q, kv, fb.attention_plan, scale=attn.scale, num_splits=self.num_splits, sinks=attn.sinks)
        if self.exact:
            self.calls["exact"] += 1
            return extend_attention(q, kv, fb.kv_indices, fb.extend_lens, fb.seq_lens, max_extend=fb.max_extend,
                                    scale=attn.scale, window=window, exact=True, sinks=attn.sinks)
        if fb.max_extend == 1:
            self.calls["decode"] += 1
            return decode_attention(q, kv, fb.kv_indices, fb.seq_lens, scale=attn.scale, window=window,
                                    num_splits=self.num_splits, sinks=attn.sinks)
        self.calls["extend"] += 1
        return extend_attention(q, kv, fb.kv_indices, fb.extend_lens, fb.seq_lens, max_extend=fb.max_extend,
                                scale=attn.scale, window=window, sinks=attn.sinks)


def make_attention_backend(name: str, *, device: torch.device, model: torch.nn.Module,
                           exact: bool = False) -> Optional[Any]:
    """The backend object ModelRunner binds into each forward; None for torch. exact: deterministic
    inference (triton only: the batch-invariant kernel)."""
    check_attention_backend(name, str(device))
    if name == "torch" or getattr(model.spec, "mla", None) is not None:
        # NOTE: the kernels are built for the GQA pool layout; MLA layers (latent_attention.py)
        # always attend with torch over the latent pool, so nothing is bound for them.
        return None
    if name == "triton":
        return TritonAttentionBackend(exact=exact)
    if exact:
        raise ValueError(f"enable_deterministic_inference: attention_backend must be 'torch' or 'triton', got {name!r}")
    spec = model.spec
    if spec.attention_sinks:
        # NOTE: the FlashInfer wrappers used here take no per-head sinks; the Triton kernels do
        logger.warning("attention_backend='flashinfer' has no attention sinks (%s): using 'triton'", spec.architecture)
        return TritonAttentionBackend()
    from rollout.models.attention.flashinfer import FlashInferAttentionBackend  # noqa: PLC0415

    windows = {spec.sliding_window(i) for i in range(spec.num_hidden_layers)}
    return FlashInferAttentionBackend(device=device, num_heads=spec.num_attention_heads,
                                      num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                                      windows=windows, dtype=next(model.parameters()).dtype)
