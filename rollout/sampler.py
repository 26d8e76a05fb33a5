"""Sampler: picks each request's next token from fp32 logits and computes its logprobs.

Randomness is counter-based: one uniform number per (seed, position), a hash of the two, picks
the token by inverse CDF of the processed distribution. So a sampled token depends only on the
request's seed, position and logits, never on the other requests in the batch or on how often
the engine stepped (retraction resumes exactly).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from rollout.sampling_params import SamplingParams

_M32 = 0xFFFFFFFF


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    # NOTE: values stay in [0, 2^32) inside int64; products wrap, and the mask keeps the low bits.
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def counter_uniform(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Uniform(0, 1) noise [B] float64 from (seed [B], position [B]): 53 hashed bits, never 0 or 1."""
    lo, hi = seeds & _M32, (seeds >> 32) & _M32
    h1 = _fmix32(_fmix32(positions & _M32) ^ lo)
    h1 = _fmix32((h1 + hi * 0x27D4EB2F) & _M32)
    h2 = _fmix32((h1 + 0x9E3779B9) & _M32)
    bits = ((h1 >> 6) << 27) | (h2 >> 5)                                       # 26 + 27 bits
    return (bits.to(torch.float64) + 0.5) * (1.0 / 2.0**53)


def inverse_cdf(logprobs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Token ids [B]: row b's first token whose cumulative probability exceeds u[b] (exact
    sampling from exp(logprobs); tokens at -inf are never picked). Rows are independent."""
    cdf = torch.cumsum(torch.exp(logprobs.to(torch.float64)), dim=-1)           # [B, V]
    target = (u * cdf[:, -1])[:, None]                                           # [B, 1]
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=logprobs.shape[1] - 1)


@dataclass(frozen=True)
class SampleResult:
    next_ids: torch.Tensor                         # [B] int64
    logprobs: torch.Tensor                         # [B] float32, of next_ids under each row's mode
    top_ids: Optional[torch.Tensor] = None         # [B, max_top] int64
    top_logprobs: Optional[torch.Tensor] = None    # [B, max_top] float32


def _apply_penalties(logits: torch.Tensor, params: Sequence[SamplingParams],
                     output_ids: Sequence[Sequence[int]]) -> torch.Tensor:
    rows = [i for i, p in enumerate(params) if p.has_penalty and output_ids[i]]
    if not rows:
        return logits
    logits = logits.clone()
    vocab = logits.shape[1]
    for i in rows:  # NOTE: only rows that ask for penalties; most RL requests skip this loop.
        p = params[i]
        counts = torch.bincount(torch.tensor(output_ids[i], dtype=torch.int64), minlength=vocab)[:vocab]
        seen = counts > 0
        row = logits[i]
        if p.repetition_penalty != 1.0:
            row = torch.where(seen, torch.where(row > 0, row / p.repetition_penalty,
                                                row * p.repetition_penalty), row)
        row = row - p.frequency_penalty * counts.to(row.dtype) - p.presence_penalty * seen.to(row.dtype)
        logits[i] = row
    return logits


def _truncate(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
              min_p: torch.Tensor) -> torch.Tensor:
    """Masks (to -inf) tokens outside each row's top-k / top-p / min-p set. scaled: [B, V]."""
    vocab = scaled.shape[1]
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    rank = torch.arange(vocab)[None, :]
    k = torch.where(top_k <= 0, torch.full_like(top_k, vocab), top_k.clamp(max=vocab))
    drop = rank >= k[:, None]
    cum_before = torch.cumsum(probs, dim=-1) - probs
    drop |= cum_before >= top_p[:, None]
    drop |= probs < (min_p[:, None] * probs[:, :1])
    drop[:, 0] = False
    masked_sorted = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(scaled).scatter_(1, order, masked_sorted)


def sample(logits: torch.Tensor, params: Sequence[SamplingParams], seeds: Sequence[int],
           positions: Sequence[int], output_ids: Sequence[Sequence[int]],
           banned_ids: Sequence[Sequence[int]], top_logprobs_num: Sequence[int]) -> SampleResult:
    """logits: [B, V] fp32. banned_ids[b]: tokens masked for row b (eos/stop before min_new_tokens)."""
    logits = logits.float()
    bsz, vocab = logits.shape
    logits = _apply_penalties(logits, params, output_ids)
    if any(banned_ids):
        logits = logits.clone()
        for i, ids in enumerate(banned_ids):
            if ids:
                logits[i, list(ids)] = float("-inf")
    is_greedy = [p.is_greedy for p in params]
    temps = [1.0 if g else p.temperature for p, g in zip(params, is_greedy)]
    if all(t == temps[0] for t in temps):  # NOTE: the usual RL batch; same values as per-row division
        scaled = logits if temps[0] == 1.0 else logits / temps[0]
    else:
        scaled = logits / torch.tensor(temps, dtype=torch.float32)[:, None]
    needs_trunc = [(not g) and (p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0) for p, g in zip(params, is_greedy)]
    if any(needs_trunc):
        top_k = torch.tensor([p.top_k if t else -1 for p, t in zip(params, needs_trunc)], dtype=torch.int64)
        top_p = torch.tensor([p.top_p if t else 1.0 for p, t in zip(params, needs_trunc)], dtype=torch.float32)
        min_p = torch.tensor([p.min_p if t else 0.0 for p, t in zip(params, needs_trunc)], dtype=torch.float32)
        processed = _truncate(scaled, top_k, top_p, min_p)
    else:
        processed = scaled
    processed_lp = torch.log_softmax(processed, dim=-1)
    if all(is_greedy):
        next_ids = torch.argmax(logits, dim=-1)
    else:
        u = counter_uniform(torch.tensor(list(seeds), dtype=torch.int64),
                            torch.tensor(list(positions), dtype=torch.int64))
        next_ids = inverse_cdf(processed_lp, u)
        if any(is_greedy):
            next_ids = torch.where(torch.tensor(is_greedy), torch.argmax(logits, dim=-1), next_ids)
    modes = {p.logprob_mode for p in params}
    per_mode = {}
    if "raw" in modes:
        per_mode["raw"] = torch.log_softmax(logits, dim=-1)
    if "scaled" in modes:
        per_mode["scaled"] = processed_lp if processed is scaled else torch.log_softmax(scaled, dim=-1)
    if "processed" in modes:
        per_mode["processed"] = processed_lp
    if len(per_mode) == 1:
        dist = next(iter(per_mode.values()))
    else:
        dist = torch.stack([per_mode[p.logprob_mode][i] for i, p in enumerate(params)])
    chosen = dist.gather(1, next_ids[:, None]).squeeze(1)
    max_top = max(top_logprobs_num) if top_logprobs_num else 0
    if max_top > 0:
        top_lp, top_ids = torch.topk(dist, k=min(max_top, vocab), dim=-1)
        return SampleResult(next_ids, chosen, top_ids, top_lp)
    return SampleResult(next_ids, chosen)
