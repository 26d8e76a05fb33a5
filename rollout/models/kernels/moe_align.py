"""ExpertBlocks: the (token, k) pairs of a batch sorted by expert, each expert's rows padded to a block.

The grouped-GEMM kernels of rollout/models/kernels/fused_moe.py take one block of block_m rows per program,
all of one expert. Made with device ops only (no host sync, so it runs inside CUDA graphs): the
sizes are static upper bounds that depend only on the batch's shape.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, kw_only=True)
class ExpertBlocks:
    """pairs [capacity] int32: pair p = token * top_k + k, grouped by expert, each expert's run padded
    to a multiple of block_m with num_pairs (padding rows, skipped). block_expert [capacity // block_m]
    int32: the local expert of each block, -1 for blocks past the last expert's run."""

    pairs: torch.Tensor
    block_expert: torch.Tensor
    block_m: int
    num_pairs: int

    @staticmethod
    def capacity(num_pairs: int, num_experts: int, block_m: int) -> int:
        """Rows after padding, at most: every expert that gets a pair wastes at most block_m - 1 rows."""
        rows = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
        return -(-rows // block_m) * block_m

    @staticmethod
    def build(topk_ids: torch.Tensor, expert_lo: int, num_experts: int, block_m: int) -> "ExpertBlocks":
        """topk_ids [N, K] global expert ids; this rank holds experts [expert_lo, expert_lo + num_experts).
        Pairs routed to other experts appear in no block (their rank adds them)."""
        num_pairs = topk_ids.numel()
        dev = topk_ids.device
        cap = ExpertBlocks.capacity(num_pairs, num_experts, block_m)
        flat = topk_ids.reshape(-1)                                            # [P]
        held = (flat >= expert_lo) & (flat < expert_lo + num_experts)
        group = torch.where(held, flat - expert_lo, num_experts)               # [P] local expert, others last
        # NOTE: counts by scatter_add, not bincount (CUDA bincount reads the max on the host)
        counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=dev).scatter_add_(
            0, group, torch.ones_like(group))                                  # [E + 1]
        padded = (counts + block_m - 1) // block_m * block_m
        padded[num_experts] = 0
        pad_end = torch.cumsum(padded, 0)                                      # [E + 1]
        start = torch.cumsum(counts, 0) - counts                               # [E + 1]
        order = torch.argsort(group, stable=True)                              # [P] pairs by expert
        sorted_group = group.index_select(0, order)
        rank_in_group = torch.arange(num_pairs, device=dev) - start.index_select(0, sorted_group)
        dest = (pad_end - padded).index_select(0, sorted_group) + rank_in_group
        dest = torch.where(sorted_group < num_experts, dest, cap)              # other ranks' pairs: dropped
        pairs = torch.full((cap + 1,), num_pairs, dtype=torch.int32, device=dev)
        pairs.scatter_(0, dest, order.to(torch.int32))
        block_start = torch.arange(0, cap, block_m, device=dev)
        block_expert = torch.searchsorted(pad_end[:num_experts], block_start, right=True)
        block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
        return ExpertBlocks(pairs=pairs[:cap], block_expert=block_expert, block_m=block_m, num_pairs=num_pairs)
