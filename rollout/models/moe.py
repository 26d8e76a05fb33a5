"""SparseMoE: router + top-k routing + fused experts (+ optional gated shared expert).

A routing rule is one function (softmax_topk here; grouped_sigmoid_topk in sigmoid_moe.py) and
the single hook point for routed-expert capture: it records the expert ids it picked, in logical
expert numbering, before anything else touches them.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from rollout import exact as exact_ops
from rollout.config import MOE_BACKENDS
from rollout.batch.forward_batch import ForwardBatch
from rollout.models.layers import GatedMLP


def softmax_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool, *,
                 capture: Optional[Any] = None,
                 layer_id: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax (fp32) -> top-k -> optional renormalisation over the chosen k.

    router_logits [N, E] (any float dtype) -> topk_weights float32 [N, K], topk_ids int64 [N, K].
    Same rule as HF's Qwen2/Qwen3-MoE, Mixtral (renormalize=True) and OLMoE routers.
    """
    if not 0 < top_k <= router_logits.shape[-1]:
        raise ValueError(f"top_k must be in [1, num_experts={router_logits.shape[-1]}], got {top_k}")
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)        # [N, E]
    # NOTE: ties. torch.topk's choice among exactly equal probabilities is unspecified (on CPU it
    # does not prefer the lower id). A stable descending sort makes the rule explicit: among equal
    # probabilities the lower expert id wins, on every device and batch composition.
    topk_weights, topk_ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    topk_weights, topk_ids = topk_weights[:, :top_k], topk_ids[:, :top_k]    # [N, K]
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    if capture is not None:
        capture.record(layer_id, topk_ids)
    return topk_weights, topk_ids


