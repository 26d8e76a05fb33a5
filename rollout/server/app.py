"""rollout-serve: SGLang-compatible HTTP server over the Rollout engine (FastAPI + uvicorn).

The engine runs in a process of its own (one per DP rank) behind Rollout; handlers submit requests
and receive their chunks and outputs through thread-safe callbacks into the event loop, so
concurrent requests batch together. Blocking engine calls (pause, flush, stats, weight swaps) run
on worker threads. If the engine dies, every waiter gets a 503, /health fails, and the server
exits non-zero (its supervisor restarts it).

Errors: every rejected request gets a 4xx with {"error": {"message", "type", "param", "code"}}
(weight endpoints answer SGLang's {"success": false, "message"}); 503 only when the engine died.

This module builds the app and runs uvicorn; the routes live with their area: generate_routes.py,
openai_routes.py, control_routes.py, health.py, server_info.py and metrics.py; guard.py (API keys,
body size) and error_handlers.py wrap them all. When the app starts it logs one line (model, dtype,
KV, capture, dp, URL); batch_log.py logs the busy server's batch lines.
"""
from __future__ import annotations

import asyncio
import gc
import inspect
import logging
import os
import signal
import socket
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI

from rollout.cpu_affinity import keep_off
from rollout.frontend.api import Rollout
from rollout.server.args import ServerArgs
from rollout.server.batch_log import BatchLog
from rollout.server.control_routes import add_control_routes
from rollout.server.engine_collector import EngineCollector
from rollout.server.error_handlers import add_error_handlers
from rollout.server.generate_routes import add_generate_routes
from rollout.server.graceful_server import GracefulServer, ShutdownState
from rollout.server.guard import Guard, timed_protocol
from rollout.server.health import add_health_routes
from rollout.server.http_io import IgnoredFields
from rollout.server.metrics import Metrics, add_metrics_route
from rollout.server.openai_routes import add_openai_routes
from rollout.server.openai_serving import OpenAIServing
from rollout.server.request_models import install_openapi
from rollout.server.server_info import VERSION, ServerInfo, add_debug_routes, add_info_routes
from rollout.server.startup_error import StartupError
from rollout.server.weight_session import WeightSession, add_weight_session_routes
from rollout.server.weight_updater import WeightUpdater
from rollout.server.worker_state_routes import add_worker_state_routes

logger = logging.getLogger("rollout.server")
# NOTE: FastAPI >= 0.160 wraps every request in OpenTelemetry checks (an os.environ lookup and a
# provider check per request: ~8% of the server's CPU on a GRPO batch); /metrics is ours
_NO_TELEMETRY = ({"telemetry": {"tracing": False, "metrics": False, "logs": False, "operation_spans": False}}
                 if "telemetry" in inspect.signature(FastAPI).parameters else {})
ENGINE_DEAD_EXIT_DELAY_S = 1.0


# ---- the app ---------------------------------------------------------------------------------------
def _started_pool(workers: int, prefix: str) -> ThreadPoolExecutor:
    """A thread pool whose threads all run already. NOTE: a pool starts a thread on first use and
    waits for the OS to run it: on the event loop's time when the loop submits (170 ms measured on
    a loaded host)."""
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=prefix)
    barrier = threading.Barrier(workers)
    for future in [pool.submit(barrier.wait, 60) for _ in range(workers)]:
        future.result()
    return pool


