"""SparseMoE: router + top-k routing + fused experts (+ optional gated shared expert)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rollout.forward_batch import ForwardBatch
from rollout.models.layers import GatedMLP
from rollout.models.topk import softmax_topk


class Router(nn.Module):
    """Bias-free gate linear; a module so its weight is named `gate.weight` as in HF checkpoints."""

    def __init__(self, hidden_size: int, num_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)                                    # [N, E]


class FusedExperts(nn.Module):
    """The experts' weights stacked: w13 [E_local, 2I, H] (gate rows then up rows), w2 [E_local, H, I].

    Unsharded, E_local = num_experts. Under expert parallelism (DP attention) a rank holds only the
    experts [expert_lo, expert_hi) of num_experts; routing ids stay global everywhere.
    """

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
                experts: tuple[int, int] | None = None, dense: bool = False) -> torch.Tensor:
        """x [N, H], topk_weights float32 [N, K], topk_ids int64 [N, K] (global ids) -> [N, H] in x.dtype.

        Only the experts this module holds contribute (expert parallel: the other ranks add theirs).
        experts: [lo, hi) to narrow that further (default: all held). dense: no host sync (CUDA
        graph capture): every expert in range runs over every row, weighted by zero where it was
        not picked.
        """
        lo, hi = experts if experts is not None else (self.expert_lo, self.expert_hi)
        if not self.expert_lo <= lo <= hi <= self.expert_hi:
            raise ValueError(f"experts [{lo}, {hi}) are not all held here ([{self.expert_lo}, {self.expert_hi}))")
        if dense:
            return self._forward_dense(x, topk_weights, topk_ids, lo, hi)
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
            topk_weights, topk_ids = softmax_topk(self.gate(x), self.top_k, self.renormalize,
                                                  capture=fb.capture, layer_id=self.layer_id)
            out = self.experts(x, topk_weights, topk_ids, dense=fb.graph_safe)
        else:
            # DP attention: route every rank's tokens (gathered by the executing runner's layout, so
            # the capture buffer rows sit where the capturer slices them), compute this rank's
            # experts, and sum over ranks back into this rank's own rows.
            assert (self.experts.expert_lo, self.experts.expert_hi) == ep.expert_range(self.experts.num_experts), \
                "DP attention needs the model loaded with this rank's expert shard (load_model(expert_shard=...))"
            x_all = ep.gather(x, fb.layout)                                # [layout.total_rows, H]
            topk_weights, topk_ids = softmax_topk(self.gate(x_all), self.top_k, self.renormalize,
                                                  capture=fb.capture, layer_id=self.layer_id)
            partial = self.experts(x_all, topk_weights, topk_ids, dense=fb.graph_safe)  # this rank's experts
            out = ep.reduce_own(partial, fb.layout)                        # [N, H]
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
