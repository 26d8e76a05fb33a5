"""The training loop's printout: one line per step and the summary table at the end.

Agreement numbers that exact mode drives to zero (max |train logprob - rollout logprob|, and in
exact mode the routing mismatch rates) are printed as exact numbers: ``0`` when zero, else the
float's repr, never rounded, so a last-bit difference cannot hide behind ``0.0000``.
"""
from __future__ import annotations

import math
from typing import Sequence

__all__ = ["exact_number", "step_line", "step_table"]


def exact_number(x: float) -> str:
    """``0`` when exactly zero, else the float's repr (every digit, never rounded)."""
    return "0" if x == 0 else repr(float(x))


def step_line(rec: dict, *, exact: bool = False) -> str:
    """The per-step line of ``trainer_bridge.train``; ``exact``: mismatch rates as exact numbers."""
    rate = exact_number if exact else "{:.4f}".format
    line = (f"step {rec['step']:3d}  reward {rec['reward_mean']:.3f}  len {rec['response_length_mean']:.2f}  "
            f"mismatch {rate(rec['routing_mismatch_rate'])}")
    if "no_replay/routing_mismatch_rate" in rec:
        line += f" (no replay {rate(rec['no_replay/routing_mismatch_rate'])})"
    line += f"  max|dlp| {exact_number(rec['train_rollout_logprob_max_abs_diff'])}"
    if "no_replay/train_rollout_logprob_max_abs_diff" in rec:
        line += f" (no replay {exact_number(rec['no_replay/train_rollout_logprob_max_abs_diff'])})"
    line += f"  |dlp| {rec['train_rollout_logprob_abs_diff']:.4f}  k3 {rec['k3_kl']:.2e}  F2 {rec['f_tau2']:.4f}"
    if "eval_reward" in rec:
        line += f"  held-out {rec['eval_reward']:.3f}"
    return line + f"  [rollout {rec['rollout_s']:.2f}s train {rec['train_s']:.2f}s sync {rec['sync_s']:.3f}s]"


_COLUMNS = [("step", "step", "{:d}"), ("reward", "reward_mean", "{:.3f}"), ("eval", "eval_reward", "{:.3f}"),
            ("len", "response_length_mean", "{:.2f}"), ("mismatch", "routing_mismatch_rate", "{:.4f}"),
            ("mism(noR)", "no_replay/routing_mismatch_rate", "{:.4f}"),
            ("max|dlp|", "train_rollout_logprob_max_abs_diff", None),
            ("|dlp|", "train_rollout_logprob_abs_diff", "{:.4f}"),
            ("|dlp|(noR)", "no_replay/train_rollout_logprob_abs_diff", "{:.4f}"),
            ("k3", "k3_kl", "{:.2e}"), ("k3(noR)", "no_replay/k3_kl", "{:.2e}"),
            ("F2", "f_tau2", "{:.4f}"), ("F2(noR)", "no_replay/f_tau2", "{:.4f}"),
            ("rollout_s", "rollout_s", "{:.2f}"), ("train_s", "train_s", "{:.2f}"), ("sync_s", "sync_s", "{:.3f}"),
            ("ver", "weight_version", "{}")]


def step_table(history: Sequence[dict], *, exact: bool = False) -> str:
    """The summary table, one row per step (format None: an exact number; ``exact``: the mismatch
    rates too)."""
    cols = [(h, k, None if exact and "mismatch" in k else f) for h, k, f in _COLUMNS]
    rows = [[h for h, _, _ in cols]]
    for rec in history:
        row = []
        for _, key, fmt in cols:
            v = rec.get(key)
            row.append("-" if v is None or (isinstance(v, float) and math.isnan(v))
                       else exact_number(v) if fmt is None else fmt.format(v))
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
