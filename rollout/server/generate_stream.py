"""GenerateStream: the SSE chunks of a streaming `/generate`.

Cumulative (SGLang's default): each chunk carries the text, output_ids and output_token_logprobs
so far; the routing comes once, complete, in the final chunk's meta_info (where the non-streaming
answer has it). Incremental (`--incremental-streaming-output`, or `incremental_streaming_output:
true` on a request): each chunk carries only what is new, and the routing rows that became final
since the previous chunk with `routed_experts_start` (their absolute position).
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Union

from capture.codec import encode_engine_rows
from rollout.frontend.api import EngineDeadError
from rollout.frontend.async_generation import EngineStream
from rollout.server.event_encoder import EventEncoder, chunk_entries
from rollout.server.http_io import error_body, sse
from rollout.generate_io import StreamChunk


if TYPE_CHECKING:   # NOTE: generate_routes imports this module to answer streams
    from rollout.server.generate_routes import GenerateCall

class _Progress:
    """What one request has streamed so far (cumulative mode keeps it all)."""

    __slots__ = ("text", "ids", "logprobs", "tops")

    def __init__(self) -> None:
        self.text = ""
        self.ids: list[int] = []
        self.logprobs: list[list] = []
        self.tops: list[list] = []


class GenerateStream:
    def __init__(self, call: GenerateCall, es: EngineStream, *, engine: Any, metrics: Any,
                 decode: Callable[[int], str], shutdown: Any):
        self.call = call
        self.shutdown = shutdown   # ShutdownState
        self.es = es
        self.engine = engine
        self.metrics = metrics
        self.decode = decode
        self.prompt_of = es.submission.prompt_index
        self.index = {rid: i for i, rid in enumerate(es.rids)}
        self.multi = call.batch or len(es.rids) > 1
        self.progress = {rid: _Progress() for rid in es.rids}

    async def events(self) -> AsyncIterator[Union[str, bytes]]:
        ending = None   # the error event after the last chunk (the shutdown aborted a request)
        encoder = EventEncoder()
        try:
            async for chunk in self.es.items(keepalive=True):
                if chunk is None:
                    yield ": keep-alive\n\n"
                    continue
                if chunk.finished:
                    ending = ending or self.shutdown.error_for(chunk.output)
                for piece in await encoder.pieces(lambda c=chunk: self._event(c), self._entries(chunk)):
                    yield piece
        except EngineDeadError as exc:
            ending = error_body(str(exc), "server_error", code=503)
        if ending is not None:
            yield sse(ending)
        yield "data: [DONE]\n\n"

    def _event(self, chunk: StreamChunk) -> dict:
        obj = self._incremental(chunk) if self.call.incremental else self._cumulative(chunk)
        if self.multi:
            obj["index"] = self.index[chunk.rid]
        return obj

    def _entries(self, chunk: StreamChunk) -> int:
        """The size of the chunk's event (EventEncoder: large ones are built off the loop)."""
        if chunk.finished:
            out = chunk.output
            rows = out.routed_experts
            return chunk_entries(len(out.output_ids), out.output_top_logprobs, out.output_logprobs is not None,
                                 0 if rows is None else len(rows))
        tokens = len(chunk.output_ids) if self.call.incremental else len(self.progress[chunk.rid].ids) + len(
            chunk.output_ids)
        rows = chunk.routed_experts
        return chunk_entries(tokens, chunk.output_top_logprobs, chunk.output_logprobs is not None,
                             0 if rows is None else len(rows))

    def _final_meta(self, chunk: StreamChunk, *, with_routing: bool) -> dict:
        out = chunk.output
        if not with_routing and out.routed_experts is not None:
            meta = self.call.meta_info(dataclasses.replace(out, routed_experts=None), self.prompt_of[chunk.rid],
                                       self.decode)
            meta["routed_experts_start_len"] = out.routed_experts_start_len
            return meta
        meta = self.call.meta_info(out, self.prompt_of[chunk.rid], self.decode)
        if "routed_experts" in meta:
            self.metrics.routing_bytes(self.call.fmt, len(meta["routed_experts"]))
        return meta

    def _cumulative(self, chunk: StreamChunk) -> dict:
        if chunk.finished:
            out = chunk.output
            return {"text": out.text, "output_ids": list(out.output_ids),
                    "meta_info": self._final_meta(chunk, with_routing=True)}
        p = self.progress[chunk.rid]
        p.text += chunk.text
        p.ids.extend(chunk.output_ids)
        entry = self.call.token_entry(self.decode)
        meta = self.call.progress_meta(chunk.rid, self.prompt_of[chunk.rid], len(p.ids), self.engine.weight_version)
        if chunk.output_logprobs is not None:
            p.logprobs.extend(entry(lp, t) for lp, t in zip(chunk.output_logprobs, chunk.output_ids))
            meta["output_token_logprobs"] = p.logprobs
            meta.update(self.call.input_logprobs(self.prompt_of[chunk.rid], chunk.output_top_logprobs is not None,
                                                 self.decode))
        if chunk.output_top_logprobs is not None:
            p.tops.extend([entry(lp, t) for lp, t in row] for row in chunk.output_top_logprobs)
            meta["output_top_logprobs"] = p.tops
        return {"text": p.text, "output_ids": p.ids, "meta_info": meta}

    def _incremental(self, chunk: StreamChunk) -> dict:
        p = self.progress[chunk.rid]
        p.ids.extend(chunk.output_ids)
        entry = self.call.token_entry(self.decode)
        meta = self.call.progress_meta(chunk.rid, self.prompt_of[chunk.rid], len(p.ids), self.engine.weight_version)
        if chunk.finished:
            meta = self._final_meta(chunk, with_routing=False)   # the rows go out as deltas below
        if chunk.output_logprobs is not None:
            meta["output_token_logprobs"] = [entry(lp, t) for lp, t in zip(chunk.output_logprobs, chunk.output_ids)]
        else:
            meta.pop("output_token_logprobs", None)
        if chunk.output_top_logprobs is not None:
            meta["output_top_logprobs"] = [[entry(lp, t) for lp, t in row] for row in chunk.output_top_logprobs]
        else:
            meta.pop("output_top_logprobs", None)
        if chunk.routed_experts is not None:
            info = self.engine.info
            enc = encode_engine_rows(chunk.routed_experts, self.call.fmt, num_experts=info.num_experts,
                                     start=chunk.routed_experts_start, layer_ids=info.moe_layer_ids,
                                     dtype=self.call.routing_dtype)
            self.metrics.routing_bytes(self.call.fmt, len(enc))
            meta["routed_experts"] = enc
            meta["routed_experts_start"] = chunk.routed_experts_start
        return {"text": chunk.text, "output_ids": chunk.output_ids, "meta_info": meta}
