"""rollout-serve: SGLang-compatible HTTP server over the Rollout engine (FastAPI + uvicorn).

The engine runs in a process of its own (one per DP rank) behind Rollout; handlers submit requests
and receive their chunks and outputs through thread-safe callbacks into the event loop, so
concurrent requests batch together. Blocking engine calls (pause, flush, stats, weight swaps) run
on worker threads. If the engine dies, every waiter gets a 503, /health fails, and the server
exits non-zero (its supervisor restarts it).

Errors: every rejected request gets a 4xx with {"error": {"message", "type", "param", "code"}}
(weight endpoints answer SGLang's {"success": false, "message"}); 503 only when the engine died.
"""
from __future__ import annotations

import asyncio
import hmac
import inspect
import json
import logging
import socket
import sys
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable, Optional, Sequence

from fastapi import FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import Response

from rollout.frontend.api import EngineDeadError, Rollout
from rollout.frontend.engine_client import RidInFlightError
from rollout.server.control_routes import add_control_routes
from rollout.server.generate_request import ERROR_PARAMS, GenerateCall, as_response
from rollout.server.generate_stream import GenerateStream
from rollout.server.health import GenerateHealth
from rollout.server.ignored_fields import IgnoredFields
from rollout.server.engine_stream import ClientGone, EngineStream
from rollout.server.openai_serving import OpenAIServing
from rollout.server.responses import ApiError, SSEResponse, error_body, json_response, param_of
from rollout.output import RolloutOutput
from rollout.server.args import ServerArgs
from rollout.server.request_models import install_openapi
from rollout.server.server_info import VERSION, ServerInfo
from rollout.server.unicode_check import body_may_hold_surrogates, invalid_unicode_field
from rollout.server.weight_updater import WeightUpdateError, WeightUpdater

logger = logging.getLogger("rollout.server")
# NOTE: FastAPI >= 0.160 wraps every request in OpenTelemetry checks (an os.environ lookup and a
# provider check per request: ~8% of the server's CPU on a GRPO batch); /metrics is ours
_NO_TELEMETRY = ({"telemetry": {"tracing": False, "metrics": False, "logs": False, "operation_spans": False}}
                 if "telemetry" in inspect.signature(FastAPI).parameters else {})
VERSION = "0.1.0"
ENGINE_DEAD_EXIT_DELAY_S = 1.0
RID_IN_FLIGHT = "rid_in_flight_error"   # the error type clients retry on (the rid's earlier try is not done)
WEIGHT_PATHS = frozenset({"/update_weights_from_disk", "/update_weights_from_tensor", "/init_weights_update_group",
                          "/update_weights_from_distributed", "/destroy_weights_update_group",
                          "/update_weight_version"})
ADMIN_PATHS = WEIGHT_PATHS | {"/pause_generation", "/continue_generation", "/flush_cache", "/debug/integrity",
                              "/release_memory_occupation", "/resume_memory_occupation"}
PUBLIC_PATHS = frozenset({"/health"})


class BodyTooLarge(Exception):
    pass


