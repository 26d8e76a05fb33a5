"""The training loop's printout: one row per step under a header, and the summary table at the end.

A step row fits a terminal (under 120 characters), its numbers rounded. In exact mode the
agreement numbers that exact mode drives to zero (max |train logprob - rollout logprob| and the
routing mismatch rates, with replay and without) are printed as exact numbers instead: ``0`` when
zero, else the float's repr, never rounded, so a last-bit difference cannot hide behind
``0.0000``; the summary table likewise. Every number, unrounded, is in ``run_dir/metrics.jsonl``.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

__all__ = ["exact_number", "step_header", "step_line", "step_table"]


def exact_number(x: float) -> str:
    """``0`` when exactly zero, else the float's repr (every digit, never rounded)."""
    return "0" if x == 0 else repr(float(x))


# (header, key, format, width): one row per step under a header (format None: an exact number)
_STEP_COLUMNS = [("step", "step", "{:d}", 4), ("reward", "reward_mean", "{:.3f}", 6),
                 ("len", "response_length_mean", "{:.1f}", 5),
                 ("mismatch", "routing_mismatch_rate", "{:.4f}", 8),
                 ("mism(noR)", "no_replay/routing_mismatch_rate", "{:.4f}", 9),
                 ("max|dlp|", "train_rollout_logprob_max_abs_diff", "{:.3g}", 8),
                 ("max(noR)", "no_replay/train_rollout_logprob_max_abs_diff", "{:.3g}", 8),
                 ("|dlp|", "train_rollout_logprob_abs_diff", "{:.4f}", 6), ("k3", "k3_kl", "{:.1e}", 7),
                 ("F2", "f_tau2", "{:.4f}", 6), ("eval", "eval_reward", "{:.3f}", 5),
                 ("rollout", "rollout_s", "{:.1f}s", 7), ("train", "train_s", "{:.1f}s", 6),
                 ("sync", "sync_s", "{:.2f}s", 6)]
_EXACT_KEYS = ("routing_mismatch_rate", "no_replay/routing_mismatch_rate", "train_rollout_logprob_max_abs_diff",
               "no_replay/train_rollout_logprob_max_abs_diff")


def _step_columns(rec: dict, exact: bool) -> list[tuple[str, str, Optional[str], int]]:
    """The columns of a run's step rows: the no-replay ones only when the run measures them;
    ``exact``: the agreement numbers exact mode drives to zero as exact numbers."""
    return [(h, k, None if exact and k in _EXACT_KEYS else f, w) for h, k, f, w in _STEP_COLUMNS
            if not k.startswith("no_replay/") or k in rec]


def step_header(rec: dict, *, exact: bool = False) -> str:
    """The header above the step rows (``rec``: any step's record, for which columns exist)."""
    return "  ".join(h.rjust(w) for h, _, _, w in _step_columns(rec, exact))


def step_line(rec: dict, *, exact: bool = False) -> str:
    """The row of one step of ``trainer_bridge.train``, under ``step_header``: under 120 characters,
    the agreement numbers rounded; ``exact``: those printed as exact numbers (``0``, else every
    digit, which widens the row)."""
    cells = []
    for _, key, fmt, width in _step_columns(rec, exact):
        v = rec.get(key)
        text = ("-" if v is None or (isinstance(v, float) and math.isnan(v))
                else exact_number(v) if fmt is None else fmt.format(v))
        cells.append(text.rjust(width))
    return "  ".join(cells)


_COLUMNS = [("step", "step", "{:d}"), ("reward", "reward_mean", "{:.3f}"), ("eval", "eval_reward", "{:.3f}"),
            ("len", "response_length_mean", "{:.2f}"), ("mismatch", "routing_mismatch_rate", "{:.4f}"),
            ("mism(noR)", "no_replay/routing_mismatch_rate", "{:.4f}"),
            ("max|dlp|", "train_rollout_logprob_max_abs_diff", "{:.3g}"),
            ("|dlp|", "train_rollout_logprob_abs_diff", "{:.4f}"),
            ("|dlp|(noR)", "no_replay/train_rollout_logprob_abs_diff", "{:.4f}"),
            ("k3", "k3_kl", "{:.2e}"), ("k3(noR)", "no_replay/k3_kl", "{:.2e}"),
            ("F2", "f_tau2", "{:.4f}"), ("F2(noR)", "no_replay/f_tau2", "{:.4f}"),
            ("rollout_s", "rollout_s", "{:.2f}"), ("train_s", "train_s", "{:.2f}"), ("sync_s", "sync_s", "{:.3f}"),
            ("ver", "weight_version", "{}")]


def step_table(history: Sequence[dict], *, exact: bool = False) -> str:
    """The summary table, one row per step; ``exact``: max |dlp| and the mismatch rates as exact
    numbers (rounded otherwise)."""
    cols = [(h, k, None if exact and (k in _EXACT_KEYS or "mismatch" in k) else f) for h, k, f in _COLUMNS]
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
