"""What a router and a trainer read from a worker besides /server_info and /model_info, in SGLang's
shapes: `GET /get_load` (sglang-router polls it for its load-aware policies) and
`/get_weights_by_name` (trainers check that a weight sync arrived)."""
from __future__ import annotations

import time
from typing import Any, Awaitable, Callable

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response

from rollout.server.http_io import ApiError, FieldPolicy, IgnoredFields, json_response, read_json

WEIGHTS_BY_NAME = FieldPolicy(endpoint="/get_weights_by_name", acted=frozenset({"name", "truncate_size"}))
DEFAULT_TRUNCATE_SIZE = 100   # SGLang's GetWeightsByNameReqInput default
MAX_TRUNCATE_SIZE = 1 << 20


def sglang_loads(loads: list[dict]) -> list[dict]:
    """Our per-rank load rows in SGLang's /get_load shape (one object per DP rank)."""
    now = time.time()
    return [{"dp_rank": ld["dp_rank"], "num_reqs": ld["num_running_reqs"] + ld["num_waiting_reqs"],
             "num_waiting_reqs": ld["num_waiting_reqs"], "num_tokens": ld["num_used_tokens"],
             "num_pending_tokens": ld.get("num_waiting_tokens", 0), "ts_tic": now} for ld in loads]


def add_worker_state_routes(app: FastAPI, *, engine: Any, blocking: Callable[..., Awaitable[Any]],
                            ignored: IgnoredFields) -> None:
    @app.get("/get_load")
    async def get_load() -> Response:
        return json_response(sglang_loads(await blocking(engine.loads)))

    # NOTE: SGLang serves it as GET with a JSON body (requests.get(url, json=...)); POST works too
    @app.api_route("/get_weights_by_name", methods=["GET", "POST"])
    async def get_weights_by_name(request: Request) -> Response:
        body = WEIGHTS_BY_NAME.screen(await read_json(request), ignored)
        name, size = body.get("name"), body.get("truncate_size", DEFAULT_TRUNCATE_SIZE)
        if not isinstance(name, str) or not name:
            raise ApiError(400, f"name must be a non-empty parameter name string, got {name!r}"[:300], param="name")
        if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= MAX_TRUNCATE_SIZE:
            raise ApiError(400, f"truncate_size must be an integer in [1, {MAX_TRUNCATE_SIZE}], got {size!r}"[:300],
                           param="truncate_size")
        if "weights" in engine.released_memory:
            raise ApiError(400, "the weights are released (/release_memory_occupation): resume them first")
        values = await blocking(engine.read_weight, name, size)
        if values is None:
            raise ApiError(400, f"name {name[:200]!r} is not a weight of this model (use the checkpoint's "
                                f"names, e.g. 'lm_head.weight')", param="name")
        return json_response(values)
