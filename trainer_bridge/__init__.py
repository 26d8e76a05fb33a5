"""The trainer's side: samples, packing, router replay (R3), RL losses and metrics."""
from .losses import (LossConfig, grpo_advantages, kl_k3, masked_mean, policy_loss, rl_loss,
                     router_alignment_loss, token_entropy, token_logprobs)
from .metrics import (k3_kl, logprob_abs_diff, ratio_outside, response_length_mean, reward_mean,
                      routing_mismatch_rate, step_metrics)
from .packing import PackedBatch, enable_packed_masks, pack_samples
from .router_replay import RouterReplay, check_routed_experts
from .sample import Sample

__all__ = [
    "RouterReplay", "check_routed_experts", "Sample", "PackedBatch", "enable_packed_masks", "pack_samples",
    "LossConfig", "grpo_advantages", "kl_k3", "masked_mean", "policy_loss", "rl_loss",
    "router_alignment_loss", "token_entropy", "token_logprobs",
    "k3_kl", "logprob_abs_diff", "ratio_outside", "response_length_mean", "reward_mean",
    "routing_mismatch_rate", "step_metrics",
]
