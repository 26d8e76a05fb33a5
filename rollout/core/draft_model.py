"""DraftModelDrafter (SGLang's STANDALONE): a smaller checkpoint with the target's tokenizer
proposes each request's next tokens greedily, with a KV cache of its own (DraftKV).

Per request the draft keeps the KV of the positions it has fed: those up to the request's last
confirmed token, and the drafts it fed after them. At the next proposal the drafts the verify step
kept are confirmed (their KV stays), the rest are given back, the tokens the draft has not seen
(the target's bonus token, or the whole prompt at first) are fed in one extend forward, and each
further draft is one decode forward of every drafting request together.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from rollout.core.draft_kv import DraftKV, DraftSeq
from rollout.core.drafter import draft_budget
from rollout.models.moe.block import set_moe_backend
from rollout.models.registry import load_model


class DraftModelDrafter:
    def __init__(self, *, model_path: str, dtype: Any, device: torch.device, num_draft_tokens: int,
                 num_slots: int, max_requests: int, context_length: int, target_vocab: int, moe_backend: str):
        self.model, _ = load_model(model_path, dtype, device)
        set_moe_backend(self.model, moe_backend)
        info = self.model.info
        if info.vocab_size != target_vocab:
            raise ValueError(f"speculative_draft_model_path={model_path!r}: the draft's vocab_size {info.vocab_size} "
                             f"is not the target's {target_vocab}; a draft must share the target's tokenizer")
        self.max_drafts = num_draft_tokens - 1
        self.kv = DraftKV(num_slots=num_slots, num_layers=info.num_hidden_layers, num_kv_heads=info.num_kv_heads,
                          head_dim=info.head_dim, latent_dim=info.kv_latent_dim,
                          dtype=next(self.model.parameters()).dtype, device=device,
                          max_requests=max_requests, context_length=context_length)

    # ---- the drafter interface -------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, reqs: Sequence[Any], step: int) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in reqs]
        work: list[tuple[int, Any, DraftSeq, int]] = []   # (index in reqs, request, its DraftSeq, drafts wanted)
        room = self.kv.available()
        for i, req in enumerate(reqs):
            k = draft_budget(req, self.max_drafts, step)
            if k == 0:
                continue
            seq = self._sync(req)
            need = req.seq_len - seq.kv_len + k - 1 if seq is not None else room + 1
            if need <= room:   # NOTE: a request the draft's KV cannot hold now goes without drafts
                room -= need
                work.append((i, req, seq, k))
        if not work:
            return out
        # the tokens the draft has not fed: from its first unconfirmed position to the request's last
        ids, pre, ext = [], [], []
        for _, req, seq, _ in work:
            ids += req.token_span(seq.confirmed, req.seq_len)
            pre.append(seq.confirmed)
            ext.append(req.seq_len - seq.confirmed)
        nxt = self._forward(work, ids, pre, ext)
        for (i, req, seq, _), tok in zip(work, nxt):
            seq.confirmed = req.seq_len
            out[i].append(tok)
        step = 1
        while True:
            work = [w for w in work if w[3] > step]
            if not work:
                return out
            ids = [out[i][-1] for i, _, _, _ in work]
            pre = [seq.kv_len for _, _, seq, _ in work]
            nxt = self._forward(work, ids, pre, [1] * len(work))
            for (i, _, seq, _), tok in zip(work, nxt):
                seq.fed.append(out[i][-1])
                out[i].append(tok)
            step += 1

    def release(self, req: Any) -> None:
        self.kv.release(req)

    def memory(self, tag: str) -> list[torch.Tensor]:
        """What release_memory_occupation frees with the target's: the draft's KV or its weights."""
        return self.kv.tensors() if tag == "kv_cache" else [p.data for p in self.model.parameters()]

    # ---- internals -------------------------------------------------------------------------------
    def _sync(self, req: Any) -> Optional[DraftSeq]:
        """The request's DraftSeq with the drafts the verify step kept confirmed and the others'
        KV given back; None when the draft has no row left for it."""
        seq = self.kv.seq(req)
        if seq is not None and (seq.fed or seq.confirmed >= req.seq_len):
            real = req.token_span(seq.confirmed, min(req.seq_len, seq.kv_len))
            kept = 0
            while kept < len(real) and real[kept] == seq.fed[kept]:
                kept += 1
            # NOTE: the last token is always fed again (its logits give the first draft): a step that
            # decoded without drafts (KV short) may have emitted exactly the fed draft, and a second
            # proposal in one step (after a retraction) finds the last token confirmed
            valid = min(seq.confirmed + kept, req.seq_len - 1)
            self.kv.truncate(seq, valid)
            seq.confirmed, seq.fed = valid, []
        return seq

    def _forward(self, work: list, ids: list[int], pre: list[int], ext: list[int]) -> list[int]:
        """One forward of the draft over the work's new tokens -> each request's greedy next token."""
        fb = self.kv.forward_batch([seq for _, _, seq, _ in work], ids, pre, ext)
        return torch.argmax(self.model(fb), dim=-1).tolist()
