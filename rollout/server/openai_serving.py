"""OpenAIServing: the OpenAI-style /v1/completions, /v1/chat/completions and /v1/models answers."""
from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, Callable, Optional

from starlette.requests import Request
from starlette.responses import Response

from capture.codec import encode_engine_rows
from rollout.generate_io import GenerateArgs, RolloutOutput, StreamChunk
from rollout.server.completion_echo import CompletionEcho
from rollout.server.openai_stream import openai_stream
from rollout.frontend.async_generation import EngineStream
from rollout.server.http_io import (OFF_LOOP_CHARS, ApiError, JSONBytesResponse, TextBound, dumps_bytes, large_answer,
                                    param_of, routing_format)

# NOTE: "stream_options", "user", "metadata" and similar OpenAI fields that do not change the
# output are accepted and ignored, like other OpenAI-compatible servers do.
_UNSUPPORTED_UNLESS_NULL = ("suffix", "logit_bias", "regex", "json_schema", "ebnf", "functions", "function_call",
                            "audio", "modalities", "prediction", "lora_path")

_SAMPLING_EXT = ("top_k", "min_p", "repetition_penalty", "ignore_eos", "skip_special_tokens", "stop_token_ids",
                 "no_stop_trim", "logprob_mode", "spaces_between_special_tokens")
_ENGINE_TO_OPENAI = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "sampling_seed": "seed",
                     "input_ids": "prompt", "prompts": "prompt"}
_KNOWN = {"model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stop",
          "stream", "logprobs", "top_logprobs", "seed", "presence_penalty", "frequency_penalty", "min_tokens",
          "return_routed_experts", "routed_experts_format", "routed_experts_start_len", "rid", "echo", "best_of",
          "stream_options", "tools", "tool_choice", "response_format", "return_token_ids",
          "incremental_streaming_output", *_SAMPLING_EXT, *_ENGINE_TO_OPENAI.values()}


def _get(body: dict, name: str, types: tuple, default: Any = None) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in types:
        raise ApiError(400, f"{name} has the wrong type (got a boolean)", param=name)
    if not isinstance(value, types):
        raise ApiError(400, f"{name} has the wrong type, got {type(value).__name__}", param=name)
    return value


