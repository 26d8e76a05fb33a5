"""SGLang's /generate: each body a GenerateCall (GenerateReqInput's fields mapped onto GenerateArgs;
here only the HTTP-shaped checks: JSON types, field names, SGLang's field policy, while the front end
checks the values), answered whole in SGLang's `{text, output_ids, meta_info}` shape or as an SSE
stream (GenerateStream)."""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Optional

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response

from capture.codec import ROW_DTYPES
from rollout.frontend.api import Rollout
from rollout.frontend.async_generation import EngineStream
from rollout.frontend.engine_client import RidInFlightError
from rollout.generate_io import GenerateArgs, RolloutOutput, per_prompt, progress_meta
from rollout.server.args import ServerArgs
from rollout.server.generate_stream import GenerateStream
from rollout.server.http_io import (OFF_LOOP_CHARS, ApiError, FieldPolicy, IgnoredFields, JSONBytesResponse,
                                    SSEResponse, TextBound, dumps_bytes, large_answer, param_of, read_json,
                                    routing_format, typed)
from rollout.server.metrics import Metrics

GENERATE = FieldPolicy(
    endpoint="/generate",
    acted=frozenset({"text", "input_ids", "sampling_params", "rid", "return_logprob", "logprob_start_len",
                     "top_logprobs_num", "return_routed_experts", "routed_experts_start_len",
                     "routed_experts_format", "stream", "return_text_in_logprobs", "data_parallel_rank",
                     "routed_dp_rank", "cache_salt", "extra_key", "incremental_streaming_output",
                     "routed_experts_dtype"}),
    # SGLang fields that change nothing in the result here (logging, disaggregation, scheduling hints)
    accepted=frozenset({"log_metrics", "bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key",
                        "priority", "custom_labels", "no_logs", "conversation_id", "background",
                        "external_trace_header", "received_time", "stream_output"}),
    only_null=frozenset({"lora_path", "lora_id", "custom_logit_processor", "image_data", "video_data", "audio_data",
                         "input_embeds", "session_params", "token_ids_logprob", "modalities", "return_hidden_states",
                         "return_indexer_topk", "return_entropy"}))
SAMPLING = FieldPolicy(
    endpoint="/generate", prefix="sampling_params.",
    acted=frozenset({"temperature", "top_p", "top_k", "min_p", "max_new_tokens", "min_new_tokens", "stop",
                     "stop_token_ids", "stop_regex", "ignore_eos", "no_stop_trim", "skip_special_tokens", "n",
                     "sampling_seed", "frequency_penalty", "presence_penalty", "repetition_penalty", "logprob_mode",
                     "spaces_between_special_tokens", "stream_interval"}),
    # custom_params feed a custom_logit_processor only (refused unless null): no effect here
    accepted=frozenset({"custom_params"}),
    only_null=frozenset({"json_schema", "regex", "ebnf", "structural_tag", "logit_bias"}))
# names an engine ValueError may start with, mapped to the request's `param`
# routed_experts_dtype (slime's streaming rollout sends it): raw little-endian ids of this width; for
# uint8 the -1 of a dense layer is 255
ERROR_PARAMS = GENERATE.acted | SAMPLING.acted | {"sampling_params", "prompts", "context"}


def _given(body: dict, name: str, default: Any) -> Any:
    """The field as given (the front end checks its values), JSON null as the default, also per prompt."""
    value = body.get(name)
    if isinstance(value, list):
        return [default if v is None else v for v in value]
    return default if value is None else value


