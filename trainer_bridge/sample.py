"""``Sample``: one rollout as the trainer receives it.

Token layout: ``tokens = prompt_ids + response_ids`` (T tokens). ``routed_experts`` is
``[T - 1, num_layers, top_k]``: row p is the routing computed while processing token p; the last
token was never fed forward, so it has no row. Dense layers are all ``-1``. ``loss_mask`` and
``rollout_logprobs`` have one entry per response token (``rollout_logprobs[i]`` =
log p(response_ids[i] | tokens before it) under the rollout engine).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from .router_replay import check_routed_experts

__all__ = ["Sample"]


def _as_1d(x, dtype: torch.dtype, what: str) -> torch.Tensor:
    t = torch.as_tensor(x if x is not None else [], dtype=dtype)
    if t.ndim != 1:
        raise ValueError(f"{what} must be 1-D, got shape {list(t.shape)}")
    return t


@dataclass(kw_only=True, eq=False)
class Sample:
    prompt_ids: Any
    response_ids: Any
    loss_mask: Any = None  # per response token; None = all ones
    rollout_logprobs: Any = None  # per response token
    routed_experts: Any = None  # [T - 1, num_layers, top_k]
    weight_version: Any = None
    # [[version, first response index], ...]: which weight version sampled which response tokens
    # (meta_info.weight_versions; more than one entry when the request lived across an update)
    weight_versions: Any = None
    reward: Optional[float] = None
    group_id: Any = None
    rid: Optional[str] = None
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        self.prompt_ids = _as_1d(self.prompt_ids, torch.long, f"sample {self.rid!r}: prompt_ids")
        self.response_ids = _as_1d(self.response_ids, torch.long, f"sample {self.rid!r}: response_ids")
        if self.loss_mask is None:
            self.loss_mask = torch.ones(len(self.response_ids), dtype=torch.float32)
        else:
            self.loss_mask = _as_1d(self.loss_mask, torch.float32, f"sample {self.rid!r}: loss_mask")
        if self.rollout_logprobs is not None:
            self.rollout_logprobs = _as_1d(self.rollout_logprobs, torch.float32,
                                           f"sample {self.rid!r}: rollout_logprobs")
        if self.routed_experts is not None:
            r = torch.as_tensor(self.routed_experts)
            if r.dtype.is_floating_point or r.dtype == torch.bool:
                raise ValueError(f"sample {self.rid!r}: routed_experts must be integer, got {r.dtype}")
            self.routed_experts = r.to(torch.int32)

    @property
    def version_spans(self) -> list:
        """[[version, first response index], ...]; without weight_versions the whole response is
        weight_version's."""
        return self.weight_versions or [[self.weight_version, 0]]

    def version_mask(self, version: Any) -> torch.Tensor:
        """[response length] float32: 1 where `version` sampled the token, 0 where another one did."""
        n = len(self.response_ids)
        entries = self.version_spans
        mask = torch.zeros(n, dtype=torch.float32)
        for j, (v, first) in enumerate(entries):
            end = entries[j + 1][1] if j + 1 < len(entries) else n
            if str(v) == str(version):
                mask[int(first):int(end)] = 1.0
        return mask

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def response_length(self) -> int:
        return len(self.response_ids)

    @property
    def tokens(self) -> torch.Tensor:
        return torch.cat([self.prompt_ids, self.response_ids])

    def validate(self, num_experts: int, num_layers: int, top_k: int,
                 moe_layers: Optional[list[int]] = None) -> "Sample":
        """Check the sample on arrival; ``ValueError`` naming ``rid`` on the first problem.

        Routing: shape ``[T - 1, num_layers, top_k]``; every layer is either all ``-1`` (dense)
        or holds ``top_k`` distinct ids in ``[0, num_experts)`` per row. With ``moe_layers``
        given, exactly those layers must be valid and the others all ``-1``.
        """
        who = f"sample {self.rid!r}"
        if len(self.prompt_ids) == 0:
            raise ValueError(f"{who}: empty prompt_ids")
        if (self.prompt_ids < 0).any() or (self.response_ids < 0).any():
            raise ValueError(f"{who}: negative token id")
        n = self.response_length
        if len(self.loss_mask) != n:
            raise ValueError(f"{who}: loss_mask has {len(self.loss_mask)} entries for {n} response tokens")
        if self.rollout_logprobs is not None:
            if len(self.rollout_logprobs) != n:
                raise ValueError(f"{who}: rollout_logprobs has {len(self.rollout_logprobs)} entries for "
                                 f"{n} response tokens")
            if not torch.isfinite(self.rollout_logprobs).all():
                raise ValueError(f"{who}: rollout_logprobs holds a non-finite value")
        if self.routed_experts is None:
            raise ValueError(f"{who}: no routed_experts (request them with return_routed_experts=True)")
        want = [self.num_tokens - 1, num_layers, top_k]
        if list(self.routed_experts.shape) != want:
            raise ValueError(f"{who}: routed_experts has shape {list(self.routed_experts.shape)}, expected "
                             f"[T-1, num_layers, top_k] = {want} for T={self.num_tokens} tokens")
        if moe_layers is not None:
            dense = [i for i in range(num_layers) if i not in set(moe_layers)]
            if dense and (self.routed_experts[:, dense] != -1).any():
                raise ValueError(f"{who}: routed_experts has ids in dense layers {dense} (expected -1)")
        check_routed_experts(self.routed_experts, num_experts=num_experts, top_k=top_k,
                             moe_layers=moe_layers, what=f"{who}: routed_experts")
        return self
