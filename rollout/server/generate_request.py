"""GenerateCall: one SGLang `/generate` body (GenerateReqInput's fields), checked and mapped onto the
engine's arguments, and the SGLang `{text, output_ids, meta_info}` view of its results."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from capture.codec import ROW_DTYPES
from rollout.server.ignored_fields import FieldPolicy, IgnoredFields
from rollout.server.responses import ApiError
from rollout.server.routing_format import check_routing_format, encode_rows
from rollout.generate_io import RolloutOutput

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


def typed(body: dict, name: str, types: tuple, default: Any) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
        raise ApiError(400, f"{name} has the wrong type ({type(value).__name__})", param=name)
    return value


def _per_prompt(body: dict, name: str, count: int, types: tuple, default: Any) -> list:
    """A field given once for all prompts or as a list with one entry per prompt."""
    value = body.get(name)
    if isinstance(value, list):
        if len(value) != count:
            raise ApiError(400, f"{name} has {len(value)} entries for {count} prompts", param=name)
        return [typed({name: v}, name, types, default) for v in value]
    return [typed(body, name, types, default)] * count


@dataclass(kw_only=True)
class GenerateCall:
    kwargs: dict                   # Rollout.submit's arguments
    batch: bool                    # the answer is a list (text / input_ids were lists)
    prompts: list[list[int]]
    fmt: str                       # routed_experts_format
    stream: bool
    incremental: bool              # incremental streaming chunks (else SGLang's cumulative)
    text_in_logprobs: bool
    logprob_starts: list[int]      # per prompt: first position of input_token_logprobs
    routing_dtype: str = "int32"
    t0: float = field(default_factory=time.time)

    @staticmethod
    def parse(body: dict, ignored: IgnoredFields, *, tokenize: Callable[[list[str]], list[list[int]]],
              incremental_default: bool, num_experts: int = 0, routing_default: bool = False) -> "GenerateCall":
        body = GENERATE.screen(body, ignored)
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
                    raise ApiError(400, f"text[{i}] encodes to no tokens: a prompt needs at least one", param="text")
        elif isinstance(ids, list) and ids and all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            batch, prompts = False, [ids]
        elif isinstance(ids, list) and ids and all(isinstance(p, list) for p in ids):
            batch, prompts = True, ids
        else:
            raise ApiError(400, "input_ids must be a list of token ids or a non-empty list of such lists",
                           param="input_ids")
        count = len(prompts)
        sp = body.get("sampling_params")
        if isinstance(sp, list):
            sp = [SAMPLING.screen(p, ignored) if isinstance(p, dict) else p for p in sp]
        elif isinstance(sp, dict):
            sp = SAMPLING.screen(sp, ignored)
        return_logprob = _per_prompt(body, "return_logprob", count, (bool,), False)
        given = _per_prompt(body, "logprob_start_len", count, (int,), -1)
        starts = []   # where input_token_logprobs begins: SGLang's len - 1 for -1 (or past the prompt)
        for s, p in zip(given, prompts):
            if s < -1:
                raise ApiError(400, f"logprob_start_len must be -1 or an integer >= 0, got {s}",
                               param="logprob_start_len")
            n = len(p) if isinstance(p, list) else 1
            starts.append(s if 0 <= s < n - 1 else max(0, n - 1))
        rid = body.get("rid")
        if batch and isinstance(rid, str):
            rid = [f"{rid}_{i}" for i in range(count)]
        salts = [_cache_salt(s, k) for s, k in zip(_per_prompt(body, "cache_salt", count, (str,), None),
                                                   _per_prompt(body, "extra_key", count, (str,), None))]
        stream = typed(body, "stream", (bool,), False)
        start_len = body.get("routed_experts_start_len")
        kwargs = dict(input_ids=prompts, sampling_params=sp, return_logprob=return_logprob,
                      top_logprobs_num=_per_prompt(body, "top_logprobs_num", count, (int,), 0),
                      return_routed_experts=_per_prompt(body, "return_routed_experts", count, (bool,), routing_default),
                      routed_experts_start_len=0 if start_len is None else start_len, rid=rid, stream=stream,
                      routed_dp_rank=body["routed_dp_rank"] if body.get("routed_dp_rank") is not None
                      else body.get("data_parallel_rank"), cache_salt=salts, logprob_start_len=given)
        fmt = check_routing_format(body.get("routed_experts_format"))
        dtype = body.get("routed_experts_dtype") or "int32"
        if dtype not in ROW_DTYPES or (dtype != "int32" and fmt != "int32"):
            raise ApiError(400, f"routed_experts_dtype must be one of {list(ROW_DTYPES)} (with the int32 "
                                f"routed_experts_format), got {dtype!r}"[:300], param="routed_experts_dtype")
        if num_experts > {"int32": 2**31, "int16": 2**15, "uint8": 2**8}[dtype]:
            raise ApiError(400, f"routed_experts_dtype {dtype!r} cannot hold the ids of {num_experts} experts",
                           param="routed_experts_dtype")
        return GenerateCall(
            kwargs=kwargs, routing_dtype=dtype, batch=batch, prompts=prompts, fmt=fmt,
            stream=stream, text_in_logprobs=typed(body, "return_text_in_logprobs", (bool,), False),
            incremental=typed(body, "incremental_streaming_output", (bool,), incremental_default),
            logprob_starts=starts)

    # ---- results -------------------------------------------------------------------------------------
    def token_entry(self, decode: Callable[[int], str]) -> Callable[[float, int], list]:
        if self.text_in_logprobs:
            return lambda lp, t: [lp, t, decode(t)]
        return lambda lp, t: [lp, t, None]

    def meta_info(self, out: RolloutOutput, prompt: int, decode: Callable[[int], str]) -> dict[str, Any]:
        """SGLang's meta_info for a finished request (e2e_latency from the request's arrival)."""
        meta = out.meta_info(self.fmt, self.routing_dtype)
        meta["total_retractions"] = out.num_retractions
        meta["e2e_latency"] = time.time() - self.t0
        if out.output_logprobs is not None:
            entry = self.token_entry(decode)
            meta["output_token_logprobs"] = [entry(lp, t) for lp, t in zip(out.output_logprobs, out.output_ids)]
            meta.update(self.input_logprobs(prompt, out.output_top_logprobs is not None, decode,
                                            out.input_logprobs, out.input_top_logprobs))
            if out.output_top_logprobs is not None:
                meta["output_top_logprobs"] = [[entry(lp, t) for lp, t in row] for row in out.output_top_logprobs]
        return meta

    def encode_routing(self, rows: Any, start: int, info: Any) -> str:
        """[rows, L, K] ids in this request's wire format (int32 / compact / routed_experts_dtype)."""
        return encode_rows(rows, self.fmt, start, info, self.routing_dtype)

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


def _cache_salt(salt: Optional[str], extra_key: Optional[str]) -> Optional[str]:
    """cache_salt and extra_key both isolate the prefix cache (as SGLang combines them)."""
    if salt is None and extra_key is None:
        return None
    return f"{len(salt or '')}:{salt or ''}|{extra_key or ''}"


def as_response(call: GenerateCall, outs: list[RolloutOutput], index: dict[str, int],
                decode: Callable[[int], str]) -> Any:
    """index: rid -> prompt index (Submission.prompt_index)."""
    results = [{"text": o.text, "output_ids": list(o.output_ids), "meta_info": call.meta_info(o, index[o.rid], decode)}
               for o in outs]
    return results if call.batch or len(results) > 1 else results[0]
