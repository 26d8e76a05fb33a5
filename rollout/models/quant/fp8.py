"""FP8 (float8_e4m3fn) weights: the schemes checkpoints declare, quantize / dequantize, and
Fp8Linear, a linear layer that holds its weight in FP8 with its scales.

Schemes (`quantization_config`):
- `quant_method: "fp8"` with `weight_block_size: [b0, b1]` (DeepSeek-V3, Kimi-K2, GLM-4.5,
  MiniMax-M2, the Qwen3 FP8 releases): `X.weight` FP8 [out, in] and `X.weight_scale_inv` fp32
  [ceil(out / b0), ceil(in / b1)]; the float weight is `weight * weight_scale_inv` per block.
- `quant_method: "compressed-tensors"`, format `float-quantized` (RedHat's FP8 releases): weights
  of strategy `channel` (`X.weight_scale` [out, 1]), `tensor` ([1]) or `block`.
Activations are dynamic in every supported scheme (static input scales are refused by name).
Which modules are FP8 follows the checkpoint: a linear is FP8 when the checkpoint holds its scale.
Online quantization (`quantization="fp8"` on a float checkpoint) uses blocks of 128 x 128 for
every linear and expert weight but the router, the norms, the embeddings and the lm_head.

Numerics: on CPU (and for per-channel / per-tensor scales) the weight is dequantized into the
compute dtype and multiplied (W8A16); on CUDA, block-scaled weights run W8A8 as SGLang does: the
activations quantized per token group of the block's width (dynamic), the Triton block-scaled GEMM
(kernels/fp8_gemm.py) and the FP8 fused MoE (kernels/fused_moe_fp8.py). The weights stay in FP8
in memory (half of bf16's bytes).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from rollout import exact as exact_ops

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0                       # the largest finite float8_e4m3fn
ONLINE_BLOCK = (128, 128)
GRANULARITIES = ("block", "channel", "tensor")


@dataclass(frozen=True, kw_only=True)
class Fp8Scheme:
    granularity: str                  # "block" | "channel" | "tensor"
    block: tuple[int, int] | None = None
    ignore: tuple[str, ...] = ()      # module names ("re:" prefix: a regex) never quantized

    def __post_init__(self):
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"FP8 weight strategy must be one of {GRANULARITIES}, got {self.granularity!r}")
        if (self.granularity == "block") != (self.block is not None):
            raise ValueError("FP8 block scales need a block size (weight_block_size), and only they do")
        if self.block is not None and (len(self.block) != 2 or min(self.block) < 1):
            raise ValueError(f"weight_block_size must be two positive integers, got {list(self.block)}")

    @property
    def scale_name(self) -> str:
        return "weight_scale_inv" if self.granularity == "block" else "weight_scale"

    def scale_shape(self, out: int, inp: int) -> tuple[int, ...]:
        if self.granularity == "block":
            return (math.ceil(out / self.block[0]), math.ceil(inp / self.block[1]))
        return (out, 1) if self.granularity == "channel" else (1,)

    def ignored(self, module_name: str) -> bool:
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                if re.fullmatch(pattern[3:], module_name):
                    return True
            elif module_name == pattern or module_name.endswith("." + pattern) or pattern.endswith("." + module_name):
                return True
        return False


ONLINE = Fp8Scheme(granularity="block", block=ONLINE_BLOCK)


def scheme_from_config(cfg: dict) -> Fp8Scheme | None:
    """The FP8 scheme a config.json declares (None: not an FP8 checkpoint); ValueError naming
    what is not supported."""
    qc = cfg.get("quantization_config")
    if not isinstance(qc, dict):
        return None
    method = qc.get("quant_method")
    if method == "fp8":
        if qc.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"quantization_config.fmt {qc['fmt']!r} is not supported (only 'e4m3')")
        if qc.get("activation_scheme", "dynamic") != "dynamic":
            raise ValueError(f"quantization_config.activation_scheme {qc['activation_scheme']!r} is not "
                             f"supported (only 'dynamic')")
        block = qc.get("weight_block_size")
        ignore = tuple(qc.get("modules_to_not_convert") or qc.get("ignored_layers") or ())
        if block is None:
            return Fp8Scheme(granularity="tensor", ignore=ignore)
        return Fp8Scheme(granularity="block", block=tuple(int(b) for b in block), ignore=ignore)
    if method == "compressed-tensors":
        fmt = qc.get("format")
        if fmt != "float-quantized":
            raise ValueError(f"compressed-tensors format {fmt!r} is not supported (only 'float-quantized': FP8)")
        groups = list((qc.get("config_groups") or {}).values())
        if len(groups) != 1:
            raise ValueError(f"compressed-tensors: exactly one config group is supported, got {len(groups)}")
        weights, acts = groups[0].get("weights") or {}, groups[0].get("input_activations")
        if weights.get("num_bits") != 8 or weights.get("type") != "float":
            raise ValueError(f"compressed-tensors weights must be 8-bit float, got {weights}")
        if acts is not None and not acts.get("dynamic", False):
            raise ValueError("compressed-tensors static input activation scales are not supported (only dynamic)")
        strategy = weights.get("strategy", "tensor")
        block = weights.get("block_structure") if strategy == "block" else None
        return Fp8Scheme(granularity=strategy, block=tuple(block) if block else None,
                         ignore=tuple(qc.get("ignore") or ()))
    return None


def fp8_finite(t: torch.Tensor) -> bool:
    """Whether a float8_e4m3fn tensor holds no NaN (its only non-finite value: the bits S.1111.111;
    torch has no isfinite for float8)."""
    flat = t.reshape(-1).view(torch.uint8)
    return not any(bool(((flat[i:i + SLAB_ELEMENTS] & 0x7F) == 0x7F).any())       # NOTE: by slabs: small temporaries
                   for i in range(0, flat.numel(), SLAB_ELEMENTS))


def _expand(scale: torch.Tensor, shape: tuple[int, int], scheme: Fp8Scheme) -> torch.Tensor:
    """scale broadcast to a weight of shape [out, in] (fp32)."""
    if scheme.granularity != "block":
        return scale.float()
    b0, b1 = scheme.block
    return scale.float().repeat_interleave(b0, 0)[:shape[0]].repeat_interleave(b1, 1)[:, :shape[1]]


def dequantize(weight: torch.Tensor, scale: torch.Tensor, scheme: Fp8Scheme,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """FP8 weight [..., out, in] with its scales [..., *scale_shape] -> the float weight in dtype
    (weight x scale in fp32, element by element). Block scales multiply a block view of the
    weight in place (no scale tensor of the weight's size; the edge blocks padded), so the cost is
    one pass over the weight, stacked experts included."""
    w = weight.float()
    if scheme.granularity != "block":
        return w.mul_(scale.float()).to(dtype)       # [out, 1] (per channel, also stacked) or [1]
    b0, b1 = scheme.block
    *lead, out, inp = w.shape
    rows, cols = math.ceil(out / b0), math.ceil(inp / b1)
    if rows * b0 != out or cols * b1 != inp:
        w = F.pad(w, (0, cols * b1 - inp, 0, rows * b0 - out))
    blocks = w.view(*lead, rows, b0, cols, b1).mul_(scale.float().view(*lead, rows, 1, cols, 1))
    return blocks.view(*lead, rows * b0, cols * b1)[..., :out, :inp].to(dtype).contiguous()


def quantize(weight: torch.Tensor, scheme: Fp8Scheme) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [out, in] -> (FP8 weight, fp32 scale): each block's (row's, tensor's) scale
    is its amax / 448 (1 for an all-zero block), the values rounded to nearest in float8_e4m3fn."""
    if not torch.isfinite(weight).all():
        raise ValueError("cannot quantize a weight with NaN or infinite values to FP8")
    w = weight.float()
    out, inp = w.shape
    if scheme.granularity == "block":
        b0, b1 = scheme.block
        rows, cols = math.ceil(out / b0), math.ceil(inp / b1)
        padded = F.pad(w.abs(), (0, cols * b1 - inp, 0, rows * b0 - out))
        amax = padded.view(rows, b0, cols, b1).amax(dim=(1, 3))                 # [rows, cols]
    elif scheme.granularity == "channel":
        amax = w.abs().amax(dim=1, keepdim=True)                                # [out, 1]
    else:
        amax = w.abs().amax().reshape(1)                                        # [1]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (w / _expand(scale, (out, inp), scheme)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


# NOTE: quantize() makes about five fp32 temporaries of its input; a tile of this many values keeps
# them near 2.5 MiB, inside the margin of a weight update's bound (one bucket beyond the model)
SLAB_ELEMENTS = 1 << 17


@torch.no_grad()
def quantize_into(weight: torch.Tensor, q_out: torch.Tensor, scale_out: torch.Tensor, scheme: Fp8Scheme) -> None:
    """quantize(weight, scheme) written into q_out [out, in] and scale_out, the same bits, a tile at
    a time (whole blocks; whole rows for channel and tensor scales): the temporaries are one
    tile's, never the whole weight's. Raises before anything is written when the weight holds NaN
    or infinite values."""
    out, inp = weight.shape
    if weight.numel():
        lo, hi = torch.aminmax(weight)                 # NOTE: no temporary of the weight's size
        if not bool(torch.isfinite(lo) & torch.isfinite(hi)):
            raise ValueError("cannot quantize a weight with NaN or infinite values to FP8")
    if scheme.granularity == "block":
        b0, b1 = scheme.block
        cols = min(inp, max(1, SLAB_ELEMENTS // (b0 * b1)) * b1)
        rows = min(out, max(1, SLAB_ELEMENTS // max(b0 * cols, 1)) * b0)
        for r0 in range(0, out, rows):
            for c0 in range(0, inp, cols):
                q, sc = quantize(weight[r0:r0 + rows, c0:c0 + cols], scheme)
                q_out[r0:r0 + rows, c0:c0 + cols].copy_(q)
                scale_out[r0 // b0:r0 // b0 + sc.shape[0], c0 // b1:c0 // b1 + sc.shape[1]].copy_(sc)
        return
    rows = max(1, SLAB_ELEMENTS // max(inp, 1))
    if scheme.granularity == "tensor":
        amax = torch.maximum(-lo.float(), hi.float()).reshape(1) if weight.numel() else torch.zeros(1)
        scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        for r0 in range(0, out, rows):
            q_out[r0:r0 + rows].copy_((weight[r0:r0 + rows].float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE))
        scale_out.copy_(scale)
        return
    for r0 in range(0, out, rows):
        q, sc = quantize(weight[r0:r0 + rows], scheme)
        q_out[r0:r0 + rows].copy_(q)
        scale_out[r0:r0 + rows].copy_(sc)


class Fp8Linear(nn.Module):
    """A linear layer whose weight is FP8 [out, in] with its scale (`weight_scale_inv` for block
    scales, else `weight_scale`); the bias, if any, in the model's dtype. Same HF names as the
    nn.Linear it replaces, plus the scale."""

    exact = False   # rollout.exact.linear (deterministic inference)

    def __init__(self, in_features: int, out_features: int, bias: bool, scheme: Fp8Scheme,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        self.in_features, self.out_features, self.scheme = in_features, out_features, scheme
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE), requires_grad=False)
        self.register_parameter(scheme.scale_name, nn.Parameter(
            torch.empty(scheme.scale_shape(out_features, in_features), dtype=torch.float32), requires_grad=False))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None

    @property
    def scale(self) -> torch.Tensor:
        return getattr(self, self.scheme.scale_name)

    def _apply(self, fn, recurse=True):
        # NOTE: model.to(dtype) must leave the FP8 weight and its fp32 scale as they are
        super()._apply(fn, recurse)
        if self.weight.dtype != FP8_DTYPE:
            self.weight.data = self.weight.data.to(FP8_DTYPE)
        if self.scale.dtype != torch.float32:
            self.scale.data = self.scale.data.float()
        return self

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(self.weight, self.scale, self.scheme, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and self.scheme.granularity == "block":
            # W8A8: activations quantized per token group of the block's width, block-scaled GEMM
            from rollout.models.kernels.fp8_gemm import apply_w8a8_block_fp8_linear  # noqa: PLC0415

            return apply_w8a8_block_fp8_linear(x, self.weight, self.scale, self.scheme.block, self.bias,
                                               deterministic=self.exact)
        w = self.dense_weight(x.dtype)
        return (exact_ops.linear if self.exact else F.linear)(x, w, self.bias)

    @torch.no_grad()
    def write_float(self, name: str, target, value: torch.Tensor, expert_lo: int = 0) -> None:
        """Quantizes a float weight [out, in] into this layer (a weight update or online quantization)."""
        assert name == "weight", name
        quantize_into(value, self.weight, self.scale, self.scheme)


def fake_quantize(weight: torch.Tensor, scheme: Fp8Scheme = ONLINE, halves: int = 1) -> torch.Tensor:
    """The weight a model computes with after quantizing the float `weight` [out, in] (or experts'
    [E, out, in]) to FP8: dequantize(quantize(weight)) in weight's dtype, the same bits as the
    engine's layers give (Fp8Linear.dense_weight, FusedExperts.dense). halves=2: gate and up
    stacked on dim -2, each quantized on its own block grid (w13)."""
    if weight.dim() > 2:
        return torch.stack([fake_quantize(w, scheme, halves) for w in weight])
    if halves > 1:
        return torch.cat([fake_quantize(part, scheme) for part in weight.chunk(halves, dim=0)], dim=0)
    return dequantize(*quantize(weight, scheme), scheme, weight.dtype)


def online_quantized(name: str, out_features: int, scheme: Fp8Scheme = ONLINE) -> bool:
    """Whether online quantization makes the linear layer `name` FP8: every one but the lm_head,
    the scheme's ignored ones and single-output gates (a router is not a linear layer here)."""
    return name != "lm_head" and not scheme.ignored(name) and out_features >= 2


def dense_weight(linear: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """A linear layer's weight in dtype, dequantized when it is FP8 (for code that reads weights)."""
    return linear.dense_weight(dtype) if isinstance(linear, Fp8Linear) else linear.weight


def quantize_linears(model: nn.Module, scheme: Fp8Scheme, names: set[str] | None = None) -> int:
    """Replaces (on the meta device, before loading) the nn.Linear modules of model by Fp8Linear:
    those in `names` (a checkpoint's FP8 modules), or with names=None every one but the lm_head
    and the scheme's ignored ones (online quantization). Returns how many."""
    count = 0
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            full = f"{parent_name}.{child_name}" if parent_name else child_name
            if type(child) is not nn.Linear:
                continue
            if names is not None and full not in names:
                continue
            if names is None and not online_quantized(full, child.out_features, scheme):
                continue
            setattr(parent, child_name, Fp8Linear(child.in_features, child.out_features, child.bias is not None,
                                                  scheme, dtype=child.weight.dtype).to(device=child.weight.device))
            count += 1
    return count
