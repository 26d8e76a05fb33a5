"""Sampler: picks each request's next token from fp32 logits and computes its logprobs.

Randomness is counter-based: one uniform number per (seed, position), a hash of the two, picks
the token by inverse CDF of the processed distribution. So a sampled token depends only on the
request's seed, position and logits, never on the other requests in the batch or on how often
the engine stepped (retraction resumes exactly).
"""
from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter
from typing import Optional, Sequence

import numpy as np
import torch

from rollout.batch.host_device import to_device
from rollout.sampling_params import SamplingParams

# splitmix64 (Steele, Lea, Flood 2014) constants; numpy's uint64 arithmetic wraps like the original.
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S11, _S27, _S30, _S31 = np.uint64(11), np.uint64(27), np.uint64(30), np.uint64(31)
_SAMPLER_KEY = attrgetter("sampler_key")
PENALIZED_LOGIT_LIMIT = 1e30   # x 1/GREEDY_TEMPERATURE (1e6) stays below float32's max (3.4e38)
MAX_CANDIDATES = 1024          # rows cut to at most this many tokens sample among them, not the vocabulary


def _splitmix64(z: np.ndarray) -> np.ndarray:
    z = (z ^ (z >> _S30)) * _MIX1
    z = (z ^ (z >> _S27)) * _MIX2
    return z ^ (z >> _S31)