def create_app(engine: Rollout, server_args: ServerArgs, *, url: str = "") -> FastAPI:
    """The FastAPI app serving `engine`; the caller owns (and shuts down) the engine. url: where it
    serves (for the line logged when it is ready)."""
    args = server_args
    control_pool = _started_pool(8, "rollout-control")
    weight_pool = _started_pool(4, "rollout-weights")
    offloop_pool = _started_pool(4, "rollout-offloop")   # asyncio.to_thread's (parsing, tokenizing)
    ignored = IgnoredFields()
    metrics = Metrics(set(), ignored, model_name=args.model_name)
    batch_log = BatchLog(engine, decode_log_interval=args.decode_log_interval)
    metrics.registry.register(EngineCollector(engine, metrics.labels, ignored, batch_log))
    engine.add_finish_listener(metrics.finished)
    updater = WeightUpdater(engine, args.weight_dirs, on_update=metrics.weight_update)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loop = asyncio.get_running_loop()
        loop.set_default_executor(offloop_pool)
        stats = await loop.run_in_executor(control_pool, engine.stats)
        logger.info("%s", ServerInfo(engine, args).ready_line(url, stats))
        await loop.run_in_executor(control_pool, batch_log.start)
        yield
        await loop.run_in_executor(None, batch_log.stop)
        for pool in (control_pool, weight_pool, offloop_pool):
            pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="rollout-serve", version=VERSION, docs_url="/docs", redoc_url=None,
                  openapi_url="/openapi.json", lifespan=lifespan, **_NO_TELEMETRY)
    app.state.engine = engine
    app.state.updater = updater
    app.state.shutdown = shutdown = ShutdownState()

    async def blocking(fn: Callable, *a: Any, pool: ThreadPoolExecutor = control_pool) -> Any:
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *a)

    add_error_handlers(app, args)
    # NOTE: the routes are added in this order, which is also their order in /openapi.json
    add_generate_routes(app, engine=engine, args=args, metrics=metrics, ignored=ignored, blocking=blocking,
                        shutdown=shutdown)
    add_openai_routes(app, OpenAIServing(engine, args.model_name, metrics,
                                         incremental_streaming=args.incremental_streaming_output, shutdown=shutdown,
                                         routing_default=args.default_return_routed_experts))
    add_control_routes(app, engine=engine, args=args, updater=updater, blocking=blocking, weight_pool=weight_pool,
                       ignored=ignored)
    add_weight_session_routes(app, WeightSession(), ignored)
    add_worker_state_routes(app, engine=engine, blocking=blocking, ignored=ignored)
    add_health_routes(app, engine)
    add_info_routes(app, engine=engine, args=args, blocking=blocking)
    add_metrics_route(app, metrics=metrics, blocking=blocking)
    if args.enable_debug_endpoints:
        add_debug_routes(app, engine=engine, blocking=blocking)
    install_openapi(app, VERSION)
    metrics.known_paths = {r.path for r in app.routes if hasattr(r, "path")}
    app.add_middleware(Guard, args=args, metrics=metrics)
    return app


# ---- entry point -----------------------------------------------------------------------------------
def serve(args: ServerArgs, sock: socket.socket) -> None:
    """Loads the engine and serves on `sock` (bound by rollout/server/startup.py) until a signal or the
    engine's death; a failure to start is a StartupError (one line)."""
    import uvicorn

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        logger.warning("listening on %s without --api-key: anyone who can reach it may generate", args.host)
    if args.allow_pickled_weight_tensors:
        from rollout.server.pickled_tensors import adopt_authkey  # noqa: PLC0415

        adopt_authkey(os.environ)
    # NOTE: a SIGTERM while the model loads unwinds the load (engine processes stopped, files removed)
    signal.signal(signal.SIGTERM, lambda sig, frame: sys.exit(0))
    try:
        engine = Rollout(config=args.engine)
    except (ValueError, OSError, RuntimeError) as exc:
        sock.close()
        raise StartupError.of(exc) from exc
    died: list[str] = []
    server = None
    try:
        host, port = sock.getsockname()[:2]
        url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        app = create_app(engine, args, url=url)
        print(f"rollout-serve listening on {url}", flush=True)
        config = uvicorn.Config(app, log_level=args.log_level, timeout_keep_alive=args.timeout_keep_alive,
                                http=timed_protocol(args.timeout_read, args.connection_cap), access_log=args.log_level == "debug")
        server = GracefulServer(config, engine=engine, drain_s=args.shutdown_drain_s, state=app.state.shutdown)

        def on_engine_dead(reason: str) -> None:
            died.append(reason)
            logger.error("the engine died (%s); exiting so that a supervisor restarts the server", reason)
            # NOTE: a moment for the 503s of the requests in flight to be written
            threading.Timer(ENGINE_DEAD_EXIT_DELAY_S, lambda: setattr(server, "should_exit", True)).start()

        engine.add_dead_listener(on_engine_dead)
        # NOTE: with --cpu-affinity the front end (HTTP, JSON, detokenization) runs on the CPUs the
        # engines were not given, so that it does not preempt their threads
        rest = keep_off(args.engine.cpu_affinity)
        if rest:
            logger.info("front end on CPU(s) %s, engines on %s", rest, list(args.engine.cpu_affinity))
        # NOTE: the objects built so far (torch, transformers, FastAPI, the tokenizer) live as long as
        # the server; frozen, the collector no longer walks them: each full collection while serving
        # took ~190 ms of the event loop's time (2 in 3 GRPO batches), ~20 ms frozen. vLLM freezes
        # its server's startup heap the same way (freeze_gc_heap, vllm/utils/gc_utils.py).
        gc.collect()
        gc.freeze()
        server.run(sockets=[sock])
    finally:
        sock.close()
        engine.shutdown()
    if died:
        sys.exit(1)
    if server.signal is not None:
        sys.exit(server.exit_code)
