"""The checkpoint quantizations the engine loads (`quantization_config.quant_method`), and the
check that refuses every other one by name before anything starts."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class QuantMethod:
    """A checkpoint quantization this engine loads: its config name and what it quantizes."""
    name: str
    description: str


QUANT_METHODS: dict[str, QuantMethod] = {
    "mxfp4": QuantMethod("mxfp4", "OCP MX FP4 expert weights with E8M0 scales per 32 (gpt-oss; quant/mxfp4.py)"),
    "fp8": QuantMethod("fp8", "float8_e4m3fn weights with block scales (weight_scale_inv) or one per tensor; "
                              "dynamic activations (quant/fp8.py)"),
    "compressed-tensors": QuantMethod("compressed-tensors", "float-quantized FP8 weights per channel, tensor or "
                                                            "block (weight_scale); dynamic activations (quant/fp8.py)"),
}


def check_quantization_config(cfg: dict) -> Optional[QuantMethod]:
    """The QuantMethod a model config (config.json as a dict) declares in `quantization_config`,
    None when it has none; ValueError naming an unsupported `quant_method` and the supported ones."""
    qc = cfg.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ValueError(f"quantization_config must be a mapping with a quant_method, got {qc!r}")
    method = qc.get("quant_method")
    if method not in QUANT_METHODS:
        raise ValueError(f"quantization_config.quant_method {method!r} is not supported; "
                         f"supported: {', '.join(sorted(QUANT_METHODS))}")
    return QUANT_METHODS[method]
