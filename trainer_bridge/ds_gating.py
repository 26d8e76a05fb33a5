"""DeepSpeed ``TopKGate`` under RouterReplay: the gating functions with only the selection swapped.

``patch_gate`` installs an instance-level ``forward`` on a ``deepspeed.moe.sharded_moe.TopKGate``
(restored by ``unpatch_gate`` on context exit). It computes the logits exactly like the original
(fp32 input, fp32 weight), takes the expert ids from the replayed routing (replay) or from the
deterministic live rule (record: arg-max / top-k of the softmax), and then mirrors DeepSpeed's
``top1gating`` / ``top2gating`` / ``topkgating`` with ``drop_tokens=False`` op for op, in both the
dense (``combine_weights, dispatch_mask``) and the ``sparse_routes`` output formats, so recording
the live ids and replaying them reproduces the original gate bit for bit.

Gate weights follow DeepSpeed's rules: top-1 uses the full-softmax probability of the expert
(no renormalisation); top-2 and top-k renormalise over the selected set. ``l_aux`` uses the live
selection (see ``trainer_bridge.router_replay``: the aux loss is always live).

Requirements (``ValueError`` otherwise): ``drop_tokens=False`` (capacity drops would make the
replayed set depend on batch composition) and no noisy gate (``noisy_gate_policy`` None: jitter
changes the logits, RSample the selection). In record mode a top-2 gate also needs
``top2_2nd_expert_sampling=False`` (a sampled 2nd expert is not a deterministic live choice).
Random token selection (``use_rts``) is a no-op without drops and is skipped, so it draws no
random numbers under the context.
"""
from __future__ import annotations

import types
from typing import Optional

import torch
import torch.nn.functional as F

__all__ = ["check_gate", "patch_gate", "unpatch_gate"]

_MISSING = object()


def check_gate(gate, name: str, mode: str) -> None:
    if gate.drop_tokens:
        raise ValueError(f"RouterReplay: DeepSpeed gate {name!r} has drop_tokens=True; replay and record "
                         "need drop_tokens=False (MoE(..., drop_tokens=False))")
    if gate.noisy_gate_policy not in (None, "None"):
        raise ValueError(f"RouterReplay: DeepSpeed gate {name!r} has noisy_gate_policy="
                         f"{gate.noisy_gate_policy!r}; replay and record need no noisy gate")
    if mode == "record" and gate.k == 2 and gate.top2_2nd_expert_sampling:
        raise ValueError(f"RouterReplay(mode='record'): DeepSpeed gate {name!r} samples its 2nd expert "
                         "(top2_2nd_expert_sampling=True); set it False to record deterministic routing")


def patch_gate(gate, rr, r):
    saved = vars(gate).get("forward", _MISSING)

    def forward(self, input, used_token=None, sparse_routes=False, use_tutel=False):
        if use_tutel:
            raise ValueError(f"RouterReplay: DeepSpeed gate {r.name!r} with use_tutel is not supported")
        input_fp32 = input.float()
        logits = F.linear(input_fp32, weight=self.wg.weight.float(), bias=None)  # [S, E]
        gates = F.softmax(logits, dim=1)
        live = _live_ids(logits, gates, self.k)  # [S, k]
        if rr._note_call(r):
            r.live = live
            if rr.keep_router_logits:
                r.logits = logits
        ids = r.replay_ids(logits.shape[0], logits.device) if rr.mode == "replay" else live
        return _gating(self, logits, gates, ids, live, used_token, sparse_routes)

    gate.forward = types.MethodType(forward, gate)
    return saved


def unpatch_gate(gate, saved) -> None:
    if saved is _MISSING:
        del gate.forward
    else:
        gate.forward = saved


