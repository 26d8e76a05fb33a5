"""Drafters: speculative decoding's proposers of the tokens after each request's last one.

A drafter's `propose(reqs, step)` returns one list of draft tokens per request (possibly empty;
step: the scheduler's decode step count, which paces them), `release(req)` gives back what it
holds for a request that finished or was retracted, and `memory(tag)` lists the tensors
/release_memory_occupation frees with the target's ("kv_cache" or "weights"). The
scheduler feeds them after the request's last token in one verify forward, and the
OutputProcessor keeps a draft token iff it equals the token the target samples at its position
(rollout/core/output_processor.py), so a drafter can only change how fast a request goes, never
what it outputs. Every drafter proposes at most `draft_budget(req, step)` tokens: a verified run never
passes max_new_tokens or the context, and a request whose drafts keep failing is paced down to
none for a while (pace), so that a workload the drafter cannot guess costs little more than
decoding without it.

Drafters: NgramDrafter (here), DraftModelDrafter (STANDALONE: rollout/core/draft_model.py) and
MtpDrafter (NEXTN: rollout/core/mtp_drafter.py).

NgramDrafter (SGLang's NGRAM): the longest suffix of the request's tokens (between the min and
max match window) that occurred earlier in its prompt or output, at its latest occurrence; the
drafts are the tokens that followed it there.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np


FIRST_BACKOFF, MAX_BACKOFF = 4, 64   # a request whose drafts all failed drafts every 4, 8 .. 64 steps


def draft_budget(req: Any, max_drafts: int, step: int) -> int:
    """Drafts request `req` may take at decode step `step`: a verify step emits at most drafts + 1
    tokens, which must fit its max_new_tokens and its context (max_total_len), and no more than its
    pace allows (pace)."""
    if req.spec_backoff and step % req.spec_backoff:
        return 0
    room = min(req.params.max_new_tokens - len(req.output_ids), req.max_total_len - req.seq_len) - 1
    return max(0, min(max_drafts, req.spec_cap, room))


def pace(req: Any, proposed: int, kept: int) -> None:
    """Adapts a request's drafts to how its last ones fared: it starts with one; after k of d kept
    it may take k + 1 next (so a run of full acceptances grows to the most allowed); after none kept it drafts (one token) only at steps that are
    multiples of 4, 8, .. MAX_BACKOFF, doubling with each failure. A request whose drafts keep
    failing thus feeds the verify forward its last token alone nearly always, and the requests
    that back off try again at the same steps (a step with any drafts is an extend forward for the
    whole batch); one whose drafts hold takes the most allowed. Outputs never depend on it."""
    if proposed == 0:
        return
    if kept == 0:
        req.spec_backoff = min(MAX_BACKOFF, max(FIRST_BACKOFF, 2 * req.spec_backoff))
        req.spec_cap = 1
    else:
        req.spec_backoff = 0
        req.spec_cap = kept + 1


class TokenHistory:
    """A request's prompt and output tokens as a growing int64 array (appended to, never rebuilt)."""

    def __init__(self, req: Any):
        n = req.seq_len
        self.ids = np.empty(max(16, 2 * n), dtype=np.int64)
        self.ids[:len(req.prompt_ids)] = req.prompt_ids
        self.ids[len(req.prompt_ids):n] = req.output_ids
        self.n = n

    def sync(self, req: Any) -> np.ndarray:
        """The request's tokens now (the output grows between calls)."""
        n = req.seq_len
        if n > self.n:
            if n > self.ids.shape[0]:
                grown = np.empty(2 * n, dtype=np.int64)
                grown[:self.n] = self.ids[:self.n]
                self.ids = grown
            start = len(req.prompt_ids)
            self.ids[self.n:n] = req.output_ids[self.n - start:]
            self.n = n
        return self.ids[:n]


def ngram_lookup(seq: np.ndarray, min_match: int, max_match: int, k: int) -> list[int]:
    """k tokens that follow the latest earlier occurrence of seq's longest suffix of min_match ..
    max_match tokens, read from seq extended by the drafts themselves ([] when none occurs): a
    suffix that repeats every p tokens drafts k tokens of that period, not p."""
    n = seq.shape[0]
    if n < 2 or k <= 0:
        return []
    best = np.flatnonzero(seq[:n - 1] == seq[n - 1])   # ends of earlier matches of length 1
    if best.size == 0:
        return []
    length = 1
    while length < max_match:
        c = best[best >= length]
        c = c[seq[c - length] == seq[n - 1 - length]] if c.size else c
        if c.size == 0:
            break
        best, length = c, length + 1
    if length < min_match:
        return []
    end = int(best[-1])
    out = seq[end + 1:end + 1 + k].tolist()
    # NOTE: a match close to the end (a repeating span: its latest occurrence overlaps the suffix)
    # predicts past the known tokens: those are the drafts themselves, so the span repeats on
    for i in range(len(out), k):
        out.append(out[end + 1 + i - n])
    return out


class NgramDrafter:
    def __init__(self, *, num_draft_tokens: int, min_match: int, max_match: int):
        self.max_drafts = num_draft_tokens - 1
        self.min_match = min_match
        self.max_match = max_match

    def propose(self, reqs: Sequence[Any], step: int) -> list[list[int]]:
        out = []
        for req in reqs:
            k = draft_budget(req, self.max_drafts, step)
            if k == 0:
                out.append([])
                continue
            if req.draft_state is None:
                req.draft_state = TokenHistory(req)
            out.append(ngram_lookup(req.draft_state.sync(req), self.min_match, self.max_match, k))
        return out

    def release(self, req: Any) -> None:
        """A request that finished or was retracted: its token history stays valid (nothing to give back)."""

    def memory(self, tag: str) -> list:
        """Nothing for release_memory_occupation to free (no model, no KV)."""
        return []


def make_drafter(cfg: Any, *, target: Any, device: Any, num_slots: int, context_length: int,
                 hidden: Any = None, target_slots: Any = None) -> Any:
    """The drafter an EngineConfig asks for (None: speculation off). target: the target model;
    num_slots: its KV slots (a draft model's KV gets as many); hidden: its KV pool's hidden states
    by slot and target_slots(req) a request's target KV slots (NEXTN reads both)."""
    if cfg.speculative_algorithm is None:
        return None
    common = dict(device=device, num_draft_tokens=cfg.verify_tokens_per_request, num_slots=num_slots,
                  max_requests=cfg.max_running_requests, context_length=context_length)
    if cfg.speculative_algorithm == "NGRAM":
        return NgramDrafter(num_draft_tokens=cfg.verify_tokens_per_request,
                            min_match=cfg.speculative_ngram_min_match_window_size,
                            max_match=cfg.speculative_ngram_max_match_window_size)
    if cfg.speculative_algorithm == "STANDALONE":
        from rollout.core.draft_model import DraftModelDrafter  # noqa: PLC0415  (it loads a model)

        return DraftModelDrafter(model_path=cfg.speculative_draft_model_path, dtype=cfg.dtype,
                                 target_vocab=target.info.vocab_size, moe_backend=cfg.resolved_moe_backend, **common)
    if cfg.speculative_algorithm == "NEXTN":
        from rollout.core.mtp_drafter import MtpDrafter  # noqa: PLC0415

        return MtpDrafter(target=target, hidden=hidden, target_slots=target_slots, **common)
    raise ValueError(f"speculative_algorithm={cfg.speculative_algorithm!r} has no drafter")
