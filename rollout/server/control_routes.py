"""The control and weight endpoints of rollout-serve in SGLang's request and reply shapes
(io_struct: AbortReq, PauseGenerationReqInput, UpdateWeightFromDiskReqInput,
UpdateWeightsFromTensorReqInput, InitWeightsUpdateGroupReqInput, ...)."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Awaitable, Callable
from urllib.parse import parse_qs

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response

from rollout.ipc.control_values import PAUSE_MODES
from rollout.server.http_io import ApiError, FieldPolicy, IgnoredFields, json_response, read_json, typed
from rollout.server.args import ServerArgs
from rollout.server.weight_updater import WeightUpdateError, WeightUpdater

# accepted, no effect here: the prefix cache is always flushed on a weight change (cached routing must
# not outlive its weights); the rest are SGLang scheduling/graph knobs
WEIGHT_ACCEPTED = frozenset({"flush_cache", "load_format", "is_async", "torch_empty_cache", "keep_pause",
                             "recapture_cuda_graph", "token_step"})
ABORT = FieldPolicy(endpoint="/abort_request", acted=frozenset({"rid", "abort_all", "abort_message"}))
PAUSE = FieldPolicy(endpoint="/pause_generation", acted=frozenset({"mode"}))
CONTINUE = FieldPolicy(endpoint="/continue_generation", acted=frozenset(), accepted=frozenset({"torch_empty_cache"}))
DISK = FieldPolicy(endpoint="/update_weights_from_disk", acted=frozenset({"model_path", "weight_version",
                                                                        "abort_all_requests"}),
                   accepted=WEIGHT_ACCEPTED)
TENSOR = FieldPolicy(endpoint="/update_weights_from_tensor",
                     acted=frozenset({"serialized_named_tensors", "weight_version", "abort_all_requests",
                                      "load_format"}), accepted=WEIGHT_ACCEPTED)
INIT_GROUP = FieldPolicy(endpoint="/init_weights_update_group",
                         acted=frozenset({"master_address", "master_port", "rank_offset", "world_size", "group_name",
                                          "backend", "timeout_s", "pp_rank"}))
DISTRIBUTED = FieldPolicy(endpoint="/update_weights_from_distributed",
                          acted=frozenset({"names", "dtypes", "shapes", "weight_version", "abort_all_requests",
                                           "group_name", "load_format"}), accepted=WEIGHT_ACCEPTED)
DESTROY = FieldPolicy(endpoint="/destroy_weights_update_group", acted=frozenset({"group_name"}))
VERSION = FieldPolicy(endpoint="/update_weight_version", acted=frozenset({"new_version", "abort_all_requests"}))
RELEASE = FieldPolicy(endpoint="/release_memory_occupation", acted=frozenset({"tags"}))
RESUME = FieldPolicy(endpoint="/resume_memory_occupation", acted=frozenset({"tags"}))
DEFAULT_GROUP_NAME = "weight_update_group"   # SGLang's default


def _port(value: Any) -> Any:
    """master_port as io_struct types it (int), also given as a decimal string (AReaL sends one)."""
    if isinstance(value, str) and value.strip().isdigit() and len(value.strip()) <= 5:
        return int(value.strip())
    return value


def add_control_routes(app: FastAPI, *, engine: Any, args: ServerArgs, updater: WeightUpdater,
                       blocking: Callable[..., Awaitable[Any]], weight_pool: ThreadPoolExecutor,
                       ignored: IgnoredFields) -> None:
    _add_generation_control(app, engine=engine, args=args, blocking=blocking, ignored=ignored)
    _add_memory_routes(app, engine=engine, blocking=blocking, weight_pool=weight_pool, ignored=ignored)
    _add_weight_routes(app, engine=engine, args=args, updater=updater, blocking=blocking, weight_pool=weight_pool,
                       ignored=ignored)


def _add_generation_control(app: FastAPI, *, engine: Any, args: ServerArgs, blocking: Callable[..., Awaitable[Any]],
                            ignored: IgnoredFields) -> None:
    def is_admin(request: Request) -> bool:
        return not args.admin_api_key or request.state.auth_level == "admin"

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        body = ABORT.screen(await read_json(request, allow_empty=True), ignored)
        abort_all = typed(body, "abort_all", (bool,), False)
        rid = typed(body, "rid", (str,), "")
        if abort_all:
            if not is_admin(request):
                raise ApiError(403 if request.state.auth_level else 401, "abort_all needs the admin API key",
                               type="authentication_error")
            return json_response({"success": True, "num_aborted": await blocking(engine.abort_all)})
        if not rid:  # SGLang: an empty rid aborts nothing
            return json_response({"success": True, "num_aborted": 0})
        found = await blocking(engine.abort, rid)
        return json_response({"success": True, "num_aborted": int(bool(found))})

    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> Response:
        body = PAUSE.screen(await read_json(request, allow_empty=True), ignored)
        mode = body.get("mode") or "abort"
        if mode not in PAUSE_MODES:
            raise ApiError(400, f"mode must be one of {list(PAUSE_MODES)}, got {mode!r}"[:300],
                           param="mode")
        count = await blocking(engine.pause_generation, mode)
        return json_response({"status": "ok", "message": "Generation paused successfully.", "success": True,
                              "mode": mode, "num_requests": count})

    @app.post("/continue_generation")
    async def continue_generation(request: Request) -> Response:
        CONTINUE.screen(await read_json(request, allow_empty=True), ignored)
        was = await blocking(engine.continue_generation)
        return json_response({"status": "ok", "message": "Generation continued successfully.", "success": True,
                              "was_paused": was})

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        if await blocking(engine.flush_cache):
            return json_response({"success": True, "message": "Cache flushed."})
        loads = await blocking(engine.loads)
        running = sum(ld["num_running_reqs"] for ld in loads)
        raise ApiError(400, f"cannot flush the cache while requests are in flight ({running} running, holding "
                            f"KV); retry later")



def _add_memory_routes(app: FastAPI, *, engine: Any, blocking: Callable[..., Awaitable[Any]],
                       weight_pool: ThreadPoolExecutor, ignored: IgnoredFields) -> None:
    """Releasing and resuming the KV pool and the weights' memory (colocated trainers)."""
    async def memory_call(policy: FieldPolicy, fn: Callable[[Any], list[str]], request: Request) -> Response:
        body = policy.screen(await read_json(request, allow_empty=True), ignored)
        try:
            done = await blocking(fn, body.get("tags"), pool=weight_pool)
        except ValueError as exc:
            raise ApiError(400, str(exc), param="tags" if str(exc).startswith("tags") else None) from None
        return json_response({"success": True, "message": f"{policy.endpoint}: {done}",
                              "released": list(engine.released_memory)})

    @app.post("/release_memory_occupation")
    async def release_memory_occupation(request: Request) -> Response:
        return await memory_call(RELEASE, engine.release_memory_occupation, request)

    @app.post("/resume_memory_occupation")
    async def resume_memory_occupation(request: Request) -> Response:
        return await memory_call(RESUME, engine.resume_memory_occupation, request)


