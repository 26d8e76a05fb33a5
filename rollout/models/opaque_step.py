"""OpaqueStep: one forward's batch as an opaque object, and the two custom ops a compiled forward
runs its data-dependent parts through (`rollout::attention`, `rollout::sparse_moe`).

A torch.compile'd forward (rollout/exec/runners/compiled_backend.py) traces everything token-wise
(embedding, RoPE, norms, projections, dense MLPs, residuals, the lm_head) into one graph of a
static shape. Two parts cannot be in it: the attention core reads the step's own attention grid
(its width changes every step; DecodeCascade and segment planning read host lists), and the MoE
layer's CPU experts read the expert counts on the host (`bincount(...).tolist()`) and pick their
implementation from them. Each becomes one opaque op whose implementation is the eager code
itself, run on the step's real ForwardBatch held by the OpaqueStep; the compiled graph sees only
its tensor inputs and output shape (the fake impls below), so one forward is one graph and its
shape depends on the bucket alone.

Side effects stay inside the ops: `rollout::attention` writes the layer's k/v into the KV pool
and then attends (so the write cannot be ordered after the read), `rollout::sparse_moe` routes,
records the routed experts into the capture buffer (the same RoutingRule call as eager, same op
order) and runs the experts. Nothing in the compiled graph reads the KV pool or the capture
buffer, so no op of the graph can be moved across these writes.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch._library.opaque_object import register_opaque_type
from torch._opaque_base import OpaqueBase

from rollout.batch.forward_batch import ForwardBatch


class OpaqueStep(OpaqueBase):
    """The model and one step's ForwardBatch (without an opaque step of its own), as the ops'
    opaque input; the layers' attention masks are made on first use, once per step."""

    def __init__(self, model: torch.nn.Module, fb: ForwardBatch):
        self.model = model
        self.fb = dataclasses.replace(fb, opaque=None) if fb.opaque is not None else fb
        self._masks: list | None = None

    def mask(self, layer_id: int) -> Any:
        if self._masks is None:
            self._masks = self.model.attention_masks(self.fb)
        return self._masks[layer_id]

    def layer(self, layer_id: int) -> torch.nn.Module:
        return self.model.model.layers[layer_id]

    def __reduce__(self):
        # NOTE: only inductor's on-disk cache keys pickle a step (the example input of a compile):
        # a compiled graph never depends on which step it was compiled with, so every step
        # pickles alike (and the key never copies the step's KV pool)
        return (_step_placeholder, ())


def _step_placeholder() -> None:
    """What an unpickled OpaqueStep is: nothing (see OpaqueStep.__reduce__)."""
    return None


register_opaque_type(OpaqueStep, typ="reference")


@torch.library.custom_op("rollout::attention", mutates_args=())
def attention(step: OpaqueStep, layer_id: int, width: int, q: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor | None) -> torch.Tensor:
    """Layer layer_id's attention core -> [N, width]: writes this step's k / v into the KV pool at its
    slots, then attends over the step's grid (the eager core's forward). GQA / MHA: q [N, H, D],
    k / v [N, kvH, D], width H * D; MLA: q [N, H, R + P] (latent queries), k the latent rows
    [N, R + P] (normed latent, rotated rope key), v None, width H * R."""
    core = step.layer(layer_id).self_attn.attn
    return core(q, k, v, step.fb, step.mask(layer_id))


@attention.register_fake
def _attention_fake(step, layer_id, width, q, k, v):
    return q.new_empty(q.shape[0], width)


@torch.library.custom_op("rollout::sparse_moe", mutates_args=())
def sparse_moe(step: OpaqueStep, layer_id: int, x: torch.Tensor) -> torch.Tensor:
    """x [N, H] -> [N, H]: layer layer_id's SparseMoE (router, capture, experts, shared experts) as
    eager runs it, on the step's batch."""
    return step.layer(layer_id).mlp(x, step.fb)


@sparse_moe.register_fake
def _sparse_moe_fake(step, layer_id, x):
    return torch.empty_like(x)
