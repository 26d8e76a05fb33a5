"""Typed request models (pydantic) of every rollout-serve endpoint, published at /openapi.json and /docs.

They describe the bodies for clients, generators and fuzzers. The handlers keep checking the raw
JSON themselves, so the answers stay SGLang's and this server's (unknown fields ignored and
counted, 400 bodies `{"error": {message, type, param, code}}` naming the field and the range).
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict, Field

IntList = list[int]
Open = ConfigDict(extra="allow")   # unknown fields are accepted (and ignored), as SGLang


class SamplingParamsBody(BaseModel):
    model_config = Open
    temperature: Optional[float] = Field(None, ge=0, le=100, description="0 (below 1e-6): greedy")
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=-1, description="-1 or 0: disabled")
    min_p: Optional[float] = Field(None, ge=0, le=1)
    max_new_tokens: Optional[int] = Field(None, ge=0)
    min_new_tokens: Optional[int] = Field(None, ge=0)
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[IntList] = None
    stop_regex: Optional[Union[str, list[str]]] = None
    ignore_eos: Optional[bool] = None
    no_stop_trim: Optional[bool] = None
    skip_special_tokens: Optional[bool] = None
    spaces_between_special_tokens: Optional[bool] = None
    n: Optional[int] = Field(None, ge=1, le=1024)
    sampling_seed: Optional[int] = Field(None, ge=0, le=2**63 - 1)
    frequency_penalty: Optional[float] = Field(None, ge=-2, le=2)
    presence_penalty: Optional[float] = Field(None, ge=-2, le=2)
    repetition_penalty: Optional[float] = Field(None, gt=0, le=2)
    logprob_mode: Optional[Literal["raw", "scaled", "processed"]] = None
    stream_interval: Optional[int] = Field(None, ge=1)
    custom_params: Optional[dict[str, Any]] = Field(None, description="accepted, no effect")
    json_schema: None = Field(None, description="not supported: null only")
    regex: None = Field(None, description="not supported: null only")
    ebnf: None = Field(None, description="not supported: null only")


class GenerateRequest(BaseModel):
    model_config = Open
    text: Optional[Union[str, list[str]]] = Field(None, description="exactly one of text / input_ids")
    input_ids: Optional[Union[IntList, list[IntList]]] = None
    sampling_params: Optional[Union[SamplingParamsBody, list[SamplingParamsBody]]] = None
    rid: Optional[Union[str, list[str]]] = None
    return_logprob: Optional[Union[bool, list[bool]]] = None
    logprob_start_len: Optional[Union[int, IntList]] = Field(None, description="-1, or >= 0: prompt logprobs")
    top_logprobs_num: Optional[Union[int, IntList]] = None
    return_text_in_logprobs: Optional[bool] = None
    stream: Optional[bool] = None
    incremental_streaming_output: Optional[bool] = None
    return_routed_experts: Optional[Union[bool, list[bool]]] = None
    routed_experts_start_len: Optional[Union[int, IntList]] = None
    routed_experts_format: Optional[Literal["int32", "compact"]] = None
    routed_experts_dtype: Optional[Literal["int32", "int16", "uint8"]] = None
    cache_salt: Optional[Union[str, list[str]]] = None
    extra_key: Optional[Union[str, list[str]]] = None
    data_parallel_rank: Optional[int] = None
    routed_dp_rank: Optional[Union[int, list[Optional[int]]]] = None
    image_data: None = Field(None, description="text-only models: null only")
    lora_path: None = Field(None, description="not supported: null only")


class _OpenAISampling(BaseModel):
    """The fields /v1/completions and /v1/chat/completions share (openai_serving.py `_common`)."""
    model_config = Open
    model: Optional[str] = None
    max_tokens: Optional[int] = Field(None, ge=0, description="prompt + max_tokens must fit the context length")
    max_completion_tokens: Optional[int] = Field(None, ge=0)
    temperature: Optional[float] = Field(None, ge=0, le=100)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=-1)
    min_p: Optional[float] = Field(None, ge=0, le=1)
    n: Optional[int] = Field(None, ge=1, le=1024)
    best_of: Optional[int] = Field(None, ge=1, le=1024, description="must equal n")
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[IntList] = None
    seed: Optional[int] = Field(None, ge=0, le=2**63 - 1)
    min_tokens: Optional[int] = Field(None, ge=0)
    presence_penalty: Optional[float] = Field(None, ge=-2, le=2)
    frequency_penalty: Optional[float] = Field(None, ge=-2, le=2)
    repetition_penalty: Optional[float] = Field(None, gt=0, le=2)
    ignore_eos: Optional[bool] = None
    skip_special_tokens: Optional[bool] = None
    spaces_between_special_tokens: Optional[bool] = None
    no_stop_trim: Optional[bool] = None
    logprob_mode: Optional[Literal["raw", "scaled", "processed"]] = None
    stream: Optional[bool] = None
    stream_options: Optional[dict[str, Any]] = Field(None, description="include_usage: bool")
    rid: Optional[str] = Field(None, min_length=1)
    return_routed_experts: Optional[bool] = None
    routed_experts_start_len: Optional[int] = Field(None, ge=0, description="at most the prompt length")
    routed_experts_format: Optional[Literal["int32", "compact"]] = None
    return_token_ids: Optional[bool] = None
    incremental_streaming_output: Optional[bool] = None
    suffix: None = Field(None, description="not supported: null only")
    logit_bias: None = Field(None, description="not supported: null only")
    regex: None = Field(None, description="not supported: null only")
    json_schema: None = Field(None, description="not supported: null only")
    ebnf: None = Field(None, description="not supported: null only")
    lora_path: None = Field(None, description="not supported: null only")


class CompletionRequest(_OpenAISampling):
    prompt: Union[str, list[str], IntList, list[IntList]]
    logprobs: Optional[int] = Field(None, ge=0, le=64, description="top alternatives per token")
    echo: Optional[bool] = Field(None, description="the prompt before the completion; not with both stream and "
                                                   "logprobs")


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = Open
    role: str = Field(..., min_length=1)
    content: Optional[Union[str, list[TextPart]]] = None
    name: Optional[str] = None
    tool_call_id: Optional[str] = None


class TextResponseFormat(BaseModel):
    type: Literal["text"]


class ChatCompletionRequest(_OpenAISampling):
    messages: list[ChatMessage] = Field(..., min_length=1)
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(None, ge=0, le=64, description="needs logprobs: true")
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Literal["none", "auto"]] = None
    response_format: Optional[TextResponseFormat] = None


class AbortRequest(BaseModel):
    model_config = Open
    rid: Optional[str] = Field(None, description="empty or absent: aborts nothing")
    abort_all: Optional[bool] = None


class PauseRequest(BaseModel):
    model_config = Open
    mode: Optional[Literal["abort", "retract", "in_place"]] = None


class ContinueRequest(BaseModel):
    model_config = Open


class UpdateWeightsFromDiskRequest(BaseModel):
    model_config = Open
    model_path: str
    weight_version: Optional[str] = Field(None, max_length=256)
    abort_all_requests: Optional[bool] = None
    load_format: Optional[Literal["auto", "safetensors"]] = None
    flush_cache: Optional[bool] = Field(None, description="accepted; the cache is always flushed")


class UpdateWeightsFromTensorRequest(BaseModel):
    model_config = Open
    serialized_named_tensors: Union[str, list[str]] = Field(..., description="base64 safetensors bytes (or SGLang's "
                                                                             "pickles with "
                                                                             "--allow-pickled-weight-tensors)")
    load_format: Optional[Literal["safetensors", "direct", "flattened_bucket"]] = None
    weight_version: Optional[str] = Field(None, max_length=256)
    abort_all_requests: Optional[bool] = None
    flush_cache: Optional[bool] = None


class InitWeightsUpdateGroupRequest(BaseModel):
    model_config = Open
    master_address: str
    master_port: Union[int, str] = Field(..., description="an integer or a decimal string")
    rank_offset: int = Field(..., ge=1)
    world_size: int = Field(..., ge=2)
    group_name: Optional[str] = "weight_update_group"
    backend: Optional[Literal["gloo", "nccl"]] = None
    pp_rank: Optional[int] = Field(None, ge=0)
    timeout_s: Optional[float] = Field(None, gt=0, le=3600)


class UpdateWeightsFromDistributedRequest(BaseModel):
    model_config = Open
    names: list[str]
    dtypes: list[str]
    shapes: list[IntList]
    weight_version: Optional[str] = Field(None, max_length=256)
    abort_all_requests: Optional[bool] = None
    load_format: Optional[Literal["flattened_bucket"]] = None
    group_name: Optional[str] = None


class DestroyWeightsUpdateGroupRequest(BaseModel):
    model_config = Open
    group_name: Optional[str] = None


class UpdateWeightVersionRequest(BaseModel):
    model_config = Open
    new_version: str = Field(..., max_length=256)
    abort_all_requests: Optional[bool] = True


class MemoryOccupationRequest(BaseModel):
    model_config = Open
    tags: Optional[list[Literal["weights", "kv_cache", "cuda_graph"]]] = Field(None, description="null: all")


class GetWeightsByNameRequest(BaseModel):
    model_config = Open
    name: str = Field(..., min_length=1, description="a checkpoint tensor name, e.g. lm_head.weight")
    truncate_size: Optional[int] = Field(100, ge=1, le=1 << 20, description="entries kept along dim 0")


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[int] = None


class ErrorBody(BaseModel):
    error: ErrorDetail


# path -> (model, body required)
REQUEST_MODELS: dict[str, tuple[type[BaseModel], bool]] = {
    "/generate": (GenerateRequest, True), "/v1/completions": (CompletionRequest, True),
    "/v1/chat/completions": (ChatCompletionRequest, True), "/abort_request": (AbortRequest, False),
    "/pause_generation": (PauseRequest, False), "/continue_generation": (ContinueRequest, False),
    "/update_weights_from_disk": (UpdateWeightsFromDiskRequest, True),
    "/update_weights_from_tensor": (UpdateWeightsFromTensorRequest, True),
    "/init_weights_update_group": (InitWeightsUpdateGroupRequest, True),
    "/update_weights_from_distributed": (UpdateWeightsFromDistributedRequest, True),
    "/destroy_weights_update_group": (DestroyWeightsUpdateGroupRequest, False),
    "/update_weight_version": (UpdateWeightVersionRequest, True),
    "/release_memory_occupation": (MemoryOccupationRequest, False),
    "/resume_memory_occupation": (MemoryOccupationRequest, False),
    "/get_weights_by_name": (GetWeightsByNameRequest, True),
}


def install_openapi(app: FastAPI, version: str) -> None:
    """app.openapi() with the request models as the POST bodies and ErrorBody as the 4xx answers."""
    def build() -> dict:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(title="rollout-serve", version=version, routes=app.routes,
                             description="SGLang-compatible rollout server with routed-expert capture "
                                         "(docs/protocol.md)")
        comps = schema.setdefault("components", {}).setdefault("schemas", {})

        def ref(model: type[BaseModel]) -> dict:
            js = model.model_json_schema(ref_template="#/components/schemas/{model}")
            comps.update(js.pop("$defs", {}))
            comps[model.__name__] = js
            return {"$ref": f"#/components/schemas/{model.__name__}"}

        error = {"description": "invalid request (the field is named in error.param)",
                 "content": {"application/json": {"schema": ref(ErrorBody)}}}
        for path, (model, required) in REQUEST_MODELS.items():
            op = schema.get("paths", {}).get(path, {}).get("post")
            if op is None:
                continue
            op["requestBody"] = {"required": required, "content": {"application/json": {"schema": ref(model)}}}
            op.setdefault("responses", {})["400"] = error
        app.openapi_schema = schema
        return schema

    app.openapi = build  # type: ignore[method-assign]