def _add_weight_routes(app: FastAPI, *, engine: Any, args: ServerArgs, updater: WeightUpdater,
                       blocking: Callable[..., Awaitable[Any]], weight_pool: ThreadPoolExecutor,
                       ignored: IgnoredFields) -> None:
    async def weights_call(fn: Callable, *a: Any) -> Response:
        if "weights" in engine.released_memory:
            raise WeightUpdateError("the weights are released (/release_memory_occupation): call "
                                    "/resume_memory_occupation with tags [\"weights\"] first")
        return json_response(await blocking(fn, *a, pool=weight_pool))

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> Response:
        body = DISK.screen(await read_json(request), ignored)
        if body.get("load_format") not in (None, "auto", "safetensors"):
            raise WeightUpdateError("load_format must be 'auto' or 'safetensors' (or null)")

        def run() -> dict:
            out = updater.update_from_disk(body.get("model_path"), body.get("weight_version"),
                                           body.get("abort_all_requests", False))
            return {**out, "num_paused_requests": 0}
        return await weights_call(run)

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(request: Request) -> Response:
        return await _from_tensor(request, args=args, updater=updater, ignored=ignored, weights_call=weights_call)

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request) -> Response:
        kw = _group_args(INIT_GROUP.screen(await read_json(request), ignored), args)
        return await weights_call(lambda: updater.init_group(**kw))

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request) -> Response:
        body = DISTRIBUTED.screen(await read_json(request), ignored)
        return await weights_call(updater.update_from_distributed, body.get("names"), body.get("dtypes"),
                                  body.get("shapes"), body.get("weight_version"), body.get("abort_all_requests", False),
                                  body.get("load_format"))

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: Request) -> Response:
        body = DESTROY.screen(await read_json(request, allow_empty=True), ignored)
        return await weights_call(updater.destroy_group, body.get("group_name"))

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request) -> Response:
        body = VERSION.screen(await read_json(request), ignored)
        version, abort = body.get("new_version"), body.get("abort_all_requests", True)
        WeightUpdater.check_common(version, abort)
        if version is None:
            raise WeightUpdateError("new_version must be a string of at most 256 characters")
        await blocking(lambda: engine.set_weight_version(version, abort_all_requests=abort), pool=weight_pool)
        return json_response({"success": True, "message": f"Weight version updated to {version}",
                              "new_version": version})

    @app.api_route("/get_weight_version", methods=["GET", "POST"])
    async def get_weight_version() -> Response:
        return json_response({"weight_version": engine.weight_version})