@dataclass(kw_only=True)
class GenerateCall:
    args: GenerateArgs             # Rollout.submit's request
    batch: bool                    # the answer is a list (text / input_ids were lists)
    prompts: list[list[int]]
    fmt: str                       # routed_experts_format
    incremental: bool              # incremental streaming chunks (else SGLang's cumulative)
    text_in_logprobs: bool
    routing_dtype: str = "int32"
    t0: float = field(default_factory=time.time)

    @staticmethod
    def parse(body: dict, ignored: IgnoredFields, *, tokenize: Callable[[list[str]], list[list[int]]],
              incremental_default: bool, num_experts: int = 0, routing_default: bool = False) -> "GenerateCall":
        body = GENERATE.screen(body, ignored)
        batch, prompts = _prompts(body, tokenize)
        sp = body.get("sampling_params")
        if isinstance(sp, list):
            sp = [SAMPLING.screen(p, ignored) if isinstance(p, dict) else p for p in sp]
        elif isinstance(sp, dict):
            sp = SAMPLING.screen(sp, ignored)
        rid = body.get("rid")
        if batch and isinstance(rid, str):
            rid = [f"{rid}_{i}" for i in range(len(prompts))]
        args = GenerateArgs(
            input_ids=prompts, sampling_params=sp, rid=rid, stream=typed(body, "stream", (bool,), False),
            return_logprob=_given(body, "return_logprob", False), top_logprobs_num=_given(body, "top_logprobs_num", 0),
            logprob_start_len=_given(body, "logprob_start_len", -1),
            return_routed_experts=_given(body, "return_routed_experts", routing_default),
            routed_experts_start_len=_given(body, "routed_experts_start_len", 0),
            routed_dp_rank=body["routed_dp_rank"] if body.get("routed_dp_rank") is not None
            else body.get("data_parallel_rank"), cache_salt=_cache_salts(body, len(prompts)))
        fmt = routing_format(body.get("routed_experts_format"))
        return GenerateCall(
            args=args, routing_dtype=_routing_dtype(body, fmt, num_experts), batch=batch, prompts=prompts, fmt=fmt,
            text_in_logprobs=typed(body, "return_text_in_logprobs", (bool,), False),
            incremental=typed(body, "incremental_streaming_output", (bool,), incremental_default))

    @property
    def stream(self) -> bool:
        return self.args.stream

    @functools.cached_property
    def logprob_starts(self) -> list[int]:
        """Per prompt: where input_token_logprobs begins, SGLang's len - 1 for -1 (or past the prompt).
        Read once the front end has accepted the request (its values are checked there)."""
        given = self.args.per_prompt("logprob_start_len", len(self.prompts))
        return [s if 0 <= s < len(p) - 1 else max(0, len(p) - 1) for s, p in zip(given, self.prompts)]

    # ---- results -------------------------------------------------------------------------------------
    def token_entry(self, decode: Callable[[int], str]) -> Callable[[Any, int], list]:
        if self.text_in_logprobs:
            return lambda lp, t: [lp, t, decode(t)]
        return lambda lp, t: [lp, t, None]

    def meta_info(self, out: RolloutOutput, prompt: int, decode: Callable[[int], str]) -> dict[str, Any]:
        """SGLang's meta_info for a finished request (e2e_latency from the request's arrival)."""
        logprobs = out.output_logprobs is not None
        meta = out.meta_info(self.fmt, self.routing_dtype, token_entry=self.token_entry(decode) if logprobs else None)
        meta["total_retractions"] = out.num_retractions
        meta["e2e_latency"] = time.time() - self.t0
        if logprobs:
            meta.update(self.input_logprobs(prompt, out.output_top_logprobs is not None, decode,
                                            out.input_logprobs, out.input_top_logprobs))
        return meta

    def progress_meta(self, rid: str, prompt: int, completion_tokens: int, weight_version: str) -> dict[str, Any]:
        """An unfinished stream chunk's meta_info head."""
        return progress_meta(rid, len(self.prompts[prompt]), completion_tokens, weight_version)

    def input_logprobs(self, prompt: int, top: bool, decode: Callable[[int], str], values: Optional[list] = None,
                       tops: Optional[list] = None) -> dict[str, Any]:
        """input_token_logprobs from logprob_start_len on: one entry per prompt token, the first without
        a logprob (null), as SGLang. values: the engine's logprobs of the others ({} until known)."""
        entry = self.token_entry(decode)
        ids = self.prompts[prompt][self.logprob_starts[prompt]:]
        values = values or []
        if len(values) != len(ids) - 1:
            return {}
        out: dict[str, Any] = {"input_token_logprobs": [entry(None, ids[0])] + [
            entry(lp, t) for lp, t in zip(values, ids[1:])]}
        if top:
            out["input_top_logprobs"] = [None] + [[entry(lp, t) for lp, t in row] for row in (tops or [])]
        return out


def _prompts(body: dict, tokenize: Callable[[list[str]], list[list[int]]]) -> tuple[bool, list]:
    """(whether the answer is a list, the prompts' token ids) from text or input_ids."""
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise ApiError(400, "give exactly one of text or input_ids", param="text")
    if text is not None:
        if isinstance(text, str):
            batch, texts = False, [text]
        elif isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            batch, texts = True, text
        else:
            raise ApiError(400, "text must be a string or a non-empty list of strings", param="text")
        prompts = tokenize(texts)
        for i, p in enumerate(prompts):
            if not p:
                name = f"text[{i}]" if batch else "text"
                raise ApiError(400, f"{name} encodes to no tokens: a prompt needs at least one", param="text")
        return batch, prompts
    if isinstance(ids, list) and ids and all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        return False, [ids]
    if isinstance(ids, list) and ids and all(isinstance(p, list) for p in ids):
        return True, ids
    raise ApiError(400, "input_ids must be a list of token ids or a non-empty list of such lists", param="input_ids")