def _live_ids(logits: torch.Tensor, gates: torch.Tensor, k: int) -> torch.Tensor:
    if k == 1:
        return torch.argmax(gates, dim=1).unsqueeze(1)
    if k == 2:
        first = torch.argmax(gates, dim=1)
        mask1 = F.one_hot(first, num_classes=gates.shape[1])
        second = torch.argmax(logits.masked_fill(mask1.bool(), float("-inf")), dim=1)
        return torch.stack([first, second], dim=1)
    return torch.topk(gates, k=k, dim=1)[1]


def _no_drop_capacity(exp_counts: torch.Tensor, ep_group) -> torch.Tensor:
    from deepspeed.moe.sharded_moe import bwc_tensor_model_parallel_world_size, dist, groups, pg_utils
    new_capacity = torch.max(exp_counts)
    if pg_utils.is_parallel(ep_group):
        dist.all_reduce(new_capacity, op=dist.ReduceOp.MAX, group=ep_group)
    if groups._get_expert_model_parallel_world_size() == 1:
        tp = 1 if groups.mpu is None else bwc_tensor_model_parallel_world_size(mpu=groups.mpu)
        new_capacity = torch.ceil(new_capacity / tp).mul(tp).to(new_capacity.dtype)
    return new_capacity


def _gating(gate, logits, gates, ids, live, used_token: Optional[torch.Tensor], sparse_routes: bool):
    if gate.k == 1:
        return _top1(gate, logits, gates, ids[:, 0], live[:, 0], used_token, sparse_routes)
    if gate.k == 2:
        return _top2(gate, gates, ids, live, sparse_routes)
    return _topk(gate, logits, gates, ids, live, sparse_routes)


def _top1(gate, logits, gates, indices1_s, live1, used_token, sparse_routes):
    from deepspeed.moe.sharded_moe import einsum
    num_experts = int(gates.shape[1])
    mask1 = F.one_hot(indices1_s, num_classes=num_experts)
    live_mask1 = F.one_hot(live1, num_classes=num_experts)
    if used_token is not None:
        mask1 = einsum("s,se->se", used_token, mask1)
        live_mask1 = einsum("s,se->se", used_token, live_mask1)
    exp_counts = torch.sum(mask1, dim=0).detach().to(logits.device)
    new_capacity = _no_drop_capacity(exp_counts.to(logits.device), gate.ep_group)
    capacity = min(new_capacity, torch.tensor(mask1.size(0)).to(new_capacity.device))
    me = torch.mean(gates, dim=0)
    ce = torch.mean(live_mask1.float(), dim=0)
    l_aux = torch.sum(me * ce) * num_experts
    if sparse_routes:
        indices_mask = mask1.sum(dim=1) * num_experts - 1
        indices1_s = torch.min(indices1_s, indices_mask)
    locations1 = torch.cumsum(mask1, dim=0) - 1
    if sparse_routes:
        gates1_s = (gates * mask1).sum(dim=1)
        locations1_s = torch.sum(locations1 * mask1, dim=1)
        return (l_aux, capacity, num_experts, indices1_s.to(torch.int32).unsqueeze(0),
                locations1_s.to(torch.int32).unsqueeze(0), gates1_s.unsqueeze(0), exp_counts)
    locations1_s = torch.sum(locations1 * mask1, dim=1)
    gates = gates * mask1.float()
    locations1_sc = F.one_hot(locations1_s, num_classes=capacity).float()
    combine_weights = einsum("se,sc->sec", gates, locations1_sc)
    return l_aux, combine_weights, combine_weights.bool(), exp_counts