async def _from_tensor(request: Request, *, args: ServerArgs, updater: WeightUpdater, ignored: IgnoredFields,
                       weights_call: Callable[..., Awaitable[Response]]) -> Response:
    """/update_weights_from_tensor: safetensors bytes (raw body or base64), or SGLang's pickled form."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype != "application/json":
        raw = await request.body()
        query = parse_qs(request.url.query, keep_blank_values=True)
        unknown = sorted(set(query) - {"weight_version", "abort_all_requests"})
        if unknown:
            raise WeightUpdateError(f"unknown query parameter(s) {unknown}"[:300])
        flag = query.get("abort_all_requests", ["false"])[-1].lower()
        if flag not in ("true", "false", "1", "0"):
            raise WeightUpdateError("abort_all_requests must be true or false")
        return await weights_call(updater.update_from_safetensors, raw,
                                  query.get("weight_version", [None])[-1], flag in ("true", "1"))
    body = TENSOR.screen(await read_json(request), ignored)
    version, abort = body.get("weight_version"), body.get("abort_all_requests", False)
    load_format = body.get("load_format")
    raw = _b64_bytes(body.get("serialized_named_tensors"))
    # NOTE: pickle protocol 2+ starts with 0x80; safetensors with its header length (never 0x80 here)
    if load_format == "safetensors" or (load_format is None and raw[:1] != b"\x80"):
        return await weights_call(updater.update_from_safetensors, raw, version, abort)
    if not args.allow_pickled_weight_tensors:
        raise WeightUpdateError(f"serialized_named_tensors (load_format {load_format!r}) is SGLang's pickled "
                                f"form; this server loads it only when started with "
                                f"--allow-pickled-weight-tensors (or send base64 safetensors bytes)"[:400])
    if args.api_key is not None and args.admin_api_key is None:
        raise WeightUpdateError("pickled tensors need --admin-api-key on a server started with --api-key",
                                status=403)
    from rollout.server.pickled_tensors import load_serialized_named_tensors  # noqa: PLC0415

    def run() -> dict:
        try:
            named = load_serialized_named_tensors(raw, load_format)
        except ValueError as exc:
            raise WeightUpdateError(str(exc)) from None
        return updater.update_from_tensors(named, version, abort, source="serialized_named_tensors")
    return await weights_call(run)


def _group_args(body: dict, args: ServerArgs) -> dict:
    """/init_weights_update_group's body as WeightUpdater.init_group's arguments."""
    pp_rank = body.get("pp_rank")
    if pp_rank is not None and (isinstance(pp_rank, bool) or not isinstance(pp_rank, int) or pp_rank < 0):
        raise WeightUpdateError(f"pp_rank must be a non-negative integer, got {pp_rank!r}"[:300])
    kw = {k: body.get(k) for k in ("master_address", "rank_offset", "world_size")}
    kw["master_port"] = _port(body.get("master_port"))
    kw["group_name"] = body.get("group_name") or DEFAULT_GROUP_NAME
    kw["backend"] = body.get("backend") or ("gloo" if args.engine.device == "cpu" else "nccl")
    if "timeout_s" in body:
        kw["timeout_s"] = body["timeout_s"]
    return kw


def _b64_bytes(data: Any) -> bytes:
    """serialized_named_tensors: base64 (or a list with one entry per TP rank; this server is one rank)."""
    import base64
    import binascii

    if isinstance(data, list) and data:
        data = data[0]
    if not isinstance(data, str):
        raise WeightUpdateError("serialized_named_tensors must be a base64 string (or a list of them, one per "
                                "TP rank)")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise WeightUpdateError("serialized_named_tensors is not valid base64") from None
    if not raw:
        raise WeightUpdateError("serialized_named_tensors is empty")
    return raw
