"""FusedExperts: the routed experts of one MoE layer, their weights stacked, over several
implementations (torch on CPU and GPU, the Triton kernels, the batch-invariant forms).

Every implementation computes, for each (token, expert) pair the router chose,
    gate, up = (x @ w13[e].T + b13[e]).chunk(2)
    y = (act(gate, up) @ w2[e].T + b2[e]) * routing weight
and adds the k pairs of a token. act is SwiGLU (silu(gate) * up) or gpt-oss's clamped SwiGLU
(swiglu_limit set): gate.clamp(max=limit) * sigmoid(alpha * gate.clamp(max=limit)) *
(up.clamp(-limit, limit) + 1). The biases exist only when the architecture has them (gpt-oss).

FP8 (`quantize_fp8`, before loading): w13 / w2 are held in float8_e4m3fn with their scales
(`w13_scale_inv` [E, 2 x ceil(I / b0), ceil(H / b1)] and `w2_scale_inv` for block scales, the gate
and up halves each on their own block grid as the checkpoint's gate_proj / up_proj; `w13_scale`
[E, 2I, 1] / `w2_scale` [E, H, 1] per channel), and dequantized into the compute dtype for the
experts a forward runs (W8A16).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rollout import exact as exact_ops
from rollout.models.quant.fp8 import FP8_DTYPE, Fp8Scheme, dequantize, quantize_into


class FusedExperts(nn.Module):
    """The experts' weights stacked: w13 [E_local, 2I, H] (gate rows then up rows), w2 [E_local, H, I],
    with bias: b13 [E_local, 2I] (gate then up) and b2 [E_local, H].

    Unsharded, E_local = num_experts. Under expert parallelism (DP attention) a rank holds only the
    experts [expert_lo, expert_hi) of num_experts; routing ids stay global everywhere.
    """

    exact = False   # impl "exact" (rollout.exact.fused_experts) unless one is forced

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, *, bias: bool = False,
                 swiglu_limit: float | None = None, swiglu_alpha: float = 1.702):
        super().__init__()
        self.num_experts = num_experts
        self.expert_lo, self.expert_hi = 0, num_experts
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.b13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size)) if bias else None
        self.b2 = nn.Parameter(torch.empty(num_experts, hidden_size)) if bias else None
        self.swiglu_limit = swiglu_limit
        self.swiglu_alpha = swiglu_alpha
        self.fp8: Fp8Scheme | None = None

    SCALED = ("w13", "w2")

    def quantize_fp8(self, scheme: Fp8Scheme) -> None:
        """Hold w13 / w2 in FP8 with scales of `scheme` (call before the weights are loaded)."""
        if scheme.granularity == "tensor":
            raise ValueError("FP8 experts with one scale per tensor are not supported (block or channel scales)")
        for name in self.SCALED:
            w = getattr(self, name)
            e, out, inp = w.shape
            halves = 2 if name == "w13" else 1
            shape = scheme.scale_shape(out // halves, inp)
            setattr(self, name, nn.Parameter(w.new_empty(w.shape, dtype=FP8_DTYPE), requires_grad=False))
            self.register_parameter(f"{name}_{scheme.scale_name.removeprefix('weight_')}", nn.Parameter(
                w.new_empty((e, shape[0] * halves, *shape[1:]), dtype=torch.float32), requires_grad=False))
        self.fp8 = scheme

    def scale_of(self, name: str) -> torch.Tensor:
        return getattr(self, f"{name}_{self.fp8.scale_name.removeprefix('weight_')}")

    def _apply(self, fn, recurse=True):
        # NOTE: model.to(dtype) must leave FP8 weights and their fp32 scales as they are
        super()._apply(fn, recurse)
        if self.fp8 is not None:
            for name in self.SCALED:
                for p, want in ((getattr(self, name), FP8_DTYPE), (self.scale_of(name), torch.float32)):
                    if p.dtype != want:
                        p.data = p.data.to(want)
        return self

    def dense(self, name: str, first: int, num: int, dtype: torch.dtype,
              ids: torch.Tensor | None = None) -> torch.Tensor:
        """w13 or w2 of held experts [first, first + num) in dtype (dequantized when FP8); ids:
        those experts (held indices) instead, gathered (only they are dequantized)."""
        pick = (lambda t: t[first:first + num]) if ids is None else (lambda t: t.index_select(0, ids))
        w = pick(getattr(self, name))
        if self.fp8 is None:
            return w
        scale = pick(self.scale_of(name))
        half, rows = w.shape[1] // 2, scale.shape[1] // 2       # gate and up: each its own block grid
        if name == "w2" or self.fp8.granularity != "block" or half % self.fp8.block[0] == 0:
            return dequantize(w, scale, self.fp8, dtype)        # NOTE: whole blocks: one grid for both
        return torch.cat((dequantize(w[:, :half], scale[:, :rows], self.fp8, dtype),
                          dequantize(w[:, half:], scale[:, rows:], self.fp8, dtype)), dim=1)

    @torch.no_grad()
    def write_float(self, name: str, target, value: torch.Tensor, expert_lo: int = 0) -> None:
        """Quantizes float expert weights into the FP8 ones: `target` (loader.Target) says which
        expert (None: the stacked held experts, value [E_held, out, in]) and which half of w13."""
        assert self.fp8 is not None and name in self.SCALED, name
        w, scale = getattr(self, name), self.scale_of(name)
        experts = range(w.shape[0]) if target.expert is None else [target.expert - expert_lo]
        values = value if target.expert is None else value[None]
        halves = (target.half,) if target.half is not None else ((0, 1) if name == "w13" else (None,))
        for i, v in zip(experts, values):
            for h in halves:
                part = v
                rows_w, rows_s = w.shape[1], scale.shape[1]
                lo_w = lo_s = 0
                if h is not None:
                    rows_w, rows_s = rows_w // 2, rows_s // 2
                    lo_w, lo_s = h * rows_w, h * rows_s
                    if target.half is None:
                        part = v[lo_w:lo_w + rows_w]
                quantize_into(part, w[i, lo_w:lo_w + rows_w], scale[i, lo_s:lo_s + rows_s], self.fp8)

    def _act(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """The torch implementations' activation: SwiGLU, or the clamped form (swiglu_limit)."""
        if self.swiglu_limit is None:
            return F.silu(gate) * up
        limit = self.swiglu_limit
        gate = gate.clamp(max=limit)
        return gate * torch.sigmoid(gate * self.swiglu_alpha) * (up.clamp(-limit, limit) + 1)

    def _held(self, lo: int, hi: int, dtype: torch.dtype, ids: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """w13, w2, b13, b2 of the global experts [lo, hi) (views; FP8 weights dequantized to dtype);
        ids: only those of them (indices from lo), gathered."""
        first, num = lo - self.expert_lo, hi - lo
        if ids is not None:
            ids = ids + first
        narrow = (lambda t: None if t is None else
                  (t[first:first + num] if ids is None else t.index_select(0, ids)))
        return (self.dense("w13", first, num, dtype, ids), self.dense("w2", first, num, dtype, ids),
                narrow(self.b13), narrow(self.b2))

    def _bias_kw(self, b13: torch.Tensor | None, b2: torch.Tensor | None) -> dict:
        """The bias / activation arguments of the kernels and rollout.exact.fused_experts (none for
        SwiGLU without biases, so those calls stay as they always were)."""
        if b13 is None and self.swiglu_limit is None:
            return {}
        return {"b13": b13, "b2": b2, "swiglu_limit": self.swiglu_limit, "swiglu_alpha": self.swiglu_alpha}

    def shard(self, lo: int, hi: int) -> None:
        """Keep only experts [lo, hi) (call before the weights are loaded: the values are dropped)."""
        if not 0 <= lo <= hi <= self.num_experts:
            raise ValueError(f"expert shard [{lo}, {hi}) is outside [0, {self.num_experts})")
        names = ("w13", "w2", "b13", "b2") + (() if self.fp8 is None else tuple(
            f"{n}_{self.fp8.scale_name.removeprefix('weight_')}" for n in self.SCALED))
        for name in names:
            old = getattr(self, name)
            if old is not None:
                setattr(self, name, nn.Parameter(old.new_empty(hi - lo, *old.shape[1:]), requires_grad=old.requires_grad))
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
        impl = impl or ("exact" if self.exact else self.choose_impl(x, graph_safe, topk_ids.numel(), self.large))
        run = {"exact": self._forward_exact, "exact_triton": self._forward_exact_triton, "padded": self._forward_padded, "grouped": self._forward_grouped, "loop": self._forward_loop,
               "dense": self._forward_dense, "triton": self._forward_triton}[impl]
        return run(x, topk_weights, topk_ids, lo, hi)

    # NOTE: on CPU torch's grouped GEMM runs one matmul per expert; up to this many (token, expert)
    # rows one batched matmul over experts padded to the busiest is faster for small experts (tiny
    # Qwen3-MoE, 16 experts, 2 cores: 1.5x faster at 128 tokens x top-4, 1.4x at 256 x 4, 1.9x slower
    # at 384 x 4; grouped 1.1-1.4x slower than padded from 2 to 256 tokens).
    PADDED_MAX_ROWS = 1024
    # NOTE: the cost of one more expert run on its own (a matmul pair over a view of its weights, ~8
    # torch calls: ~30 us on 2 cores), as the weight bytes streamed in that time (~25 GB/s). Experts
    # above half of it are "large": a batch-1 step runs its top-k one by one over views (3.4 MiB
    # experts: 1.9x faster than the padded gather), and more tokens run torch's grouped GEMM, which
    # reads each routed expert once, pads nothing and loops in C++ (against the padded path, which
    # ran them one by one from Python or read every held expert: 3.4 MiB experts 0.67-0.92x the time
    # from 2 to 256 tokens; 1.5 MiB 0.73-0.87x at 2 and 8 to 64 tokens, 0.96-1.09x at 4, 128, 256).
    EXPERT_CALL_BYTES = 768 << 10

    @property
    def large(self) -> bool:
        """Experts past half of EXPERT_CALL_BYTES, held unquantized (FP8 experts keep the padded
        path, which dequantizes the routed experts only)."""
        return self.fp8 is None and 2 * self.expert_bytes > self.EXPERT_CALL_BYTES

    @staticmethod
    def choose_impl(x: torch.Tensor, graph_safe: bool, rows: int = 0, large: bool = False) -> str:
        """rows: (token, expert) pairs routed; large: FusedExperts.large. "padded" (batched matmul
        over experts padded to the busiest; a lone token's large experts one by one; reads the
        counts on the host) for few rows on CPU, except several tokens over large experts;
        "grouped" (torch's grouped GEMM: two kernels for all experts, no host sync) where torch has
        it for x's device and dtype (CPU; CUDA bf16 on SM80+); else the per-expert "loop" (reads
        the expert counts on the host), or "dense" (every held expert over every row; no host
        sync) when graph_safe."""
        if x.device.type == "cpu" and not graph_safe and rows <= FusedExperts.PADDED_MAX_ROWS and not (
                large and x.shape[0] > 1):
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
        w13, w2, b13, b2 = self._held(lo, hi, x.dtype)
        # NOTE: rows past ends[-1] (other experts) are left undefined by grouped_mm: masked below
        h = F.grouped_mm(x.index_select(0, token_of), w13.transpose(1, 2), offs=ends)   # [N*K, 2I]
        if b13 is not None:
            h = h + b13.index_select(0, group[order].clamp(max=hi - lo - 1))
        gate, up = h.chunk(2, dim=-1)                                      # [N*K, I] each
        y = F.grouped_mm(self._act(gate, up), w2.transpose(1, 2), offs=ends)
        if b2 is not None:
            y = y + b2.index_select(0, group[order].clamp(max=hi - lo - 1))
        y = y * topk_weights.reshape(-1)[order, None].to(y.dtype)          # [N*K, H], as in _forward_loop
        y = torch.where(held[order, None], y, 0)
        return torch.zeros_like(x).index_add_(0, token_of, y)

    def _forward_padded(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                        lo: int, hi: int) -> torch.Tensor:
        k = topk_ids.shape[1]
        if x.shape[0] == 1 and self.large:
            return self._one_token(x, topk_weights, topk_ids, lo, hi)
        num = hi - lo
        flat_ids = topk_ids.reshape(-1)                                    # [N*K]
        if lo == 0 and hi == self.num_experts:
            group = flat_ids                                               # every routed expert is in range
        else:
            held = (flat_ids >= lo) & (flat_ids < hi)
            group = torch.where(held, flat_ids - lo, num)                  # experts not in range: last
        sorted_group, order = torch.sort(group, stable=True)               # [N*K] grouped by expert
        counts_host = torch.bincount(group, minlength=num).tolist()[:num]
        cap, rows = max(counts_host), sum(counts_host)
        if rows == 0:
            return torch.zeros_like(x)
        if rows < order.shape[0]:
            order, sorted_group = order[:rows], sorted_group[:rows]        # held rows only
        token_of = order // k                                              # [rows] token row
        active = [e for e in range(num) if counts_host[e]]
        gather = 2 * len(active) <= num or self.fp8 is not None
        if gather:
            # NOTE: only the experts routed to: a small batch reads (and dequantizes) their weights,
            # not every held expert's
            ids = torch.tensor(active, device=x.device)
            w13, w2, b13, b2 = self._held(lo, hi, x.dtype, ids)
        else:
            w13, w2, b13, b2 = self._held(lo, hi, x.dtype)
        # NOTE: row i of the sorted rows (expert e, its j-th row) goes to slot (e's index among the
        # experts run) * cap + j = i + offset[e], offset[e] = index * cap - (rows before e): host ints
        offset, start = [0] * num, 0
        for i, e in enumerate(active):
            offset[e] = (i if gather else e) * cap - start
            start += counts_host[e]
        num = len(active) if gather else num
        slot = torch.arange(rows, device=x.device) + torch.tensor(offset, device=x.device).index_select(0, sorted_group)
        padded = x.new_zeros(num * cap, x.shape[1]).index_copy_(0, slot, x.index_select(0, token_of))
        h = torch.bmm(padded.view(num, cap, -1), w13.transpose(1, 2))      # [E, cap, 2I]
        if b13 is not None:
            h = h + b13[:, None]
        gate, up = h.chunk(2, dim=-1)                                      # [E, cap, I] each
        y = torch.bmm(self._act(gate, up), w2.transpose(1, 2))             # [E, cap, H]
        if b2 is not None:
            y = y + b2[:, None]
        y = y.view(num * cap, -1).index_select(0, slot)
        y = y * topk_weights.reshape(-1).index_select(0, order)[:, None].to(y.dtype)      # as in _forward_loop
        return torch.zeros_like(x).index_add_(0, token_of, y)

    def _forward_loop(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                      lo: int, hi: int) -> torch.Tensor:
        k = topk_ids.shape[1]
        flat_ids = topk_ids.reshape(-1)                                    # [N*K]
        order = torch.argsort(flat_ids, stable=True)                       # [N*K]
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        start = sum(counts[:lo])
        rows = sum(counts[lo:hi])
        order = order[start:start + rows]                                  # the held experts' rows
        return self._each_expert(x, order // k, topk_weights.reshape(-1)[order], counts[lo:hi], lo)

    @property
    def expert_bytes(self) -> int:
        """Weight bytes of one expert (w13 and w2) as held."""
        w13, w2 = self.w13.shape, self.w2.shape   # NOTE: from the shapes: no tensor made (every forward asks)
        return (w13[1] * w13[2] + w2[1] * w2[2]) * self.w13.element_size()

    def _expert(self, x: torch.Tensor, i: int, weight: torch.Tensor) -> torch.Tensor:
        """Held expert i over rows x [n, H], times their routing weights [n, 1] (float32)."""
        w13, w2 = self.dense("w13", i, 1, x.dtype)[0], self.dense("w2", i, 1, x.dtype)[0]
        gate, up = F.linear(x, w13, None if self.b13 is None else self.b13[i]).chunk(2, dim=-1)
        y = F.linear(self._act(gate, up), w2, None if self.b2 is None else self.b2[i])  # [n, H]
        # NOTE: routing weight cast to the model dtype before the product, as HF Qwen/OLMoE do
        # (HF Mixtral multiplies in fp32 then casts; the two differ only by bf16 rounding).
        return y * weight.to(y.dtype)

    def _each_expert(self, x: torch.Tensor, token_of: torch.Tensor, weight_of: torch.Tensor,
                     counts: list[int], lo: int) -> torch.Tensor:
        """One pair of matmuls per expert routed to, over a view of its weights (nothing gathered).
        token_of / weight_of [rows]: each (token, expert) row's token and routing weight, grouped by
        expert; counts: rows per expert of [lo, lo + len(counts))."""
        out = torch.zeros_like(x)
        start = 0
        for e, cnt in enumerate(counts):
            if cnt == 0:
                continue
            rows = token_of[start:start + cnt]
            out.index_add_(0, rows, self._expert(x.index_select(0, rows), lo + e - self.expert_lo,
                                                 weight_of[start:start + cnt, None]))
            start += cnt
        return out

    def _one_token(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                   lo: int, hi: int) -> torch.Tensor:
        """_each_expert for x [1, H]: no grouping, gather or scatter (a batch-1 decode step)."""
        out = None
        weights = topk_weights[0, :, None]
        for j, e in enumerate(topk_ids[0].tolist()):
            if lo <= e < hi:
                y = self._expert(x, e - self.expert_lo, weights[j])
                out = y if out is None else out.add_(y)
        return torch.zeros_like(x) if out is None else out

    def _forward_exact(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                       lo: int, hi: int, per_slot: bool = False) -> torch.Tensor:
        w13, w2, b13, b2 = self._held(lo, hi, x.dtype)
        return exact_ops.fused_experts(x, w13, w2, topk_weights, topk_ids, lo, per_slot=per_slot,
                                       **self._bias_kw(b13, b2))

    def _forward_exact_triton(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                              lo: int, hi: int, per_slot: bool = False) -> torch.Tensor:
        from rollout.models.kernels.fused_moe_exact import fused_moe_exact  # noqa: PLC0415  (triton only when chosen)

        if self._w8a8(x):
            return self._forward_fp8(x, topk_weights, topk_ids, lo, hi, deterministic=True, per_slot=per_slot)
        w13, w2, b13, b2 = self._held(lo, hi, x.dtype)
        return fused_moe_exact(x, w13, w2, topk_weights, topk_ids, lo, per_slot=per_slot, **self._bias_kw(b13, b2))

    def exact_terms(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                    triton: bool = False) -> torch.Tensor:
        """The held experts' weighted outputs per top-k slot [N, K, H] (0 for slots routed elsewhere);
        triton: by the batch-invariant Triton kernel (moe_triton_exact.py)."""
        run = self._forward_exact_triton if triton else self._forward_exact
        return run(x, topk_weights, topk_ids, self.expert_lo, self.expert_hi, per_slot=True)

    def _forward_triton(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                        lo: int, hi: int) -> torch.Tensor:
        from rollout.models.kernels.fused_moe import fused_moe  # noqa: PLC0415  (triton only when chosen)

        if self._w8a8(x):
            return self._forward_fp8(x, topk_weights, topk_ids, lo, hi)
        w13, w2, b13, b2 = self._held(lo, hi, x.dtype)
        return fused_moe(x, w13, w2, topk_weights, topk_ids, lo, **self._bias_kw(b13, b2))

    def _w8a8(self, x: torch.Tensor) -> bool:
        """The FP8 fused MoE (W8A8, activations quantized per token group): CUDA, block scales, no biases."""
        return x.is_cuda and self.fp8 is not None and self.fp8.granularity == "block" and self.b13 is None

    def _forward_fp8(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, lo: int, hi: int,
                     deterministic: bool = False, per_slot: bool = False) -> torch.Tensor:
        from rollout.models.kernels.fused_moe_fp8 import fused_moe_fp8  # noqa: PLC0415  (triton only when chosen)

        first, num = lo - self.expert_lo, hi - lo
        held = {n: getattr(self, n)[first:first + num] for n in ("w13", "w2")}
        scales = {n: self.scale_of(n)[first:first + num] for n in ("w13", "w2")}
        return fused_moe_fp8(x, held["w13"], scales["w13"], held["w2"], scales["w2"], topk_weights, topk_ids, lo,
                             self.fp8.block, deterministic=deterministic, per_slot=per_slot)

    def _forward_dense(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                       lo: int, hi: int) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in range(lo, hi):
            w = (topk_weights * (topk_ids == e)).sum(-1)                   # [N] float32, 0 if not picked
            i = e - self.expert_lo
            w13, w2 = self.dense("w13", i, 1, x.dtype)[0], self.dense("w2", i, 1, x.dtype)[0]
            gate, up = F.linear(x, w13, None if self.b13 is None else self.b13[i]).chunk(2, dim=-1)
            y = F.linear(self._act(gate, up), w2, None if self.b2 is None else self.b2[i])  # [N, H]
            out = out + y * w[:, None].to(y.dtype)
        return out
