"""MXFP4 (OCP Microscaling FP4) weights, as gpt-oss checkpoints ship their expert weights.

Format: blocks of 32 values share one E8M0 scale (a uint8 biased exponent, bias 127: byte `s`
means 2**(s - 127)); each value is an E2M1 code (bit 3 sign, bits 2..1 exponent with bias 1, bit 0
mantissa), two codes per byte, the lower-indexed value in the low nibble. A checkpoint stores
`X_blocks` uint8 [..., G, 16] and `X_scales` uint8 [..., G] for a row of G * 32 values.

gpt-oss stores the experts of layer i as `model.layers.{i}.mlp.experts.gate_up_proj_blocks`
[E, 2I, H/32, 16] (+ `_scales` [E, 2I, H/32]) and `down_proj_blocks` [E, H, I/32, 16] (+ `_scales`):
output rows, input columns, quantized along the input. transformers' GptOssExperts holds the
transposes, `gate_up_proj` [E, H, 2I] (gate and up interleaved in the last dim: gate = [..., 0::2],
up = [..., 1::2]) and `down_proj` [E, I, H]. Biases (`gate_up_proj_bias`, `down_proj_bias`) are not
quantized.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import Tensor

BLOCK_SIZE = 32                      # values per E8M0 scale
BYTES_PER_BLOCK = BLOCK_SIZE // 2    # two E2M1 codes per byte
SCALE_BIAS = 127                     # E8M0 exponent bias
E2M1_MAX = 6.0
MXFP4_SUFFIXES = ("_blocks", "_scales")
EXPERT_PROJS = ("gate_up_proj", "down_proj")


def _e2m1_value(code: int) -> float:
    sign = -1.0 if code & 0b1000 else 1.0
    exp, man = (code >> 1) & 0b11, code & 0b1
    mag = 0.5 * man if exp == 0 else (1.0 + 0.5 * man) * 2.0 ** (exp - 1)
    return sign * mag


E2M1_VALUES: tuple[float, ...] = tuple(_e2m1_value(c) for c in range(16))   # code -> value (8 is -0.0)
# midpoints between consecutive magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6; a tie rounds up (away from 0)
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_ROWS_PER_CHUNK = 1 << 20            # groups dequantized at once (32 M values), bounds the temporaries


def _check_mxfp4_pair(blocks: Tensor, scales: Tensor, what: str = "") -> None:
    at = f" for {what!r}" if what else ""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8{at}, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 2 or blocks.shape[-1] != BYTES_PER_BLOCK:
        raise ValueError(f"MXFP4 blocks{at} must have shape [..., G, {BYTES_PER_BLOCK}], "
                         f"got {list(blocks.shape)}")
    if tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"MXFP4 scales{at} must have shape {list(blocks.shape[:-1])} (blocks "
                         f"{list(blocks.shape)} without the last dim), got {list(scales.shape)}")


def _pow2_float32(exp_biased: Tensor) -> Tensor:
    """2**(e - 127) as float32 for an int32 tensor e in [0, 254], built from its bits (exact)."""
    # NOTE: e == 0 is the subnormal 2**-127 (mantissa bit 22), not the 0.0 that `e << 23` gives.
    bits = torch.where(exp_biased == 0, torch.full_like(exp_biased, 1 << 22), exp_biased << 23)
    return bits.view(torch.float32)


def dequantize_mxfp4(blocks: Tensor, scales: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """blocks uint8 [..., G, 16], scales uint8 [..., G] -> `dtype` [..., G * 32], no transpose.

    Bitwise equal to transformers' MXFP4 dequantization (before its transpose): E2M1 value times
    2**(s - 127) in float32 (float64 for a float64 result), then cast to `dtype`. Scale byte 0xFF
    (NaN in E8M0) is rejected.
    """
    _check_mxfp4_pair(blocks, scales)
    if scales.numel() and int(scales.max()) == 0xFF:
        raise ValueError("MXFP4 scale byte 0xFF (E8M0 NaN) in scales")
    *prefix, groups, _ = blocks.shape
    work = torch.float64 if dtype == torch.float64 else torch.float32
    lut = torch.tensor(E2M1_VALUES, dtype=work, device=blocks.device)
    rows = blocks.reshape(-1, BYTES_PER_BLOCK)                      # [R, 16], R = prod(prefix) * G
    exps = scales.reshape(-1)                                       # [R]
    out = torch.empty(rows.shape[0], BLOCK_SIZE, dtype=dtype, device=blocks.device)
    for r0 in range(0, rows.shape[0], _ROWS_PER_CHUNK):
        r1 = min(r0 + _ROWS_PER_CHUNK, rows.shape[0])
        b = rows[r0:r1]
        codes = torch.stack((b & 0x0F, b >> 4), dim=-1).reshape(r1 - r0, BLOCK_SIZE)   # [r, 32], low nibble first
        scale = _pow2_float32(exps[r0:r1].to(torch.int32)).to(work)                   # [r]
        out[r0:r1] = (lut[codes.long()] * scale[:, None]).to(dtype)
    return out.reshape(*prefix, groups * BLOCK_SIZE)


def quantize_mxfp4(w: Tensor) -> tuple[Tensor, Tensor]:
    """w [..., K] (K a multiple of 32, finite) -> (blocks uint8 [..., K/32, 16], scales uint8 [..., K/32]).

    Scale rule (that of OpenAI's reference MXFP4 quantizer, `downcast_to_mxfp_torch` with
    ROUND_UP, which transformers uses): per group of 32, d = max|w| / 6 in float32, rounded up to
    a power of two 2**(s - 127) (s = the float32 biased exponent of d, plus 1 if d is not already a
    power of two; an all-zero group gets s = 0). Values w / 2**(s - 127) round to the nearest E2M1
    value, ties away from zero; the sign is kept, so a negative value that rounds to 0 is -0.0.
    Inputs of other float dtypes are quantized from their float32 value. dequantize(quantize(w))
    == w when w holds finite MXFP4 values with scale bytes >= 1 (a nonzero group never gets byte 0).
    """
    if not w.is_floating_point():
        raise ValueError(f"quantize_mxfp4 needs a float tensor, got {w.dtype}")
    if w.dim() < 1 or w.shape[-1] % BLOCK_SIZE:
        raise ValueError(f"quantize_mxfp4 needs a last dim that is a multiple of {BLOCK_SIZE}, "
                         f"got shape {list(w.shape)}")
    x = w.to(torch.float32).contiguous()
    if not bool(torch.isfinite(x).all()):
        raise ValueError("quantize_mxfp4 needs finite values (inf or nan found)")
    *prefix, k = x.shape
    x = x.reshape(*prefix, k // BLOCK_SIZE, BLOCK_SIZE)                     # [..., G, 32]
    d = x.abs().amax(dim=-1) / E2M1_MAX                                     # [..., G]
    bits = d.view(torch.int32)
    s = (bits >> 23) + ((bits & 0x7FFFFF) != 0).to(torch.int32)             # 0 only for d == 0; <= 253
    inv = torch.where(s == 0, torch.zeros_like(d), ((254 - s) << 23).view(torch.float32))   # 2**(127 - s)
    q = x * inv[..., None]                                                  # exact: power-of-two multiply
    mids = torch.tensor(_E2M1_MIDPOINTS, dtype=torch.float32, device=x.device)
    codes = torch.bucketize(q.abs(), mids, right=True).to(torch.uint8)      # 0..7, a tie goes up
    codes |= torch.signbit(q).to(torch.uint8) << 3
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)                     # [..., G, 16]
    return blocks.contiguous(), s.to(torch.uint8)


def dequantize_checkpoint_tensor(name_without_suffix: str, blocks: Tensor, scales: Tensor,
                                 dtype: torch.dtype = torch.float32) -> tuple[str, Tensor]:
    """A gpt-oss checkpoint's `<name>_blocks` / `<name>_scales` -> (name, tensor) as transformers'
    GptOssExperts holds it: `...experts.gate_up_proj` [E, H, 2I] (gate/up interleaved in the last
    dim, as stored) or `...experts.down_proj` [E, I, H], contiguous.

    The checkpoint stores [E, out, in/32, 16]; this dequantizes to [E, out, in] and transposes the
    last two dims, exactly as transformers' loader does.
    """
    proj = name_without_suffix.rsplit(".", 1)[-1]
    if proj not in EXPERT_PROJS:
        raise ValueError(f"MXFP4 tensor {name_without_suffix!r}: gpt-oss quantizes only the experts' "
                         f"{' and '.join(EXPERT_PROJS)}, not {proj!r}")
    _check_mxfp4_pair(blocks, scales, name_without_suffix)
    if blocks.dim() != 4:
        raise ValueError(f"MXFP4 blocks for {name_without_suffix!r} must be [experts, rows, groups, "
                         f"{BYTES_PER_BLOCK}], got {list(blocks.shape)}")
    w = dequantize_mxfp4(blocks, scales, dtype)                            # [E, out, in]
    return name_without_suffix, w.transpose(1, 2).contiguous()              # [E, in, out]


def pair_mxfp4_names(names: Iterable[str]) -> dict[str, tuple[str, str]]:
    """{base: (base + "_blocks", base + "_scales")} for every MXFP4 pair among `names`; raises
    ValueError naming each `_blocks` without its `_scales` or `_scales` without its `_blocks`."""
    blocks_sfx, scales_sfx = MXFP4_SUFFIXES
    names = set(names)
    pairs: dict[str, tuple[str, str]] = {}
    unpaired: list[str] = []
    for n in sorted(names):
        if n.endswith(blocks_sfx):
            base = n[: -len(blocks_sfx)]
            if base + scales_sfx in names:
                pairs[base] = (n, base + scales_sfx)
            else:
                unpaired.append(f"{n} (no {base + scales_sfx})")
        elif n.endswith(scales_sfx) and n[: -len(scales_sfx)] + blocks_sfx not in names:
            unpaired.append(f"{n} (no {n[: -len(scales_sfx)] + blocks_sfx})")
    if unpaired:
        raise ValueError("MXFP4 tensors without their pair: " + ", ".join(unpaired))
    return pairs
