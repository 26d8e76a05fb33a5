"""rollout.exact: the batch-invariant ops of deterministic inference, public for trainers.

The engine's models call these when `enable_deterministic_inference` is on, and a trainer that
wants the engine's numbers bit for bit calls the same functions (docs/trainer.md): a token's
result depends only on its own inputs and position, never on the rest of the batch.
"""
from rollout.exact.attention import K_TILE, Q_TILE, attention
from rollout.exact.experts import SWIGLU_ALPHA, fused_experts, sum_slots, swiglu
from rollout.exact.matmul import ROW_TILE, grouped_linear, linear
from rollout.exact.modules import ExactLinear, make_exact
from rollout.exact.pointwise import log_softmax, rms_norm, sigmoid, silu, softmax

__all__ = ["ExactLinear", "K_TILE", "Q_TILE", "ROW_TILE", "SWIGLU_ALPHA", "attention", "fused_experts", "grouped_linear",
           "linear", "log_softmax", "make_exact", "rms_norm", "sigmoid", "silu", "softmax", "sum_slots", "swiglu"]
