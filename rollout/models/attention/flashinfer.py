"""FlashInferAttentionBackend: FlashInfer's paged wrappers over the engine's KV pool, page size 1.

Imported only when attention_backend='flashinfer' is chosen (flashinfer is imported here, in the
constructor). Each KV slot is one page: the pool's per-layer [slots, 2, kvH, D] tensor is
FlashInfer's NHD paged cache [pages, 2, page_size=1, kvH, D] as a view. Every forward's index
arrays come from paged_kv_metadata (rollout/batch/paged_kv_metadata.py), the function the CPU
reference (models/paged_reference_attention.py) is tested with. Per forward:
- decode: BatchDecodeWithPagedKVCacheWrapper; in a decode bucket (CUDA graph) one wrapper per
  (bucket, window) with use_cuda_graph and fixed index buffers, planned before each replay;
- prefill/extend: BatchPrefillWithPagedKVCacheWrapper, causal (the piecewise prefill runs its
  attention cores between the graphs, so this wrapper never runs inside one);
- an eager decode step with prompt groups: MultiLevelCascadeAttentionWrapper with two levels
  (each group's shared prefix once, then each request's own keys).
One wrapper per distinct sliding window (FlashInfer's window_left = window - 1).
NOTE: written against FlashInfer's documented wrapper API; no machine this was written on had
flashinfer installed, so this backend has not run yet (scripts/gpu_check.sh runs it where it imports).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from rollout.batch.forward_batch import ForwardBatch
from rollout.batch.paged_kv_metadata import PagedKVMetadata, paged_kv_metadata

WORKSPACE_BYTES = 256 * 2**20


@dataclasses.dataclass(frozen=True)
class FlashInferPlan:
    kind: str                          # "decode" | "prefill" | "cascade"
    wrappers: dict                     # window (None = full) -> the planned wrapper
    meta: PagedKVMetadata


class FlashInferAttentionBackend:
    name = "flashinfer"
    reads_mask = False   # the wrappers mask by their plan and window_left

    def __init__(self, *, device: torch.device, num_heads: int, num_kv_heads: int, head_dim: int,
                 windows: set, dtype: torch.dtype):
        import flashinfer  # noqa: PLC0415  (only when this backend is chosen)

        self.fi = flashinfer
        self.device = device
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5
        self.dtype = dtype
        self.windows = sorted(windows, key=lambda w: -1 if w is None else w)
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        tensor_cores = num_heads // num_kv_heads >= 4
        self.decode = {w: flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD",
                                                                        use_tensor_cores=tensor_cores)
                       for w in self.windows}
        self.prefill = {w: flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
                        for w in self.windows}
        self.cascade = flashinfer.MultiLevelCascadeAttentionWrapper(2, self.workspace, "NHD")
        self.graph_decode: dict[tuple[int, Optional[int]], Any] = {}   # (bucket, window) -> wrapper

    def _graph_wrapper(self, bucket: int, width: int, window: Optional[int]) -> Any:
        key = (bucket, window)
        if key not in self.graph_decode:
            def buf(n: int) -> torch.Tensor:
                return torch.zeros(n, dtype=torch.int32, device=self.device)
            self.graph_decode[key] = self.fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True,
                use_tensor_cores=self.num_heads // self.num_kv_heads >= 4,
                paged_kv_indptr_buffer=buf(bucket + 1), paged_kv_indices_buffer=buf(bucket * width),
                paged_kv_last_page_len_buffer=buf(bucket))
        return self.graph_decode[key]

    def bind(self, fb: ForwardBatch, *, static: bool) -> ForwardBatch:
        if fb.num_tokens == 0:
            return dataclasses.replace(fb, attention=self, attention_plan=None)
        seq_lens, extend_lens = fb.lens_on_host()
        meta = paged_kv_metadata(extend_lens=extend_lens, seq_lens=seq_lens,
                                 kv_indices=fb.kv_indices, prefix_groups=() if static else fb.prefix_groups,
                                 device=self.device)
        common = dict(q_data_type=self.dtype, kv_data_type=self.dtype, sm_scale=self.scale)
        heads = (self.num_heads, self.num_kv_heads, self.head_dim, 1)
        if meta.is_cascade:
            levels = meta.levels
            self.cascade.plan([lv.qo_indptr for lv in levels], [lv.kv_indptr for lv in levels],
                              [lv.kv_indices for lv in levels], [lv.kv_last_page_len for lv in levels],
                              *heads, causal=False, **common)
            plan = FlashInferPlan("cascade", {None: self.cascade}, meta)
        elif fb.max_extend == 1:
            level = meta.levels[0]
            wrappers = {}
            for w in self.windows:
                wrapper = (self._graph_wrapper(fb.batch_size, fb.kv_indices.shape[1], w) if static
                           else self.decode[w])
                wrapper.plan(level.kv_indptr, level.kv_indices, level.kv_last_page_len, *heads,
                             window_left=-1 if w is None else w - 1, **common)
                wrappers[w] = wrapper
            plan = FlashInferPlan("decode", wrappers, meta)
        else:
            level = meta.levels[0]
            for w, wrapper in self.prefill.items():
                wrapper.plan(level.qo_indptr, level.kv_indptr, level.kv_indices, level.kv_last_page_len, *heads,
                             causal=True, window_left=-1 if w is None else w - 1, **common)
            plan = FlashInferPlan("prefill", dict(self.prefill), meta)
        return dataclasses.replace(fb, attention=self, attention_plan=plan)

    def attend(self, attn: Any, q: torch.Tensor, fb: ForwardBatch, attn_mask: Optional[torch.Tensor]) -> torch.Tensor:
        n = q.shape[0]
        if n == 0:
            return q.new_zeros(0, self.num_heads * self.head_dim)
        plan: FlashInferPlan = fb.attention_plan
        kv = fb.kv_pool.kv_buffers[attn.layer_id]
        paged = kv.view(kv.shape[0], 2, 1, kv.shape[2], kv.shape[3])          # [pages, 2, 1, kvH, D]
        window = attn.sliding_window
        if plan.kind == "cascade" and window is not None:
            # NOTE: the cascade is planned for full attention only; a sliding-window layer in a
            # cascade step uses the reference path (with the mask it makes for itself)
            return attn.torch_attend(q, fb, attn.sliding_window_mask(fb, window))
        if plan.kind == "cascade":
            order = plan.meta.order
            out = plan.wrappers[None].run(q.index_select(0, order), paged)
            return torch.empty_like(out).index_copy_(0, order, out).reshape(n, -1)
        return plan.wrappers[window].run(q, paged).reshape(n, -1)