class OpenAIServing:
    def __init__(self, engine: Any, model_name: str, metrics: Any, *, incremental_streaming: bool = False,
                 shutdown: Any = None, routing_default: bool = False):
        self.engine = engine
        self.routing_default = routing_default   # --default-return-routed-experts: routing unless a body says false
        self.shutdown = shutdown   # ShutdownState (the error event of streams the shutdown aborted)
        self.incremental_streaming = incremental_streaming
        self.model_name = model_name
        self.metrics = metrics
        self.bound = TextBound(engine)

    def models(self) -> dict:
        return {"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": int(time.time()), "owned_by": "sglang",
            "root": self.engine.config.model_path, "parent": None, "max_model_len": self.engine.context_length}]}

    # ---- request mapping ----------------------------------------------------------------------------
    def _common(self, body: dict, default_max: Optional[int]) -> tuple[dict, dict]:
        """(sampling params, engine kwargs) from the fields both endpoints share."""
        for name in _UNSUPPORTED_UNLESS_NULL:
            if body.get(name) not in (None, {}, [], ""):
                raise ApiError(400, f"{name} is not supported by this server", param=name)
        n = _get(body, "n", (int,), 1)
        best_of = _get(body, "best_of", (int,), None)
        if best_of is not None and best_of != n:
            raise ApiError(400, "best_of must equal n (no server-side ranking)", param="best_of")
        max_tokens = _get(body, "max_completion_tokens", (int,), None)
        max_tokens = _get(body, "max_tokens", (int,), max_tokens)
        params: dict[str, Any] = {"n": n, "max_new_tokens": default_max if max_tokens is None else max_tokens}
        for src, dst, types in (("temperature", "temperature", (int, float)), ("top_p", "top_p", (int, float)),
                                ("presence_penalty", "presence_penalty", (int, float)),
                                ("frequency_penalty", "frequency_penalty", (int, float)),
                                ("seed", "sampling_seed", (int,)), ("min_tokens", "min_new_tokens", (int,)),
                                ("stop", "stop", (str, list))):
            value = _get(body, src, types, None)
            if value is not None:
                params[dst] = value
        for name in _SAMPLING_EXT:
            if body.get(name) is not None:
                params[name] = body[name]
        rid = body.get("rid")
        kwargs = {"return_routed_experts": _get(body, "return_routed_experts", (bool,), self.routing_default),
                  "routed_experts_start_len": _get(body, "routed_experts_start_len", (int,), 0), "rid": rid}
        return params, kwargs

    def _openai_error(self, exc: ValueError) -> ApiError:
        msg = str(exc)
        param = param_of(msg, _KNOWN | set(_ENGINE_TO_OPENAI))
        return ApiError(400, msg, param=_ENGINE_TO_OPENAI.get(param, param))

    def _start(self, *, prompts: Any = None, input_ids: Any = None, params: dict, kwargs: dict,
               return_logprob: bool, top: int, stream: bool) -> EngineStream:
        try:
            return EngineStream(self.engine, GenerateArgs(
                prompts=prompts, input_ids=input_ids, sampling_params=params, return_logprob=return_logprob,
                top_logprobs_num=top, stream=stream, **kwargs))
        except ValueError as exc:
            raise self._openai_error(exc) from None

    def _tok(self, tid: int) -> str:
        return self.engine.tokenizer.decode([tid], skip_special_tokens=False)

    def _sglext(self, out: RolloutOutput, fmt: str) -> Optional[dict]:
        """SGLang's SglExt (routed_experts, cached_tokens_details) plus where the rows start and their format."""
        if out.routed_experts is None:
            return None
        meta = out.meta_info(fmt)
        self.metrics.routing_bytes(fmt, len(meta["routed_experts"]))
        return {"routed_experts": meta["routed_experts"], "cached_tokens_details": {"device": out.cached_tokens},
                "routed_experts_start_len": out.routed_experts_start_len, "routed_experts_format": fmt}

    def _chunk_ext(self, chunk: StreamChunk, fmt: str, incremental: bool) -> Optional[dict]:
        """Incremental: the rows final since the previous chunk; else the whole routing on the last chunk."""
        if not incremental:
            return self._sglext(chunk.output, fmt) if chunk.finished else None
        if chunk.routed_experts is None:
            return None
        info = self.engine.info
        enc = encode_engine_rows(chunk.routed_experts, fmt, num_experts=info.num_experts,
                                 start=chunk.routed_experts_start, layer_ids=info.moe_layer_ids)
        self.metrics.routing_bytes(fmt, len(enc))
        return {"routed_experts": enc, "routed_experts_start": chunk.routed_experts_start,
                "routed_experts_format": fmt}

    @staticmethod
    def _finish(out: RolloutOutput) -> tuple[str, Any]:
        return out.finish_reason, out.finish_info.get("matched")

    @staticmethod
    def _usage(outs: list[RolloutOutput], prompt_of: dict[str, int]) -> dict:
        """Each prompt's tokens counted once (its n samples share it), as OpenAI does."""
        prompt = sum({prompt_of[o.rid]: o.prompt_tokens for o in outs}.values())
        completion = sum(o.completion_tokens for o in outs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    # ---- /v1/completions ------------------------------------------------------------------------------
    def _completion_logprobs(self, ids: list[int], lps: Optional[list], tops: Optional[list], offset0: int) -> dict:
        tokens = [self._tok(t) for t in ids]
        offsets, pos = [], offset0
        for s in tokens:
            offsets.append(pos)
            pos += len(s)
        top = None
        if tops is not None:
            top = [{self._tok(t): lp for lp, t in row} for row in tops]
        return {"tokens": tokens, "token_logprobs": list(lps or []), "top_logprobs": top, "text_offset": offsets}

    async def completions(self, body: dict, request: Request) -> Response:
        prompt = body.get("prompt")
        prompts = input_ids = None
        if isinstance(prompt, str):
            prompts = [prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            prompts = prompt
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                         for t in prompt):
            input_ids = [prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
            input_ids = prompt
        else:
            raise ApiError(400, "prompt must be a string, a list of strings, a list of token ids or a list of "
                                "such lists", param="prompt")
        if prompts is not None:
            self.bound.check(prompts, "prompt", single=isinstance(prompt, str))
            if sum(map(len, prompts)) > OFF_LOOP_CHARS:
                input_ids, prompts = await self.bound.tokenize(prompts, "prompt"), None
        params, kwargs = self._common(body, default_max=16)
        logprobs = _get(body, "logprobs", (int,), None)
        stream = _get(body, "stream", (bool,), False)
        fmt = routing_format(body.get("routed_experts_format"))
        include_usage = bool((_get(body, "stream_options", (dict,), {}) or {}).get("include_usage"))
        echo = _get(body, "echo", (bool,), False)
        if echo:
            CompletionEcho.check(stream, logprobs)
            if logprobs is not None:
                kwargs["logprob_start_len"] = 0
        es = self._start(prompts=prompts, input_ids=input_ids, params=params, kwargs=kwargs,
                         return_logprob=logprobs is not None, top=logprobs or 0, stream=stream)
        text_pos = {rid: 0 for rid in es.rids}
        echoed = CompletionEcho(prompts=prompts, input_ids=input_ids, prompt_index=es.submission.prompt_index,
                                decode=lambda ids: self.engine.tokenizer.decode(ids, skip_special_tokens=False)) \
            if echo else None

        def body_of(out: RolloutOutput) -> dict:
            if echoed is not None:
                lp = None if logprobs is None else echoed.logprobs(out, self._completion_logprobs)
                return {"text": echoed.text(out.rid) + out.text, "logprobs": lp}
            lp = None if logprobs is None else self._completion_logprobs(
                out.output_ids, out.output_logprobs, out.output_top_logprobs, 0)
            return {"text": out.text, "logprobs": lp}

        def delta_of(chunk: StreamChunk) -> dict:
            lp = None if logprobs is None else self._completion_logprobs(
                chunk.output_ids, chunk.output_logprobs, chunk.output_top_logprobs, text_pos[chunk.rid])
            text = chunk.text
            if echoed is not None and echoed.first_time(chunk.rid):
                text = echoed.text(chunk.rid) + text
            text_pos[chunk.rid] += len(text)
            return {"text": text, "logprobs": lp}

        return await self._respond(es, request, id_prefix="cmpl", objects=("text_completion", "text_completion"),
                                   fmt=fmt, stream=stream, include_usage=include_usage,
                                   body_of=body_of, delta_of=delta_of, **self._options(body))

    # ---- /v1/chat/completions -------------------------------------------------------------------------
    @staticmethod
    def _messages(body: dict) -> list[dict]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "messages must be a non-empty list", param="messages")
        out = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ApiError(400, f"messages[{i}] must be an object with a string role", param="messages")
            content = m.get("content")
            if isinstance(content, list):
                parts = []
                for part in content:
                    if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                        raise ApiError(400, f"messages[{i}].content: only text parts are supported", param="messages")
                    parts.append(part["text"])
                content = "".join(parts)
            elif content is None:
                content = ""
            elif not isinstance(content, str):
                raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts",
                               param="messages")
            msg = {k: v for k, v in m.items() if k in ("role", "name", "tool_calls", "tool_call_id")}
            msg["content"] = content
            out.append(msg)
        return out

    def _chat_logprobs(self, ids: list[int], lps: Optional[list], tops: Optional[list]) -> dict:
        content = []
        for j, tid in enumerate(ids):
            s = self._tok(tid)
            entry = {"token": s, "logprob": lps[j] if lps else None, "bytes": list(s.encode("utf-8")),
                     "top_logprobs": []}
            if tops is not None:
                entry["top_logprobs"] = [{"token": self._tok(t), "logprob": lp,
                                          "bytes": list(self._tok(t).encode("utf-8"))} for lp, t in tops[j]]
            content.append(entry)
        return {"content": content}

    async def chat(self, body: dict, request: Request) -> Response:
        messages = self._messages(body)
        tools = _get(body, "tools", (list,), None)
        if body.get("tool_choice") not in (None, "none", "auto"):
            raise ApiError(400, "tool_choice must be 'none' or 'auto' (no forced tool calls)", param="tool_choice")
        fmt_obj = body.get("response_format")
        if fmt_obj not in (None, {"type": "text"}):
            raise ApiError(400, "response_format must be {'type': 'text'} (no constrained decoding)",
                           param="response_format")
        # NOTE: the template only adds text: contents that cannot fit are refused before it renders them
        self.bound.check_length(sum(len(m["content"]) for m in messages), "messages", "messages")
        try:
            ids = await asyncio.to_thread(self.engine.tokenizer.apply_chat_template, messages, True, tools)
        except Exception as exc:  # noqa: BLE001 (template errors come from jinja)
            raise ApiError(400, f"cannot apply the chat template: {type(exc).__name__}: {exc}"[:500],
                           param="messages") from None
        room = min(self.engine.context_length, self.engine.kv_capacity) - len(ids)
        params, kwargs = self._common(body, default_max=max(1, room))
        want_lp = _get(body, "logprobs", (bool,), False)
        top = _get(body, "top_logprobs", (int,), 0)
        if top and not want_lp:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        stream = _get(body, "stream", (bool,), False)
        fmt = routing_format(body.get("routed_experts_format"))
        include_usage = bool((_get(body, "stream_options", (dict,), {}) or {}).get("include_usage"))
        es = self._start(input_ids=[ids], params=params, kwargs=kwargs, return_logprob=want_lp, top=top,
                         stream=stream)
        def body_of(out: RolloutOutput) -> dict:
            lp = self._chat_logprobs(out.output_ids, out.output_logprobs, out.output_top_logprobs) if want_lp else None
            return {"message": {"role": "assistant", "content": out.text}, "logprobs": lp}

        def delta_of(chunk: StreamChunk) -> dict:
            lp = self._chat_logprobs(chunk.output_ids, chunk.output_logprobs,
                                     chunk.output_top_logprobs) if want_lp else None
            return {"delta": {"content": chunk.text}, "logprobs": lp}

        opening = [{"delta": {"role": "assistant", "content": ""}, "logprobs": None}]  # per choice, first
        return await self._respond(es, request, id_prefix="chatcmpl",
                                   objects=("chat.completion", "chat.completion.chunk"), fmt=fmt,
                                   stream=stream, include_usage=include_usage, body_of=body_of,
                                   delta_of=delta_of, opening=opening[0], **self._options(body))

    # ---- shared by both endpoints ------------------------------------------------------------------
    def _options(self, body: dict) -> dict:
        return {"token_ids": _get(body, "return_token_ids", (bool,), False),
                "incremental": _get(body, "incremental_streaming_output", (bool,), self.incremental_streaming)}

    async def _respond(self, es: "EngineStream", request: Request, *, id_prefix: str, objects: tuple[str, str],
                       fmt: str, stream: bool, include_usage: bool,
                       body_of: Callable[[RolloutOutput], dict], delta_of: Callable[[StreamChunk], dict],
                       opening: Optional[dict] = None, token_ids: bool = False, incremental: bool = False) -> Response:
        """One response object (choices from body_of), or an SSE stream of chunks (choices from
        delta_of; `opening` first for every choice), each choice with its index, finish reason and
        matched stop; routing in the response-level `sglext` (SGLang's place: the first choice's;
        with several choices each also carries its own `sglext`); usage at the end when asked."""
        whole, chunk_obj = objects
        meta = {"id": f"{id_prefix}-{uuid.uuid4().hex}", "created": int(time.time()), "model": self.model_name}
        if not stream:
            outs = await es.outputs(request)

            def build() -> bytes:
                return dumps_bytes(self._answer(outs, es, meta, whole, fmt, body_of, token_ids))

            # NOTE: a large answer is built on a worker thread, so the loop keeps serving while it is encoded
            return JSONBytesResponse(await asyncio.to_thread(build) if large_answer(outs) else build())
        return self._stream(es, meta, chunk_obj, fmt, include_usage, delta_of, opening, token_ids, incremental)

    def _answer(self, outs: list[RolloutOutput], es: "EngineStream", meta: dict, whole: str, fmt: str,
                body_of: Callable[[RolloutOutput], dict], token_ids: bool) -> dict:
        """The whole answer object of a non-streaming request."""
        choices, exts = [], []
        for i, out in enumerate(outs):
            reason, matched = self._finish(out)
            choice = {"index": i, **body_of(out), "finish_reason": reason, "matched_stop": matched}
            if token_ids:
                choice.update(token_ids=list(out.output_ids), prompt_token_ids=list(out.prompt_ids))
            exts.append(self._sglext(out, fmt))
            if exts[-1] is not None and len(outs) > 1:
                choice["sglext"] = exts[-1]
            choices.append(choice)
        usage = self._usage(outs, es.submission.prompt_index)
        answer = {**meta, "object": whole, "choices": choices, "usage": usage,
                  "metadata": {"weight_version": outs[0].weight_version}}
        if exts and exts[0] is not None:
            answer["sglext"] = exts[0]
        return answer

    def _stream(self, es: "EngineStream", meta: dict, chunk_obj: str, fmt: str, include_usage: bool,
                delta_of: Callable[[StreamChunk], dict], opening: Optional[dict], token_ids: bool,
                incremental: bool) -> Response:
        """The SSE stream of a streaming request (openai_stream.py)."""
        return openai_stream(self, es, meta, chunk_obj, fmt, include_usage, delta_of, opening, token_ids,
                             incremental)
