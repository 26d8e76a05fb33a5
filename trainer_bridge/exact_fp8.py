"""Exact mode over FP8 rollouts: the trainer computes with the weights a `--quantization fp8` engine
holds, and trains the full-precision ones under them.

``make_trainer_fp8(model)`` (after ``make_trainer_exact``) makes every weight the engine quantizes
online read, in the forward, as the engine computes with it: ``fake_quantize`` (FP8 blocks of
128 x 128, each block's scale its amax / 448, then dequantized into the compute dtype: the same
functions the engine's layers run, so the same bits), for every linear layer of
``online_quantized`` (all but the lm_head and single-output gates; the routers and norms are not
linear layers) and every expert weight (gate and up on their own block grids). The gradient is
straight through: d loss / d master weight = d loss / d quantized weight. Parameters, their names
and the state_dict keep the full-precision weights, so DeepSpeed's optimizer steps them and weight
sync pushes them, and the engine quantizes what it receives into exactly what the trainer used.

The engine's numerics this matches are its CPU ones (W8A16: activations not quantized). On CUDA a
block-scaled engine runs W8A8 (activations quantized per token group), which this does not model.
"""
from __future__ import annotations

import torch
from torch import nn

from rollout.models.quant.fp8 import ONLINE, fake_quantize, online_quantized

# architectures whose transformers expert weights are laid out as the engine's (gate_up_proj
# [E, 2I, H] gate first, down_proj [E, H, I]); gpt-oss interleaves gate and up on the last dim
EXACT_FP8_UNSUPPORTED = ("GptOssForCausalLM",)


class _StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight: torch.Tensor, halves: int) -> torch.Tensor:
        return fake_quantize(weight.detach(), ONLINE, halves)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _Fp8Weights(nn.Module):
    """Reads of the parameters named in ``fp8_halves`` (name -> halves) return their FP8 form."""

    fp8_halves: dict

    def __getattr__(self, name: str):
        value = super().__getattr__(name)
        halves = self.__dict__.get("fp8_halves", {}).get(name)
        return value if halves is None else _StraightThrough.apply(value, halves)


def make_trainer_fp8(model: nn.Module) -> int:
    """In place: model (made exact) computes with the FP8 form of every weight the engine quantizes
    online. Returns how many modules changed; ValueError for an architecture it cannot match."""
    arch = type(model).__name__
    if arch in EXACT_FP8_UNSUPPORTED:
        raise ValueError(f"exact mode with FP8 rollouts does not support {arch} (its expert layout)")
    made: dict[type, type] = {}
    changed = 0
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            halves = {"weight": 1} if online_quantized(name, module.out_features) else {}
        else:
            params = dict(module.named_parameters(recurse=False))
            halves = {k: n for k, n in (("gate_up_proj", 2), ("down_proj", 1))
                      if getattr(params.get(k), "ndim", 0) == 3}
        if not halves:
            continue
        base = type(module)
        if base not in made:
            made[base] = type(f"Fp8{base.__name__}", (_Fp8Weights, base), {})
        module.__class__ = made[base]
        module.fp8_halves = halves
        changed += 1
    return changed