def counter_uniform(seeds: Sequence[int] | torch.Tensor, positions: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Uniform(0, 1) noise [B] float64 from (seed [B] in [0, 2^63), position [B]): 53 hashed
    bits, never 0 or 1. (numpy: a handful of ops on a few dozen numbers costs a tenth of torch's.)"""
    s = np.asarray(seeds, dtype=np.uint64)
    p = np.asarray(positions, dtype=np.uint64)
    with np.errstate(over="ignore"):
        h = _splitmix64(_splitmix64(s + _GOLDEN) ^ (p * _GOLDEN))
    return torch.from_numpy(((h >> _S11).astype(np.float64) + 0.5) * (1.0 / 2.0**53))


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
        counts = torch.bincount(to_device(torch.tensor(output_ids[i], dtype=torch.int64), logits.device),
                                minlength=vocab)[:vocab]
        seen = counts > 0
        row = logits[i]
        if p.repetition_penalty != 1.0:
            row = torch.where(seen, torch.where(row > 0, row / p.repetition_penalty,
                                                row * p.repetition_penalty), row)
        row = row - p.frequency_penalty * counts.to(row.dtype) - p.presence_penalty * seen.to(row.dtype)
        # NOTE: a tiny repetition_penalty divides a finite logit into inf; clamped, the distribution
        # stays finite (and favours the same tokens) even after division by the smallest temperature.
        logits[i] = row.clamp(-PENALIZED_LOGIT_LIMIT, PENALIZED_LOGIT_LIMIT)
    return logits


def _cut(sorted_logits: torch.Tensor, lse: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
         min_p: torch.Tensor, vocab: int) -> torch.Tensor:
    """The drop mask [B, K] of each row's leading K tokens, in descending order of their logits
    (all of the vocabulary, or its K best): outside the row's top-k, past its top-p mass, or less
    likely than min_p times its best token. lse [B, 1]: the rows' log-sum-exp over the whole
    vocabulary, so the probabilities, and the cut, are the same for any K that holds it."""
    probs = torch.exp(sorted_logits - lse)
    rank = torch.arange(sorted_logits.shape[1], device=sorted_logits.device)[None, :]
    k = torch.where(top_k <= 0, torch.full_like(top_k, vocab), top_k.clamp(max=vocab))
    drop = rank >= k[:, None]
    cum_before = torch.cumsum(probs, dim=-1) - probs
    # NOTE: top_p 1 cuts nothing: float32's running sum can reach 1.0 before the tail ends
    drop |= (cum_before >= top_p[:, None]) & (top_p < 1.0)[:, None]
    drop |= probs < (min_p[:, None] * probs[:, :1])
    drop[:, 0] = False
    return drop


def _truncate(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
              min_p: torch.Tensor) -> torch.Tensor:
    """Masks (to -inf) tokens outside each row's top-k / top-p / min-p set. scaled: [B, V]."""
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
    drop = _cut(sorted_logits, torch.logsumexp(scaled, -1, keepdim=True), top_k, top_p, min_p, scaled.shape[1])
    masked_sorted = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(scaled).scatter_(1, order, masked_sorted)


@dataclass(frozen=True)
class Candidates:
    """The tokens each row's top-k / top-p / min-p cut keeps, as K columns (K = the largest
    top-k, or MAX_CANDIDATES): vocabulary ids ascending [B, K] and their logits over temperature,
    -inf where cut [B, K]. Sampling by inverse CDF over them in id order picks the token the whole
    masked row would (a cut token adds an exact 0 to the running sum)."""
    ids: torch.Tensor
    logits: torch.Tensor

    def dense(self, vocab: int, values: torch.Tensor) -> torch.Tensor:
        """values [B, K] (per candidate) spread over [B, vocab], -inf elsewhere."""
        out = torch.full((values.shape[0], vocab), float("-inf"), dtype=values.dtype, device=values.device)
        return out.scatter_(1, self.ids, values)


def candidates(scaled: torch.Tensor, ks: Sequence[int], top_k: torch.Tensor, top_p: torch.Tensor,
               min_p: torch.Tensor) -> Optional[Candidates]:
    """Every row's kept tokens without sorting the vocabulary: its K best by torch.topk, the cut of
    _truncate over them. ks: top_k as a list. None when a row's cut may lie beyond MAX_CANDIDATES
    tokens (the caller then truncates the whole row)."""
    vocab = scaled.shape[1]
    want = max((min(k, MAX_CANDIDATES) if k > 0 else MAX_CANDIDATES) for k in ks)
    width = min(vocab, want)
    if width * 4 > vocab:
        return None   # NOTE: a small vocabulary: the sort costs little, and the candidates would not
    vals, ids = torch.topk(scaled, width, dim=-1)
    drop = _cut(vals, torch.logsumexp(scaled, -1, keepdim=True), top_k, top_p, min_p, vocab)
    held = to_device(torch.tensor([0 < k <= width for k in ks]), scaled.device)
    if not bool((drop[:, -1] | held).all()):
        return None   # NOTE: a row keeps its last candidate without a top-k that stops there
    ids, order = ids.sort(dim=-1)
    return Candidates(ids, vals.masked_fill(drop, float("-inf")).gather(1, order))


def _ban(logits: torch.Tensor, banned_ids: Sequence[Sequence[int]]) -> torch.Tensor:
    """logits with banned_ids[b] masked to -inf in row b."""
    dev = logits.device
    rows = [i for i, ids in enumerate(banned_ids) for _ in ids]
    cols = [t for ids in banned_ids for t in ids]
    return logits.clone().index_put_((to_device(torch.tensor(rows, dtype=torch.int64), dev),
                                      to_device(torch.tensor(cols, dtype=torch.int64), dev)),
                                     torch.full((), float("-inf"), dtype=logits.dtype, device=dev))


def _process(logits: torch.Tensor, params: Sequence[SamplingParams],
             uniform: bool) -> tuple[list[bool], torch.Tensor, torch.Tensor | Candidates, set[str]]:
    """-> (greedy rows, logits over temperature, those truncated by top-k / top-p / min-p (as
    Candidates when every row is cut to a few), the rows' logprob modes). uniform: every row has
    params[0]'s sampler key."""
    bsz = logits.shape[0]
    dev = logits.device
    first = params[0]
    if uniform:
        is_greedy = [first.is_greedy] * bsz
        temp = first.sampler_key[1]
        scaled = logits if temp == 1.0 else logits / temp   # NOTE: same values as per-row division
        needs_trunc = [(not first.is_greedy) and (first.top_k > 0 or first.top_p < 1.0 or first.min_p > 0.0)] * bsz
        modes = {first.logprob_mode}
    else:
        is_greedy = [p.is_greedy for p in params]
        temps = [1.0 if g else p.temperature for p, g in zip(params, is_greedy)]
        scaled = logits / to_device(torch.tensor(temps, dtype=torch.float32), dev)[:, None]
        needs_trunc = [(not g) and (p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0) for p, g in zip(params, is_greedy)]
        modes = {p.logprob_mode for p in params}
    if not (needs_trunc[0] if uniform else any(needs_trunc)):
        return is_greedy, scaled, scaled, modes
    ks = [p.top_k if t else -1 for p, t in zip(params, needs_trunc)]
    top_k = to_device(torch.tensor(ks, dtype=torch.int64), dev)
    top_p = to_device(torch.tensor([p.top_p if t else 1.0 for p, t in zip(params, needs_trunc)],
                                   dtype=torch.float32), dev)
    min_p = to_device(torch.tensor([p.min_p if t else 0.0 for p, t in zip(params, needs_trunc)],
                                   dtype=torch.float32), dev)
    kept = None
    if all(t or g for t, g in zip(needs_trunc, is_greedy)):
        # NOTE: a greedy row (argmax, no draw) takes its 1 best as candidates: it sets no width
        ks = [1 if g else k for k, g in zip(ks, is_greedy)]
        kept = candidates(scaled, ks, to_device(torch.tensor(ks, dtype=torch.int64), dev), top_p, min_p)
    return is_greedy, scaled, kept if kept is not None else _truncate(scaled, top_k, top_p, min_p), modes


def sample(logits: torch.Tensor, params: Sequence[SamplingParams], seeds: Sequence[int],
           positions: Sequence[int], output_ids: Sequence[Sequence[int]],
           banned_ids: Optional[Sequence[Sequence[int]]], top_logprobs_num: Sequence[int],
           noise: Optional[torch.Tensor] = None) -> SampleResult:
    """logits: [B, V] fp32. banned_ids[b]: tokens masked for row b (eos/stop before min_new_tokens);
    None when no row bans any. noise: counter_uniform(seeds, positions) [B] when the caller hashed
    it already (the engine does, before the forward)."""
    logits = logits.float()
    vocab = logits.shape[1]
    dev = logits.device   # NOTE: every tensor made here goes there (the noise is hashed on the host), staged
    first = params[0]
    uniform = all(map(first.sampler_key.__eq__, map(_SAMPLER_KEY, params)))  # the usual RL batch
    if not uniform or first.has_penalty:
        logits = _apply_penalties(logits, params, output_ids)
    if banned_ids is not None and any(banned_ids):
        logits = _ban(logits, banned_ids)
    is_greedy, scaled, processed, modes = _process(logits, params, uniform)
    kept = processed if isinstance(processed, Candidates) else None
    kept_lp = None if kept is None else torch.log_softmax(kept.logits, dim=-1)
    processed_lp = None
    # NOTE: the dense processed distribution only where it is drawn from or returned (an all-greedy
    # batch in "raw" mode needs none)
    if kept is None and (not all(is_greedy) or "processed" in modes or ("scaled" in modes and processed is scaled)):
        processed_lp = torch.log_softmax(processed, dim=-1)
    if all(is_greedy):
        next_ids = torch.argmax(logits, dim=-1)
    else:
        # NOTE: the inverse CDF (float64, over the row) runs on the sampled rows only, and for rows
        # cut to a few candidates over those alone
        rows = None if not any(is_greedy) else [i for i, g in enumerate(is_greedy) if not g]
        if noise is None:
            u = counter_uniform(seeds if rows is None else [seeds[i] for i in rows],
                                positions if rows is None else [positions[i] for i in rows])
        else:
            u = noise if rows is None else noise[rows]
        u = to_device(u, dev)
        pick = None if rows is None else to_device(torch.tensor(rows, dtype=torch.int64), dev)
        if kept is not None:
            lp, ids = (kept_lp, kept.ids) if pick is None else (kept_lp[pick], kept.ids[pick])
            drawn = ids.gather(1, inverse_cdf(lp, u)[:, None]).squeeze(1)
        else:
            drawn = inverse_cdf(processed_lp if pick is None else processed_lp[pick], u)
        if pick is None:
            next_ids = drawn
        else:
            next_ids = torch.argmax(logits, dim=-1).index_copy_(0, pick, drawn)
    if kept is not None and "processed" in modes:
        processed_lp = kept.dense(vocab, kept_lp)
        if any(is_greedy):   # NOTE: a greedy row's processed distribution is its untruncated one
            greedy = to_device(torch.tensor([i for i, g in enumerate(is_greedy) if g], dtype=torch.int64), dev)
            processed_lp[greedy] = torch.log_softmax(scaled[greedy], dim=-1)
    per_mode = {}
    if "raw" in modes:
        # NOTE: at temperature 1 without a cut the processed distribution is this one (computed once)
        per_mode["raw"] = processed_lp if processed is logits and processed_lp is not None else torch.log_softmax(logits, dim=-1)
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
