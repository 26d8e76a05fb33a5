"""The kernel backends an engine can choose (attention, MoE) and which this machine can run, and
the online weight quantizations: names and device / install checks only, no model code (the
backends themselves are rollout/models/attention/backend.py and the MoE block's moe_backend;
quantization is rollout/models/quant/)."""
from __future__ import annotations

import importlib.util
import os

MOE_BACKENDS = ("torch", "triton")
ATTENTION_BACKENDS = ("torch", "triton", "flashinfer")
QUANTIZATIONS = ("fp8",)   # online weight quantization (rollout/models/quant/)


def flashinfer_importable() -> bool:
    return importlib.util.find_spec("flashinfer") is not None


def default_attention_backend(device: str) -> str:
    """CUDA: flashinfer when it is installed, else triton; CPU: torch."""
    if device.startswith("cuda"):
        return "flashinfer" if flashinfer_importable() else "triton"
    return "torch"


def check_attention_backend(name: str, device: str) -> None:
    """ValueError (naming attention_backend) when this machine cannot run `name` on `device`."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
    cuda = device.startswith("cuda")
    if name == "flashinfer":
        if not cuda:
            raise ValueError(f"attention_backend='flashinfer' needs a CUDA device, got device={device!r}; "
                             f"allowed on CPU: 'torch', or 'triton' under TRITON_INTERPRET=1")
        if not flashinfer_importable():
            raise ValueError("attention_backend='flashinfer' but flashinfer is not installed "
                             "(pip install flashinfer-python, or choose 'triton' or 'torch')")
    if name == "triton":
        if importlib.util.find_spec("triton") is None:
            raise ValueError("attention_backend='triton' but triton is not installed (choose 'torch')")
        if not cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"attention_backend='triton' on device={device!r} runs only under the Triton "
                             f"interpreter (set TRITON_INTERPRET=1 before starting); allowed on CPU: 'torch'")