def _routing_dtype(body: dict, fmt: str, num_experts: int) -> str:
    dtype = body.get("routed_experts_dtype") or "int32"
    if dtype not in ROW_DTYPES or (dtype != "int32" and fmt != "int32"):
        raise ApiError(400, f"routed_experts_dtype must be one of {list(ROW_DTYPES)} (with the int32 "
                            f"routed_experts_format), got {dtype!r}"[:300], param="routed_experts_dtype")
    if num_experts > {"int32": 2**31, "int16": 2**15, "uint8": 2**8}[dtype]:
        raise ApiError(400, f"routed_experts_dtype {dtype!r} cannot hold the ids of {num_experts} experts",
                       param="routed_experts_dtype")
    return dtype


def _cache_salts(body: dict, count: int) -> Any:
    """cache_salt and extra_key both isolate the prefix cache (as SGLang combines them); per prompt."""
    salt, key = body.get("cache_salt"), body.get("extra_key")
    if salt is None and key is None:
        return None
    try:
        pairs = zip(per_prompt("cache_salt", salt, count), per_prompt("extra_key", key, count))
    except ValueError as exc:
        raise ApiError(400, str(exc), param=str(exc).split(" ", 1)[0]) from None
    out = []
    for s, k in pairs:
        typed({"cache_salt": s}, "cache_salt", (str,), None)
        typed({"extra_key": k}, "extra_key", (str,), None)
        out.append(None if s is None and k is None else f"{len(s or '')}:{s or ''}|{k or ''}")
    return out


def as_response(call: GenerateCall, outs: list[RolloutOutput], index: dict[str, int],
                decode: Callable[[int], str]) -> Any:
    """index: rid -> prompt index (Submission.prompt_index)."""
    results = [{"text": o.text, "output_ids": list(o.output_ids), "meta_info": call.meta_info(o, index[o.rid], decode)}
               for o in outs]
    return results if call.batch or len(results) > 1 else results[0]


RID_IN_FLIGHT = "rid_in_flight_error"   # the error type clients retry on (the rid's earlier try is not done)


def _engine_error(exc: ValueError, known: set[str]) -> ApiError:
    msg = str(exc)
    if isinstance(exc, RidInFlightError):
        return ApiError(400, msg, type=RID_IN_FLIGHT, param="rid")
    return ApiError(400, msg, param=param_of(msg, known))


def add_generate_routes(app: FastAPI, *, engine: Rollout, args: ServerArgs, metrics: Metrics,
                        ignored: IgnoredFields, blocking: Callable[..., Awaitable[Any]], shutdown: Any) -> None:
    info = engine.info
    bound = TextBound(engine)

    def tokenize(texts: list[str]) -> list[list[int]]:
        return [engine.tokenizer.encode(t) for t in texts]

    def _texts(text: Any) -> list[str]:
        if isinstance(text, str):
            return [text]
        return [t for t in text if isinstance(t, str)] if isinstance(text, list) else []

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        body = await read_json(request)
        texts = _texts(body.get("text"))
        bound.check(texts, "text", single=isinstance(body.get("text"), str))
        if sum(len(t) for t in texts) > OFF_LOOP_CHARS:
            call = await blocking(parse_generate, body)
        else:
            call = parse_generate(body)
        try:
            es = EngineStream(engine, call.args)
        except ValueError as exc:
            err = _engine_error(exc, ERROR_PARAMS)
            if body.get("text") is not None and err.param == "input_ids":
                rest = err.message.removeprefix("input_ids")
                # NOTE: a single text is `text`, not `text[0]` (the engine sees a list of prompts)
                err.param, err.message = "text", "text" + (rest.removeprefix("[0]") if isinstance(
                    body.get("text"), str) else rest)
            raise err from None
        decode = lambda t: engine.tokenizer.decode([t], skip_special_tokens=False)  # noqa: E731
        if not call.stream:
            outs = await es.outputs(request)

            def encode() -> tuple[bytes, list[int]]:
                answer = as_response(call, outs, es.submission.prompt_index, decode)
                items = answer if isinstance(answer, list) else [answer]
                sizes = [len(i["meta_info"]["routed_experts"]) for i in items if "routed_experts" in i["meta_info"]]
                if not isinstance(answer, list):
                    return dumps_bytes(answer), sizes
                # NOTE: one orjson call per item: a call holds the GIL for its whole length
                return b"[" + b",".join(dumps_bytes(i) for i in items) + b"]", sizes

            # NOTE: a large answer is built on a worker thread, so the loop keeps serving while it is encoded
            data, sizes = await blocking(encode) if large_answer(outs) else encode()
            for size in sizes:
                metrics.routing_bytes(call.fmt, size)
            return JSONBytesResponse(data)
        stream = GenerateStream(call, es, engine=engine, metrics=metrics, decode=decode, shutdown=shutdown)
        return SSEResponse(stream.events(), es.close)

    def parse_generate(body: dict) -> GenerateCall:
        return GenerateCall.parse(body, ignored, tokenize=tokenize,
                                  incremental_default=args.incremental_streaming_output, num_experts=info.num_experts,
                                  routing_default=args.default_return_routed_experts)
