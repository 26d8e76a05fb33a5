"""MtpDrafter (SGLang's NEXTN): the checkpoint's own multi-token-prediction layer, loaded with the
model (model.mtp: rollout/models/mtp.py), proposes each request's next tokens greedily, with a KV
cache of its own (DraftKV).

The MTP layer's position i reads the target's final-normed hidden state h_i and the token t_{i+1}.
The target keeps every token's hidden state beside its KV (KVPool.hidden, by slot), so for a
request of L tokens whose target KV covers positions 0 .. L-2 the drafter can feed the MTP
positions it has not fed yet up to L-2 in one extend forward (the whole prompt at first, prefix
cache hits included: their hidden states sit in the shared slots), whose last logits give the
first draft; each further draft feeds the previous draft and the MTP's own output at the position
before (one decode forward of every drafting request together). Only positions fed with the
target's hidden states are confirmed: the chained ones are given back at the next proposal.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from rollout.core.draft_kv import DraftKV
from rollout.core.drafter import draft_budget


class MtpDrafter:
    def __init__(self, *, target: torch.nn.Module, hidden: torch.Tensor, target_slots: Callable[[Any], torch.Tensor],
                 device: torch.device, num_draft_tokens: int, num_slots: int, max_requests: int,
                 context_length: int):
        """target: the model, with its MTP layer attached (load_model(mtp=True)); hidden: its KV
        pool's hidden states by slot; target_slots(req): the request's target KV slots by position."""
        self.model = target.mtp
        self.hidden = hidden
        self.target_slots = target_slots
        self.max_drafts = num_draft_tokens - 1
        spec = self.model.spec
        self.kv = DraftKV(num_slots=num_slots, num_layers=1, num_kv_heads=spec.num_kv_heads,
                          head_dim=spec.head_dim, latent_dim=spec.info.kv_latent_dim, dtype=hidden.dtype,
                          device=device, max_requests=max_requests, context_length=context_length)

    @torch.inference_mode()
    def propose(self, reqs: Sequence[Any], step: int) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in reqs]
        work = []   # (index in reqs, request, its DraftSeq, drafts wanted, first position to feed)
        reserved = 0
        for i, req in enumerate(reqs):
            k = draft_budget(req, self.max_drafts, step)
            seq = self.kv.seq(req) if k else None
            if seq is None:
                continue
            last = req.seq_len - 2            # the last position whose hidden state the target computed
            start = min(seq.confirmed, last)  # NOTE: fed again when nothing new came (its logits: draft 1)
            self.kv.truncate(seq, start)      # chained positions never hold the target's hidden states
            need = last + 1 - start + k - 1
            if need <= self.kv.available() - reserved:   # NOTE: else it goes without drafts this step
                reserved += need
                work.append((i, req, seq, k, start))
        if not work:
            return out
        ids, pre, ext, rows = [], [], [], []
        for _, req, seq, _, start in work:
            last = req.seq_len - 2
            ids += req.token_span(start + 1, last + 2)
            rows.append(self.target_slots(req)[start:last + 1])
            pre.append(start)
            ext.append(last + 1 - start)
        fb = self.kv.forward_batch([w[2] for w in work], ids, pre, ext)
        normed = self.model(fb, self.hidden[torch.cat(rows)])
        h = normed[fb.logits_indices]
        nxt = torch.argmax(self.model.logits(h), dim=-1).tolist()
        for (i, req, seq, _, _), tok in zip(work, nxt):
            seq.confirmed, seq.fed = req.seq_len - 1, []
            out[i].append(tok)
        step = 1
        while True:
            keep = [j for j, w in enumerate(work) if w[3] > step]
            if not keep:
                return out
            work, h = [work[j] for j in keep], h[torch.tensor(keep, dtype=torch.int64)]
            fb = self.kv.forward_batch([w[2] for w in work], [out[w[0]][-1] for w in work],
                                       [w[2].kv_len for w in work], [1] * len(work))
            h = self.model(fb, h)
            nxt = torch.argmax(self.model.logits(h), dim=-1).tolist()
            for (i, _, seq, _, _), tok in zip(work, nxt):
                seq.fed.append(out[i][-1])
                out[i].append(tok)
            step += 1

    def release(self, req: Any) -> None:
        self.kv.release(req)

    def memory(self, tag: str) -> list[torch.Tensor]:
        """What release_memory_occupation frees with the target's: the MTP's KV (its weights are
        the model's)."""
        return self.kv.tensors() if tag == "kv_cache" else []