class Router(nn.Module):
    """Bias-free gate linear; a module so its weight is named `gate.weight` as in HF checkpoints."""

    exact = False   # rollout.exact.linear (deterministic inference)

    def __init__(self, hidden_size: int, num_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (exact_ops.linear if self.exact else F.linear)(x, self.weight)  # [N, E]


class FusedExperts(nn.Module):
    """The experts' weights stacked: w13 [E_local, 2I, H] (gate rows then up rows), w2 [E_local, H, I].

    Unsharded, E_local = num_experts. Under expert parallelism (DP attention) a rank holds only the
    experts [expert_lo, expert_hi) of num_experts; routing ids stay global everywhere.
    """

    exact = False   # impl "exact" (rollout.exact.fused_experts) unless one is forced

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int):
        super().__init__()
        self.num_experts = num_experts
        self.expert_lo, self.expert_hi = 0, num_experts
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def shard(self, lo: int, hi: int) -> None:
        """Keep only experts [lo, hi) (call before the weights are loaded: the values are dropped)."""
        if not 0 <= lo <= hi <= self.num_experts:
            raise ValueError(f"expert shard [{lo}, {hi}) is outside [0, {self.num_experts})")
        w13, w2 = self.w13, self.w2
        self.w13 = nn.Parameter(w13.new_empty(hi - lo, *w13.shape[1:]), requires_grad=w13.requires_grad)
        self.w2 = nn.Parameter(w2.new_empty(hi - lo, *w2.shape[1:]), requires_grad=w2.requires_grad)
        self.expert_lo, self.expert_hi = lo, hi

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                experts: tuple[int, int] | None = None, graph_safe: bool = False,
                impl: str | None = None) -> torch.Tensor:
        """x [N, H], topk_weights float32 [N, K], topk_ids int64 [N, K] (global ids) -> [N, H] in x.dtype.

        Only the experts this module holds contribute (expert parallel: the other ranks add theirs).
        experts: [lo, hi) to narrow that further (default: all held). graph_safe: no host syncs
        (CUDA graph capture). impl: force "padded", "grouped", "loop", "dense", "triton" (the fused
        kernels of moe_triton.py; no host sync) or "exact_triton" (their batch-invariant form,
        moe_triton_exact.py) (default: "exact" when exact, else choose_impl).
        """
        lo, hi = experts if experts is not None else (self.expert_lo, self.expert_hi)
        if not self.expert_lo <= lo <= hi <= self.expert_hi:
            raise ValueError(f"experts [{lo}, {hi}) are not all held here ([{self.expert_lo}, {self.expert_hi}))")
        if lo == hi:
            return torch.zeros_like(x)
        impl = impl or ("exact" if self.exact else self.choose_impl(x, graph_safe, topk_ids.numel()))
        run = {"exact": self._forward_exact, "exact_triton": self._forward_exact_triton, "padded": self._forward_padded, "grouped": self._forward_grouped, "loop": self._forward_loop,
               "dense": self._forward_dense, "triton": self._forward_triton}[impl]
        return run(x, topk_weights, topk_ids, lo, hi)

    # NOTE: on CPU torch's grouped GEMM runs one matmul per expert; up to this many (token, expert)
    # rows one batched matmul over experts padded to the busiest is faster (tiny Qwen3-MoE, 16
    # experts, 2 cores: 1.5x faster at 128 tokens x top-4, 1.4x at 256 x 4, 1.9x slower at 384 x 4).
    PADDED_MAX_ROWS = 1024

    @staticmethod
    def choose_impl(x: torch.Tensor, graph_safe: bool, rows: int = 0) -> str:
        """rows: (token, expert) pairs routed. "padded" (batched matmul over experts padded to the
        busiest; reads the counts on the host) for few rows on CPU; "grouped" (torch's grouped
        GEMM: two kernels for all experts, no host sync) where torch has it for x's device and
        dtype (CPU; CUDA bf16 on SM80+); else the per-expert "loop" (reads the expert counts on
        the host), or "dense" (every held expert over every row; no host sync) when graph_safe."""
        if x.device.type == "cpu" and not graph_safe and rows <= FusedExperts.PADDED_MAX_ROWS:
            return "padded"
        if hasattr(F, "grouped_mm") and (x.device.type == "cpu" or (
                x.device.type == "cuda" and x.dtype == torch.bfloat16
                and torch.cuda.get_device_capability(x.device) >= (8, 0))):
            return "grouped"
        return "dense" if graph_safe else "loop"

    def _forward_grouped(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                         lo: int, hi: int) -> torch.Tensor:
        k = topk_ids.shape[1]
        flat_ids = topk_ids.reshape(-1)                                    # [N*K]
        held = (flat_ids >= lo) & (flat_ids < hi)
        group = torch.where(held, flat_ids - lo, hi - lo)                  # experts not in range: last
        order = torch.argsort(group, stable=True)                          # [N*K] grouped by expert
        # NOTE: group ends by searchsorted, not bincount (CUDA bincount reads the max on the host)
        ends = torch.searchsorted(group[order], torch.arange(hi - lo, device=group.device), right=True,
                                  out_int32=True)                          # [E_range] int32
        token_of = order // k                                              # [N*K] token row
        first = lo - self.expert_lo
        # NOTE: rows past ends[-1] (other experts) are left undefined by grouped_mm: masked below
        gate, up = F.grouped_mm(x.index_select(0, token_of), self.w13[first:first + hi - lo].transpose(1, 2),
                                offs=ends).chunk(2, dim=-1)                # [N*K, I] each
        y = F.grouped_mm(F.silu(gate) * up, self.w2[first:first + hi - lo].transpose(1, 2), offs=ends)
        y = y * topk_weights.reshape(-1)[order, None].to(y.dtype)          # [N*K, H], as in _forward_loop
        y = torch.where(held[order, None], y, 0)
        return torch.zeros_like(x).index_add_(0, token_of, y)

    def _forward_padded(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                        lo: int, hi: int) -> torch.Tensor:
        k = topk_ids.shape[1]
        num = hi - lo
        flat_ids = topk_ids.reshape(-1)                                    # [N*K]
        held = (flat_ids >= lo) & (flat_ids < hi)
        group = torch.where(held, flat_ids - lo, num)                      # experts not in range: last
        order = torch.argsort(group, stable=True)                          # [N*K] grouped by expert
        counts = torch.bincount(group, minlength=num + 1)
        counts_host = counts.tolist()
        cap, rows = max(counts_host[:num]), sum(counts_host[:num])
        if rows == 0:
            return torch.zeros_like(x)
        order = order[:rows]                                               # held rows only
        sorted_group = group.index_select(0, order)
        starts = torch.cumsum(counts, 0) - counts
        slot = sorted_group * cap + (torch.arange(rows, device=x.device) - starts.index_select(0, sorted_group))
        token_of = order // k                                              # [rows] token row
        first = lo - self.expert_lo
        padded = x.new_zeros(num * cap, x.shape[1]).index_copy_(0, slot, x.index_select(0, token_of))
        gate, up = torch.bmm(padded.view(num, cap, -1),
                             self.w13[first:first + num].transpose(1, 2)).chunk(2, dim=-1)  # [E, cap, I] each
        y = torch.bmm(F.silu(gate) * up, self.w2[first:first + num].transpose(1, 2))        # [E, cap, H]
        y = y.view(num * cap, -1).index_select(0, slot)
        y = y * topk_weights.reshape(-1).index_select(0, order)[:, None].to(y.dtype)      # as in _forward_loop
        return torch.zeros_like(x).index_add_(0, token_of, y)

    def _forward_loop(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                      lo: int, hi: int) -> torch.Tensor:
        n, k = topk_ids.shape
        out = torch.zeros_like(x)
        flat_ids = topk_ids.reshape(-1)                                    # [N*K]
        order = torch.argsort(flat_ids, stable=True)                       # [N*K]
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        token_of = order // k                                              # [N*K] token row
        weight_of = topk_weights.reshape(-1)[order]                        # [N*K]
        start = sum(counts[:lo])
        for e in range(lo, hi):
            cnt = counts[e]
            if cnt == 0:
                continue
            rows = token_of[start:start + cnt]
            w13, w2 = self.w13[e - self.expert_lo], self.w2[e - self.expert_lo]
            gate, up = F.linear(x[rows], w13).chunk(2, dim=-1)             # [cnt, I] each
            y = F.linear(F.silu(gate) * up, w2)                            # [cnt, H]
            # NOTE: routing weight cast to the model dtype before the product, as HF Qwen/OLMoE do
            # (HF Mixtral multiplies in fp32 then casts; the two differ only by bf16 rounding).
            y = y * weight_of[start:start + cnt, None].to(y.dtype)
            out.index_add_(0, rows, y)
            start += cnt
        return out

    def _forward_exact(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                       lo: int, hi: int, per_slot: bool = False) -> torch.Tensor:
        first = lo - self.expert_lo
        return exact_ops.fused_experts(x, self.w13[first:first + hi - lo], self.w2[first:first + hi - lo],
                                       topk_weights, topk_ids, lo, per_slot=per_slot)

    def _forward_exact_triton(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                              lo: int, hi: int, per_slot: bool = False) -> torch.Tensor:
        from rollout.models.moe_triton_exact import fused_moe_exact  # noqa: PLC0415  (triton only when chosen)

        first = lo - self.expert_lo
        return fused_moe_exact(x, self.w13[first:first + hi - lo], self.w2[first:first + hi - lo], topk_weights,
                               topk_ids, lo, per_slot=per_slot)

    def exact_terms(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                    triton: bool = False) -> torch.Tensor:
        """The held experts' weighted outputs per top-k slot [N, K, H] (0 for slots routed elsewhere);
        triton: by the batch-invariant Triton kernel (moe_triton_exact.py)."""
        run = self._forward_exact_triton if triton else self._forward_exact
        return run(x, topk_weights, topk_ids, self.expert_lo, self.expert_hi, per_slot=True)

    def _forward_triton(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                        lo: int, hi: int) -> torch.Tensor:
        from rollout.models.moe_triton import fused_moe  # noqa: PLC0415  (triton only when chosen)

        first = lo - self.expert_lo
        return fused_moe(x, self.w13[first:first + hi - lo], self.w2[first:first + hi - lo], topk_weights,
                         topk_ids, lo)

    def _forward_dense(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                       lo: int, hi: int) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in range(lo, hi):
            w = (topk_weights * (topk_ids == e)).sum(-1)                   # [N] float32, 0 if not picked
            gate, up = F.linear(x, self.w13[e - self.expert_lo]).chunk(2, dim=-1)  # [N, I] each
            y = F.linear(F.silu(gate) * up, self.w2[e - self.expert_lo])   # [N, H]
            out = out + y * w[:, None].to(y.dtype)
        return out