def _top2(gate, gates, ids, live, sparse_routes):
    from deepspeed.moe.sharded_moe import einsum
    num_experts = int(gates.shape[1])
    indices1_s, indices2_s = ids[:, 0], ids[:, 1]
    mask1 = F.one_hot(indices1_s, num_classes=num_experts)
    mask2 = F.one_hot(indices2_s, num_classes=num_experts)
    locations1 = torch.cumsum(mask1, dim=0) - 1
    locations2 = torch.cumsum(mask2, dim=0) - 1
    locations2 += torch.sum(mask1, dim=0, keepdim=True)
    me = torch.mean(gates, dim=0)
    ce = torch.mean(F.one_hot(live[:, 0], num_classes=num_experts).float(), dim=0)
    l_aux = torch.mean(me * ce) * num_experts * num_experts
    exp_counts = torch.sum(mask1 + mask2, dim=0).detach().to(gates.device)
    capacity = _no_drop_capacity(exp_counts, gate.ep_group)
    locations1_s = torch.sum(locations1 * mask1, dim=1)
    locations2_s = torch.sum(locations2 * mask2, dim=1)
    mask1_float = mask1.float()
    mask2_float = mask2.float()
    gates1_s = einsum("se,se->s", gates, mask1_float)
    gates2_s = einsum("se,se->s", gates, mask2_float)
    denom_s = gates1_s + gates2_s
    denom_s = torch.clamp(denom_s, min=torch.finfo(denom_s.dtype).eps)
    gates1_s /= denom_s
    gates2_s /= denom_s
    if sparse_routes:
        indices1_s = torch.where(mask1.any(dim=1), indices1_s, torch.full_like(indices1_s, -1))
        indices2_s = torch.where(mask2.any(dim=1), indices2_s, torch.full_like(indices2_s, -1))
        return (l_aux, capacity, num_experts, torch.stack([indices1_s, indices2_s]).to(torch.int32),
                torch.stack([locations1_s, locations2_s]).to(torch.int32), torch.stack([gates1_s, gates2_s]),
                exp_counts)
    gates1 = einsum("s,se->se", gates1_s, mask1_float)
    gates2 = einsum("s,se->se", gates2_s, mask2_float)
    locations1_sc = F.one_hot(locations1_s, num_classes=capacity).float()
    locations2_sc = F.one_hot(locations2_s, num_classes=capacity).float()
    combine_weights = einsum("se,sc->sec", gates1, locations1_sc) + einsum("se,sc->sec", gates2, locations2_sc)
    return l_aux, combine_weights, combine_weights.bool(), exp_counts


def _topk(gate, logits, gates, top_idx, live, sparse_routes):
    from deepspeed.moe.sharded_moe import _stack_routes
    k = gate.k
    num_experts = int(gates.shape[1])
    mask = torch.zeros_like(gates, dtype=torch.bool).scatter_(1, top_idx, 1)
    live_mask = torch.zeros_like(gates, dtype=torch.bool).scatter_(1, live, 1)
    exp_counts = torch.sum(mask, dim=0).detach().to(logits.device)
    me = torch.mean(gates, dim=0)
    ce = torch.mean(live_mask.float(), dim=0)
    l_aux = torch.mean(me * ce) * num_experts * num_experts / k
    capacity = _no_drop_capacity(exp_counts, gate.ep_group)
    locations = torch.cumsum(mask, dim=0) - 1
    gates_masked = gates * mask
    gates_s = torch.sum(gates_masked, dim=-1, keepdim=True)
    denom_s = torch.clamp(gates_s, min=torch.finfo(gates_masked.dtype).eps)
    gates_masked = gates_masked / denom_s
    if sparse_routes:
        route_kept = mask.gather(1, top_idx)
        route_indices = torch.where(route_kept, top_idx, torch.full_like(top_idx, -1))
        route_locations = locations.gather(1, top_idx) * route_kept
        route_gates = gates_masked.gather(1, top_idx)
        return (l_aux, capacity, num_experts, _stack_routes(route_indices, torch.int32),
                _stack_routes(route_locations, torch.int32), _stack_routes(route_gates), exp_counts)
    locations_sc = F.one_hot((locations * mask), num_classes=capacity).float()
    combine_weights = torch.einsum("se,sec->sec", gates_masked, locations_sc)
    return l_aux, combine_weights, combine_weights.bool(), exp_counts
