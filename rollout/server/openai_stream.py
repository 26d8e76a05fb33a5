"""The SSE stream of a streaming /v1/completions or /v1/chat/completions (OpenAIServing's): an opening
chunk per choice (chat), a chunk per engine chunk (large ones built off the loop by EventEncoder),
usage when asked, an error event when the engine died or the shutdown aborted a request, [DONE]."""
from __future__ import annotations

from typing import Any, AsyncIterator, Callable, Optional, Union

from starlette.responses import Response

from rollout.frontend.api import EngineDeadError
from rollout.frontend.async_generation import EngineStream
from rollout.generate_io import StreamChunk
from rollout.server.event_encoder import EventEncoder, chunk_entries
from rollout.server.http_io import SSEResponse, error_body, sse


def chunk_event_entries(chunk: StreamChunk, incremental: bool) -> int:
    """The size of a chunk's event (EventEncoder: large ones are built off the loop); the last
    chunk of a cumulative stream carries the whole routing."""
    rows = chunk.routed_experts
    if chunk.finished and not incremental and chunk.output.routed_experts is not None:
        rows = chunk.output.routed_experts
    return chunk_entries(len(chunk.output_ids), chunk.output_top_logprobs, chunk.output_logprobs is not None,
                         0 if rows is None else len(rows))


def openai_stream(serving: Any, es: EngineStream, meta: dict, chunk_obj: str, fmt: str, include_usage: bool,
                  delta_of: Callable[[StreamChunk], dict], opening: Optional[dict], token_ids: bool,
                  incremental: bool) -> Response:
    """The SSE stream of a streaming request (`serving`: its OpenAIServing)."""
    index = {rid: i for i, rid in enumerate(es.rids)}
    encoder = EventEncoder()

    def event(chunk: StreamChunk) -> dict:
        choice = {"index": index[chunk.rid], **delta_of(chunk), "finish_reason": None}
        if token_ids:
            choice["token_ids"] = list(chunk.output_ids)
        if chunk.finished:
            choice["finish_reason"], choice["matched_stop"] = serving._finish(chunk.output)
        obj = {**meta, "object": chunk_obj, "choices": [choice]}
        ext = serving._chunk_ext(chunk, fmt, incremental)
        if ext is not None:
            obj["sglext"] = ext
        return obj

    async def events() -> AsyncIterator[Union[str, bytes]]:
        finals = []
        if opening is not None:
            for rid in es.rids:
                yield sse({**meta, "object": chunk_obj,
                           "choices": [{"index": index[rid], **opening, "finish_reason": None}]})
        try:
            async for chunk in es.items(keepalive=True):
                if chunk is None:
                    yield ": keep-alive\n\n"
                    continue
                if chunk.finished:
                    finals.append(chunk.output)
                for piece in await encoder.pieces(lambda c=chunk: event(c), chunk_event_entries(chunk, incremental)):
                    yield piece
        except EngineDeadError as exc:   # NOTE: the stream has begun: its end says why, as /generate's
            yield sse(error_body(str(exc), "server_error", code=503))
            yield "data: [DONE]\n\n"
            return
        if include_usage:
            finals.sort(key=lambda o: index[o.rid])
            usage = serving._usage(finals, es.submission.prompt_index)
            yield sse({**meta, "object": chunk_obj, "choices": [], "usage": usage})
        ending = next((e for e in map(serving.shutdown.error_for, finals) if e is not None), None) \
            if serving.shutdown is not None else None
        if ending is not None:
            yield sse(ending)
        yield "data: [DONE]\n\n"

    return SSEResponse(events(), es.close)