class SparseMoE(nn.Module):
    """Routed experts, plus Qwen2-MoE's shared expert scaled by sigmoid(shared_expert_gate(x))."""

    def __init__(self, *, layer_id: int, hidden_size: int, intermediate_size: int, num_experts: int,
                 top_k: int, renormalize: bool, shared_intermediate_size: int = 0):
        super().__init__()
        self.layer_id = layer_id
        self.top_k = top_k
        self.renormalize = renormalize
        self.moe_backend = "torch"     # "triton": router and experts run the Triton kernels (set_moe_backend)
        self.gate = Router(hidden_size, num_experts)
        self.experts = FusedExperts(hidden_size, intermediate_size, num_experts)
        if shared_intermediate_size > 0:
            self.shared_expert = GatedMLP(hidden_size, shared_intermediate_size)
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)
        else:
            self.shared_expert = None

    def forward(self, x: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """x [N, H] -> [N, H]."""
        ep = fb.ep_group
        if ep is None:
            topk_weights, topk_ids = self.route(x, fb)
            out = self.experts(x, topk_weights, topk_ids, graph_safe=fb.graph_safe, impl=self._experts_impl)
        else:
            # DP attention: route every rank's tokens (gathered by the executing runner's layout, so
            # the capture buffer rows sit where the capturer slices them), compute this rank's
            # experts, and sum over ranks back into this rank's own rows.
            assert (self.experts.expert_lo, self.experts.expert_hi) == ep.expert_range(self.experts.num_experts), \
                "DP attention needs the model loaded with this rank's expert shard (load_model(expert_shard=...))"
            x_all = ep.gather(x, fb.layout)                                # [layout.total_rows, H]
            topk_weights, topk_ids = self.route(x_all, fb)
            if self.experts.exact:
                # NOTE: the ranks' terms are added per slot (one nonzero term each), then the slots
                # in order: the same bits as one rank holding every expert
                terms = self.experts.exact_terms(x_all, topk_weights, topk_ids,
                                                 triton=self.moe_backend == "triton")  # [rows, K, H]
                rows, k, hidden = terms.shape
                own = ep.reduce_own(terms.view(rows, k * hidden), fb.layout)     # [N, K*H]
                out = exact_ops.sum_slots(own.view(-1, k, hidden))               # [N, H]
            else:
                partial = self.experts(x_all, topk_weights, topk_ids, graph_safe=fb.graph_safe,
                                       impl=self._experts_impl)            # own experts
                out = ep.reduce_own(partial, fb.layout)                    # [N, H]
        shared = self.shared_output(x)
        return out if shared is None else out + shared

    @property
    def _experts_impl(self) -> str | None:
        if self.moe_backend != "triton":
            return None
        return "exact_triton" if self.experts.exact else "triton"

    @property
    def _triton_router(self) -> bool:
        """The router kernel of topk_triton.py: on the triton backend, outside deterministic inference
        (whose routing stays softmax_topk's: a row's softmax and top-k are its own)."""
        return self.moe_backend == "triton" and not self.gate.exact

    def route(self, x: torch.Tensor, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """x [rows, H] -> topk_weights float32 [rows, K], topk_ids int64 [rows, K] (captured)."""
        return self._route(self.gate(x), fb)

    def shared_output(self, x: torch.Tensor) -> torch.Tensor | None:
        """The shared expert's part of the output [N, H] (this rank's own rows), or None."""
        if self.shared_expert is None:
            return None
        sigmoid = exact_ops.sigmoid if self.experts.exact else torch.sigmoid
        return sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)

    def _route(self, router_logits: torch.Tensor, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        if self._triton_router:
            from rollout.models.topk_triton import softmax_topk_triton  # noqa: PLC0415  (triton only when chosen)

            return softmax_topk_triton(router_logits, self.top_k, self.renormalize, capture=fb.capture,
                                       layer_id=self.layer_id)
        return softmax_topk(router_logits, self.top_k, self.renormalize, capture=fb.capture, layer_id=self.layer_id)


def set_moe_backend(model: nn.Module, backend: str) -> int:
    """Makes every MoE layer of model (modules with a moe_backend) use backend ("torch" | "triton");
    returns how many layers it set."""
    if backend not in MOE_BACKENDS:
        raise ValueError(f"moe_backend must be one of {MOE_BACKENDS}, got {backend!r}")
    layers = [m for m in model.modules() if hasattr(m, "moe_backend")]
    for m in layers:
        m.moe_backend = backend
    return len(layers)
