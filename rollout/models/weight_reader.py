"""Reading one weight back by its checkpoint (HF) name, as SGLang's /get_weights_by_name returns it."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from rollout.models.loader import _experts_of, resolve, target_view
from rollout.models.quant.fp8 import FP8_DTYPE


@torch.no_grad()
def read_hf_weight(model: nn.Module, hf_name: str, truncate_size: int) -> Optional[list]:
    """The tensor stored for `hf_name` as fp32 nested lists, its first `truncate_size` entries along
    dim 0 (SGLang: `param.float().tolist()[:truncate_size]`); None when this model (or this expert
    shard) does not hold it. A tied lm_head reads the embedding, as SGLang does."""
    if hf_name == "lm_head.weight" and getattr(getattr(model, "spec", None), "tie_word_embeddings", False):
        hf_name = "model.embed_tokens.weight"
    t = resolve(model, hf_name)
    params = dict(model.named_parameters())
    if t is None or t.param not in params:
        return None
    param = params[t.param]
    experts = _experts_of(model, t.param)
    lo = 0
    if experts is not None:
        lo, hi, _ = experts
        if t.expert is None:
            if (lo, hi) != (0, experts[2]):
                return None                          # a stacked tensor this shard holds only part of
        elif not lo <= t.expert < hi:
            return None
    if param.dtype == FP8_DTYPE:     # the weight as its scales make it, not the raw FP8 codes
        owner, _, name = t.param.rpartition(".")
        module = model.get_submodule(owner)
        param = (module.dense_weight(torch.float32) if name == "weight"
                 else module.dense(name, 0, param.shape[0], torch.float32))
    view = target_view(param, t, lo)
    if view.device.type == "meta":
        return None
    return view[:truncate_size].to(device="cpu", dtype=torch.float32).tolist()