# ---- metrics ---------------------------------------------------------------------------------------
class Metrics:
    """Server-side counters; engine gauges are read at scrape time."""

    def __init__(self, known_paths: set[str], ignored: IgnoredFields):
        self._lock = threading.Lock()
        self.known_paths = known_paths
        self.ignored = ignored
        self.http: Counter = Counter()
        self.finish: Counter = Counter()
        self.routing: Counter = Counter()
        self.routing_msgs: Counter = Counter()
        self.output_tokens = 0

    def request(self, path: str, status: int) -> None:
        with self._lock:
            self.http[(path if path in self.known_paths else "other", status)] += 1

    def routing_bytes(self, fmt: str, n: int) -> None:
        with self._lock:
            self.routing[fmt] += n
            self.routing_msgs[fmt] += 1

    def finished(self, outs: Sequence[RolloutOutput]) -> None:
        with self._lock:
            for out in outs:
                self.finish[out.finish_reason] += 1
                self.output_tokens += out.completion_tokens

    def render(self, stats: dict, loads: list[dict], engine: Rollout) -> str:
        lines: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
            lines.append(f"# HELP rollout_{name} {help_}")
            lines.append(f"# TYPE rollout_{name} {kind}")
            for labels, value in samples:
                lines.append(f"rollout_{name}{labels} {value}")

        with self._lock:
            http = sorted(self.http.items())
            finish = sorted(self.finish.items())
            routing = sorted(self.routing.items())
            msgs = sorted(self.routing_msgs.items())
        metric("http_requests_total", "counter", "HTTP requests by path and status",
               [(f'{{path="{p}",status="{s}"}}', v) for (p, s), v in http])
        metric("requests_finished_total", "counter", "generation requests finished, by finish reason",
               [(f'{{reason="{r}"}}', v) for r, v in finish])
        metric("engine_requests_finished_total", "counter", "requests finished in the engine (all APIs)",
               [("", stats["finished_requests"])])
        metric("engine_requests_aborted_total", "counter", "requests aborted in the engine",
               [("", stats["aborted_requests"])])
        metric("engine_nonfinite_logits_aborts_total", "counter",
               "requests aborted because their next token had no finite distribution (NaN/inf logits)",
               [("", stats.get("nonfinite_logits_aborts", 0))])
        metric("prompt_tokens_total", "counter", "prompt tokens received", [("", stats["prompt_tokens"])])
        metric("generation_tokens_total", "counter", "tokens generated", [("", stats["generated_tokens"])])
        metric("forwards_total", "counter", "model forwards by kind",
               [('{kind="prefill"}', stats["num_prefill_forwards"]), ('{kind="decode"}', stats["num_decode_forwards"])])
        metric("retractions_total", "counter", "requests retracted (preempted)", [("", stats["num_retractions"])])
        metric("weight_updates_total", "counter", "successful weight updates", [("", stats.get("weight_updates", 0))])
        for key, name, help_ in (("num_running_reqs", "num_running_reqs", "requests holding KV"),
                                 ("num_waiting_reqs", "num_queue_reqs", "requests waiting in the queue"),
                                 ("num_used_tokens", "kv_used_tokens", "KV slots in use (requests + prefix cache)"),
                                 ("num_cached_tokens", "kv_cached_tokens", "KV slots held by the prefix cache"),
                                 ("max_total_num_tokens", "kv_total_tokens", "KV slots in the pool"),
                                 ("token_usage", "kv_usage", "fraction of KV slots in use")):
            metric(name, "gauge", help_, [(f'{{dp_rank="{ld["dp_rank"]}"}}', ld[key]) for ld in loads])
        metric("paused", "gauge", "1 while generation is paused", [("", int(engine.paused_mode is not None))])
        metric("routed_experts_bytes_total", "counter", "routed-expert bytes sent (base64), by wire format",
               [(f'{{format="{f}"}}', v) for f, v in routing])
        metric("routed_experts_messages_total", "counter", "responses/chunks carrying routed experts, by format",
               [(f'{{format="{f}"}}', v) for f, v in msgs])
        metric("ignored_fields_total", "counter", "unknown request fields accepted and ignored, by endpoint and name",
               [(f'{{endpoint="{e}",field="{n}"}}', v) for e, n, v in self.ignored.samples()])
        if stats.get("capture_buffer_bytes"):   # (summed over DP ranks)
            metric("capture_host_store_bytes", "gauge", "routed-expert host store size",
                   [("", stats["capture_store_bytes"])])
            metric("capture_device_buffer_bytes", "gauge", "routed-expert device buffer size",
                   [("", stats["capture_buffer_bytes"])])
        return "\n".join(lines) + "\n"


