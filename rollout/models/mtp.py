"""MultiTokenPredictor: a checkpoint's multi-token-prediction (MTP) layer, NEXTN's draft.

DeepSeek-V3/R1 and GLM-4.5 checkpoints carry `num_nextn_predict_layers` MTP layers after the
decoder, as `model.layers.{N}.*` (N = num_hidden_layers). At position i the layer reads the
target's final-normed hidden state h_i and the embedding of the token after it, t_{i+1}:

    x = eh_proj([enorm(embed(t_{i+1})), hnorm(h_i)])  ->  a decoder layer (attention over the MTP's
    own KV of positions <= i, then its MLP or MoE)  ->  shared_head.norm  ->  the target's lm_head

and predicts t_{i+2}. Chained drafts feed its own normed output back as the next position's h.

`attach_mtp` makes the first MTP layer a part of the model (`model.mtp`), so that loading, FP8,
weight updates (any of their paths), release_memory_occupation and the MoE backend treat its
weights as the model's: checkpoint names `model.layers.{N}.*` map to it. The embeddings and the
head are the model's own (layer N's copies of them are the same tensors and are not read); only
the first MTP layer is used (SGLang does the same). Its experts are never expert-sharded (the
drafter runs it without collectives).
"""
from __future__ import annotations

import dataclasses
import re
from typing import Sequence

import torch
from torch import nn

from rollout.batch.forward_batch import ForwardBatch
from rollout.models.causal_lm import DecoderLayer, MoeCausalLM
from rollout.models.layers import RMSNorm, RotaryEmbedding
from rollout.models.spec import ModelSpec

_SHARED = ("embed_tokens", "shared_head.head")   # layer N's copies of the model's embeddings and head
_OWN = ("enorm", "hnorm", "eh_proj", "shared_head.norm")


class MultiTokenPredictor(nn.Module):
    def __init__(self, spec: ModelSpec, is_moe: bool):
        """spec: the model's; is_moe: whether the MTP layer's MLP is routed (the checkpoint holds experts)."""
        super().__init__()
        # the MTP layer as a one-layer decoder: its attention KV is layer 0 of the drafter's own pool
        self.spec = dataclasses.replace(spec, num_hidden_layers=1, moe_layer_ids=(0,) if is_moe else (),
                                        sliding_windows=(), skipped_checkpoint_layers=())
        h = spec.hidden_size
        self.enorm = RMSNorm(h, spec.rms_norm_eps)
        self.hnorm = RMSNorm(h, spec.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.block = DecoderLayer(self.spec, 0)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(h, spec.rms_norm_eps)
        self.rotary = RotaryEmbedding(spec.rotary_dim, spec.rope_theta, spec.rope_scaling)
        self._owner: tuple = ()   # the model it belongs to (its embeddings and head), not a submodule

    @torch.no_grad()
    def forward(self, fb: ForwardBatch, hidden: torch.Tensor) -> torch.Tensor:
        """fb's input_ids: the tokens t_{i+1}; hidden [N, hidden]: h_i -> normed outputs [N, hidden]."""
        owner = self._owner[0]
        e = owner.model.embed_tokens(fb.input_ids)
        x = self.eh_proj(torch.cat((self.enorm(e), self.hnorm(hidden.to(e.dtype))), dim=-1))
        cos, sin = self.rotary.rotation(fb.positions, x.dtype)
        return self.shared_head.norm(self.block(x, cos, sin, fb))

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        return self._owner[0].logits(normed)


def attach_mtp(model: MoeCausalLM, cfg: dict, checkpoint_names: Sequence[str], source: str) -> None:
    """Adds the checkpoint's first MTP layer to the (unloaded) model as model.mtp; ValueError naming
    speculative_algorithm when the checkpoint has none."""
    spec = model.spec
    layer = spec.num_hidden_layers
    prefix = f"model.layers.{layer}."
    names = [n for n in checkpoint_names if n.startswith(prefix)]
    nextn = int(cfg.get("num_nextn_predict_layers") or 0)
    if nextn < 1 or not names:
        raise ValueError(f"speculative_algorithm='NEXTN' needs the checkpoint's multi-token-prediction layers: "
                         f"{source} has num_nextn_predict_layers={nextn} and {len(names)} tensors {prefix}*; "
                         f"use NGRAM, or STANDALONE with a draft checkpoint")
    is_moe = any(n.startswith((prefix + "mlp.gate.", prefix + "mlp.experts.")) for n in names)
    model.mtp = MultiTokenPredictor(spec, is_moe)
    model.mtp._owner = (model,)
    n = re.escape(str(layer))
    model.spec = dataclasses.replace(spec, skipped_checkpoint_layers=tuple(
        i for i in spec.skipped_checkpoint_layers if i != layer))
    model.checkpoint_skip = re.compile(rf"^model\.layers\.{n}\.({'|'.join(map(re.escape, _SHARED))})\.")
    model.hf_renames = ((rf"^model\.layers\.{n}\.({'|'.join(map(re.escape, _OWN))})\.", r"mtp.\1."),
                        (rf"^model\.layers\.{n}\.", "mtp.block."), *type(model).hf_renames)
