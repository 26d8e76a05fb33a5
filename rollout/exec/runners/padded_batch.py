"""padded_batch: a ScheduledBatch as a ForwardBatch, optionally padded to a token extent.

Padding tokens form extra requests of at most `pad_chunk` tokens each (token id 0, positions from
0). Their KV slots are all SINK_SLOT, so their KV writes land in the sink, and their attention rows
see only sink keys; no real request's row ever sees a sink column (kv_indices beyond a request's
length are masked). Real requests keep their order and come first, so logits row b is request b.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from rollout.batch.forward_batch import ForwardBatch
from rollout.batch.kv_pool import SINK_SLOT, KVPool


def padded_forward_batch(batch: Optional[Any], *, kv_pool: KVPool, device: torch.device,
                         capture: Optional[Any] = None, pad_to: int = 0, pad_chunk: int = 1,
                         segment_attention: bool = False) -> ForwardBatch:
    """batch: a ScheduledBatch or None (idle rank). pad_to: total tokens after padding (0 = none)."""
    input_ids: list[int] = []
    prefix_lens: list[int] = []
    extend_lens: list[int] = []
    locs: list[torch.Tensor] = []
    if batch is not None:
        if batch.is_prefill:
            for req, pre, ext in zip(batch.reqs, batch.prefix_lens, batch.extend_lens):
                input_ids += req.token_span(pre, pre + ext)
        else:
            # decode: each request's last token (a prompt's own last one after a chunked prefill)
            input_ids = [(req.output_ids or req.prompt_ids)[-1] for req in batch.reqs]
        prefix_lens += list(batch.prefix_lens)
        extend_lens += list(batch.extend_lens)
        locs.append(batch.out_cache_loc)
    real = len(extend_lens)
    pad = pad_to - len(input_ids)
    assert pad_to == 0 or pad >= 0, (pad_to, len(input_ids))
    chunk = max(1, pad_chunk)
    while pad > 0:
        c = min(chunk, pad)
        input_ids += [0] * c
        prefix_lens.append(0)
        extend_lens.append(c)
        locs.append(torch.full((c,), SINK_SLOT, dtype=torch.int64))
        pad -= c
    if not extend_lens:
        return ForwardBatch.empty(kv_pool=kv_pool, capture=capture, device=device)
    if real == len(extend_lens):
        kv_indices = batch.kv_indices
    else:
        # padding requests read and write only the sink slot
        width = max(p + e for p, e in zip(prefix_lens, extend_lens))
        kv_indices = torch.full((len(extend_lens), width), SINK_SLOT, dtype=torch.int64,
                                device=batch.kv_indices.device if real else device)
        if real:
            kv_indices[:real, :batch.kv_indices.shape[1]] = batch.kv_indices
    return ForwardBatch.build(input_ids=input_ids, out_cache_loc=locs[0] if len(locs) == 1 else torch.cat(locs),
                              prefix_lens=prefix_lens, extend_lens=extend_lens, kv_indices=kv_indices,
                              kv_pool=kv_pool, capture=capture, device=device, segment_attention=segment_attention,
                              prefix_groups=batch.prefix_groups if real == len(extend_lens) else ())