# ---- auth and body size (pure ASGI: works for streaming responses too) ------------------------------
class Guard:
    def __init__(self, app: Any, args: ServerArgs, metrics: Metrics):
        self.app = app
        self.api_key = args.api_key.encode() if args.api_key else None
        self.admin_key = args.admin_api_key.encode() if args.admin_api_key else None
        self.max_bytes = args.max_request_bytes
        self.metrics = metrics

    @staticmethod
    async def _reply(send: Callable, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
        await send({"type": "http.response.body", "body": data})

    def _level(self, headers: dict) -> Optional[str]:
        auth = headers.get(b"authorization", b"")
        if not auth.lower().startswith(b"bearer "):
            return None
        token = auth[7:].strip()
        if self.admin_key is not None and hmac.compare_digest(token, self.admin_key):
            return "admin"
        if self.api_key is not None and hmac.compare_digest(token, self.api_key):
            return "user"
        return None

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        status_box = [0]

        async def send_tracked(message: dict) -> None:
            if message["type"] == "http.response.start":
                status_box[0] = message["status"]
            await send(message)

        try:
            await self._handle(scope, receive, send_tracked, path)
        finally:
            self.metrics.request(path, status_box[0])

    async def _handle(self, scope: dict, receive: Callable, send: Callable, path: str) -> None:
        headers = dict(scope.get("headers") or [])
        level = self._level(headers)
        scope.setdefault("state", {})["auth_level"] = level
        if path not in PUBLIC_PATHS:
            if path in ADMIN_PATHS and self.admin_key is not None:
                if level != "admin":
                    status = 403 if level == "user" else 401
                    msg = "this endpoint needs the admin API key" if status == 403 else "missing or wrong API key"
                    return await self._reply(send, status, error_body(msg, "authentication_error", code=status))
            elif self.api_key is not None and level is None:
                return await self._reply(send, 401, error_body("missing or wrong API key (Authorization: Bearer ...)",
                                                               "authentication_error", code=401))
        length = headers.get(b"content-length")
        if length is not None:
            if not length.isdigit():
                return await self._reply(send, 400, error_body("invalid Content-Length", code=400))
            if int(length) > self.max_bytes:
                return await self._reply(send, 413, error_body(
                    f"request body of {int(length)} bytes exceeds --max-request-bytes={self.max_bytes}", code=413))
        seen = [0]

        async def limited_receive() -> dict:
            message = await receive()
            if message["type"] == "http.request":
                seen[0] += len(message.get("body", b""))
                if seen[0] > self.max_bytes:
                    raise BodyTooLarge()
            return message

        await self.app(scope, limited_receive, send)


# ---- request helpers -------------------------------------------------------------------------------
async def read_json(request: Request, *, allow_empty: bool = False) -> dict:
    raw = await request.body()
    if not raw.strip():
        if allow_empty:
            return {}
        raise ApiError(400, "the request body must be a JSON object")
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise ApiError(400, f"malformed JSON body: {exc}"[:300]) from None
    if not isinstance(obj, dict):
        raise ApiError(400, "the request body must be a JSON object")
    if body_may_hold_surrogates(raw):
        bad = invalid_unicode_field(obj)
        if bad is not None:
            raise ApiError(400, f"{bad[1]}; every string must be valid Unicode", param=bad[0])
    return obj


def _engine_error(exc: ValueError, known: set[str]) -> ApiError:
    msg = str(exc)
    if isinstance(exc, RidInFlightError):
        return ApiError(400, msg, type=RID_IN_FLIGHT, param="rid")
    return ApiError(400, msg, param=param_of(msg, known))


# ---- the app ---------------------------------------------------------------------------------------
def create_app(engine: Rollout, server_args: ServerArgs) -> FastAPI:
    """The FastAPI app serving `engine`; the caller owns (and shuts down) the engine."""
    args = server_args
    control_pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="rollout-control")
    weight_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="rollout-weights")
    updater = WeightUpdater(engine, args.weight_dirs)
    generate_health = GenerateHealth(engine)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        updater.shutdown()
        control_pool.shutdown(wait=False, cancel_futures=True)
        weight_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="rollout-serve", version=VERSION, docs_url="/docs", redoc_url=None,
                  openapi_url="/openapi.json", lifespan=lifespan, **_NO_TELEMETRY)
    ignored = IgnoredFields()
    metrics = Metrics(set(), ignored)
    openai = OpenAIServing(engine, args.model_name, metrics, incremental_streaming=args.incremental_streaming_output)
    app.state.engine = engine
    server_info = ServerInfo(engine, args)
    app.state.updater = updater
    info = engine.info

    async def blocking(fn: Callable, *a: Any, pool: ThreadPoolExecutor = control_pool) -> Any:
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *a)

    # ---- error mapping ----
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> Response:
        body = error_body(exc.message, exc.type, exc.param, exc.status)
        if request.url.path in WEIGHT_PATHS:  # SGLang's shape too, so weight clients can read `success`
            body.update(success=False, message=exc.message)
        return json_response(body, exc.status)

    @app.exception_handler(WeightUpdateError)
    async def _weight_error(request: Request, exc: WeightUpdateError) -> Response:
        return json_response({"success": False, "message": str(exc),
                              **error_body(str(exc), code=exc.status)}, exc.status)

    @app.exception_handler(BodyTooLarge)
    async def _too_large(request: Request, exc: BodyTooLarge) -> Response:
        return json_response(error_body(f"request body exceeds --max-request-bytes={args.max_request_bytes}",
                                        code=413), 413)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return json_response(error_body(f"{exc.detail}: {request.method} {request.url.path}"[:300],
                                        "not_found_error" if exc.status_code == 404 else "invalid_request_error",
                                        code=exc.status_code), exc.status_code)

    @app.exception_handler(EngineDeadError)
    async def _dead(request: Request, exc: EngineDeadError) -> Response:
        return json_response(error_body(str(exc), "server_error", code=503), 503)

    @app.exception_handler(ClientGone)
    async def _gone(request: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> Response:
        logger.exception("internal error on %s", request.url.path)
        return json_response(error_body(f"internal error: {type(exc).__name__}", "server_error", code=500), 500)

    # ---- /generate ----
    def tokenize(texts: list[str]) -> list[list[int]]:
        return [engine.tokenizer.encode(t) for t in texts]

    def _texts(text: Any) -> list[str]:
        if isinstance(text, str):
            return [text]
        return [t for t in text if isinstance(t, str)] if isinstance(text, list) else []

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        body = await read_json(request)
        if sum(len(t) for t in _texts(body.get("text"))) > 20000:
            call = await blocking(parse_generate, body)
        else:
            call = parse_generate(body)
        try:
            es = EngineStream(engine, **call.kwargs)
        except ValueError as exc:
            err = _engine_error(exc, ERROR_PARAMS)
            if body.get("text") is not None and err.param == "input_ids":
                err.param = "text"
            raise err from None
        decode = lambda t: engine.tokenizer.decode([t], skip_special_tokens=False)  # noqa: E731
        if not call.stream:
            outs = await es.outputs(request)
            metrics.finished(outs)
            answer = as_response(call, outs, es.rids, decode)
            for item in answer if isinstance(answer, list) else [answer]:
                if "routed_experts" in item["meta_info"]:
                    metrics.routing_bytes(call.fmt, len(item["meta_info"]["routed_experts"]))
            return json_response(answer)
        stream = GenerateStream(call, es, engine=engine, metrics=metrics, decode=decode)
        return SSEResponse(stream.events(), es.close)

    def parse_generate(body: dict) -> GenerateCall:
        return GenerateCall.parse(body, ignored, tokenize=tokenize,
                                  incremental_default=args.incremental_streaming_output, num_experts=info.num_experts)

    # ---- OpenAI ----
    @app.post("/v1/completions")
    async def v1_completions(request: Request) -> Response:
        return await openai.completions(await read_json(request), request)

    @app.post("/v1/chat/completions")
    async def v1_chat(request: Request) -> Response:
        return await openai.chat(await read_json(request), request)

    @app.get("/v1/models")
    async def v1_models() -> Response:
        return json_response(openai.models())

    add_control_routes(app, engine=engine, args=args, updater=updater, read_json=read_json, blocking=blocking,
                       weight_pool=weight_pool, ignored=ignored)

    # ---- state ----
    @app.get("/health")
    async def health() -> Response:
        if not engine.is_alive:
            return json_response(error_body("the engine stopped", "server_error", code=503), 503)
        return json_response({"status": "ok"})

    @app.get("/health_generate")
    async def health_generate(request: Request) -> Response:
        def probe() -> EngineStream:
            return EngineStream(engine, input_ids=[[min(3, info.vocab_size - 1)]],
                                sampling_params={"max_new_tokens": 1, "temperature": 0.0})

        status, body = await generate_health.check(probe, request)
        if status != 200:
            return json_response(error_body(body["message"], "server_error", code=status), status)
        return json_response(body)

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def get_model_info() -> Response:
        return json_response(server_info.model_info())

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def get_server_info() -> Response:
        return json_response(server_info.server_info(await blocking(engine.stats), await blocking(engine.loads)))

    @app.get("/v1/loads")
    async def v1_loads() -> Response:
        loads = await blocking(engine.loads)
        return json_response({"dp_size": engine.config.dp_size, "paused": engine.paused_mode, "loads": loads})

    @app.get("/metrics")
    async def prometheus() -> Response:
        stats = await blocking(engine.stats)
        loads = await blocking(engine.loads)
        return Response(metrics.render(stats, loads, engine), media_type="text/plain; version=0.0.4")

    if args.enable_debug_endpoints:
        @app.get("/debug/integrity")
        async def debug_integrity() -> Response:
            await blocking(engine.check_integrity)
            stats = await blocking(engine.stats)
            loads = await blocking(engine.loads)
            return json_response({"ok": True, "kv_used": stats["kv_used"], "kv_total": stats["kv_total"],
                                  "cached_tokens": sum(ld["num_cached_tokens"] for ld in loads),
                                  "running": stats["running"],
                                  "waiting": stats["waiting"], "paused": engine.paused_mode})

    install_openapi(app, VERSION)
    metrics.known_paths = {r.path for r in app.routes if hasattr(r, "path")}
    app.add_middleware(Guard, args=args, metrics=metrics)
    return app


# ---- entry point -----------------------------------------------------------------------------------
def _bind(host: str, port: int) -> socket.socket:
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                      flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(addr)
    sock.listen(2048)
    return sock


def main(argv: Optional[Sequence[str]] = None) -> None:
    import uvicorn

    args = ServerArgs.from_cli(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        logger.warning("listening on %s without --api-key: anyone who can reach it may generate", args.host)
    engine = Rollout(config=args.engine_config())
    died: list[str] = []
    try:
        app = create_app(engine, args)
        sock = _bind(args.host, args.port)
        host, port = sock.getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        print(f"rollout-serve listening on http://{shown}:{port}", flush=True)
        config = uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=5,
                                timeout_keep_alive=args.timeout_keep_alive, access_log=args.log_level == "debug")
        server = uvicorn.Server(config)

        def on_engine_dead(reason: str) -> None:
            died.append(reason)
            logger.error("the engine died (%s); exiting so that a supervisor restarts the server", reason)
            # NOTE: a moment for the 503s of the requests in flight to be written
            threading.Timer(ENGINE_DEAD_EXIT_DELAY_S, lambda: setattr(server, "should_exit", True)).start()

        engine.add_dead_listener(on_engine_dead)
        server.run(sockets=[sock])
    finally:
        engine.shutdown()
    if died:
        sys.exit(1)


if __name__ == "__main__":
    main()
