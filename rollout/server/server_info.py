"""ServerInfo: the `/model_info` and `/server_info` answers in SGLang's shape (its ServerArgs names and
get_model_info fields), with this server's own fields added (routed-expert shape, DP loads).
add_info_routes serves them (and /v1/loads); add_debug_routes serves /debug/integrity."""
from __future__ import annotations

import json
import os
import time
from typing import Any, Awaitable, Callable

from fastapi import FastAPI
from starlette.responses import Response

from rollout.models.registry import read_config, resolve_dtype
from rollout.server.args import ServerArgs
from rollout.server.http_io import json_response

VERSION = "0.1.0"


def _model_type(model_path: str) -> str:
    try:
        with open(os.path.join(model_path, "config.json")) as f:
            return str(json.load(f).get("model_type", ""))
    except (OSError, ValueError):
        return ""


class ServerInfo:
    def __init__(self, engine: Any, args: ServerArgs):
        self.engine = engine
        self.args = args
        self.model_type = _model_type(engine.config.model_path)
        self.started = int(time.time())

    def model_info(self) -> dict[str, Any]:
        engine, info = self.engine, self.engine.info
        return {
            # SGLang's get_model_info
            "model_path": engine.config.model_path, "tokenizer_path": engine.config.resolved_tokenizer_path,
            "is_generation": True, "preferred_sampling_params": None, "weight_version": engine.weight_version,
            "has_image_understanding": False, "has_audio_understanding": False, "model_type": self.model_type,
            "architectures": [info.architecture],
            # the routed-expert shape a trainer decodes with (ours)
            "architecture": info.architecture, "num_hidden_layers": info.num_hidden_layers,
            "num_experts": info.num_experts, "num_experts_per_tok": info.top_k,
            "moe_layer_ids": list(info.moe_layer_ids), "vocab_size": info.vocab_size,
            "context_length": engine.context_length, "max_total_num_tokens": engine.kv_capacity,
            "served_model_name": self.args.model_name, "routed_experts_formats": ["int32", "compact"],
            "enable_return_routed_experts": engine.config.enable_return_routed_experts}

    def sglang_args(self) -> dict[str, Any]:
        """This server's settings under SGLang's ServerArgs names (tp = pp = 1)."""
        a, e = self.args, self.args.engine
        return {
            "model_path": e.model_path, "tokenizer_path": e.tokenizer_path or e.model_path,
            "served_model_name": a.model_name, "host": a.host, "port": a.port, "dtype": e.dtype, "device": e.device,
            "tp_size": 1, "pp_size": 1, "dp_size": e.dp_size, "ep_size": e.dp_size,
            "enable_dp_attention": e.dp_size > 1, "nnodes": e.nnodes, "node_rank": e.node_rank,
            "dist_init_addr": e.dist_init_addr, "dist_timeout": e.dist_timeout,
            # NOTE: SGLang's default; slime's external-engine start-up requires it equal to its
            # --offload-rollout (false unless given). /release_memory_occupation works either way.
            "enable_memory_saver": False,
            "enable_return_routed_experts": e.enable_return_routed_experts,
            "context_length": self.engine.context_length, "max_running_requests": e.max_running_requests,
            "max_total_tokens": self.engine.kv_capacity, "chunked_prefill_size": e.chunked_prefill_size or -1,
            "disable_radix_cache": not e.enable_prefix_caching, "stream_interval": e.stream_interval,
            "incremental_streaming_output": a.incremental_streaming_output, "stream_output":
                a.incremental_streaming_output, "random_seed": e.seed, "weight_version": self.engine.weight_version,
            "skip_tokenizer_init": False, "log_level": a.log_level, "api_key": "<set>" if a.api_key else None,
            "admin_api_key": "<set>" if a.admin_api_key else None, "attention_backend": "torch_native",
            "cuda_graph_bs": list(e.decode_graph_batch_sizes), "disable_cuda_graph": not e.decode_graph_batch_sizes,
            "cuda_graph_max_bs": max(e.decode_graph_batch_sizes, default=None),
            "disable_cuda_graph_padding": e.disable_cuda_graph_padding,
        }

    def ready_line(self, url: str, stats: dict) -> str:
        """The one line a server logs when it is ready (stats: Rollout.stats())."""
        engine, cfg = self.engine, self.engine.config
        dtype = str(resolve_dtype(cfg.dtype, read_config(cfg.model_path)[0])).removeprefix("torch.")
        per_rank = " per rank" if cfg.dp_size > 1 else ""
        rows = (stats.get("dp_ranks") or [stats])[0].get("capture_buffer_rows", 0)
        capture = f"routed-expert capture {rows} rows{per_rank}" if rows else "routed-expert capture off"
        return (f"ready: model {cfg.model_path} ({engine.info.architecture}, {dtype}), KV cache "
                f"{engine.kv_capacity} tokens{per_rank}, context {engine.context_length}, {capture}, "
                f"dp {cfg.dp_size}{f' over {cfg.nnodes} nodes' if cfg.nnodes > 1 else ''}, serving {url}")

    def server_info(self, stats: dict, loads: list[dict]) -> dict[str, Any]:
        internal = [{**stats, "dp_rank": ld["dp_rank"], "load": ld,
                     "memory_usage": {"kv_cache_tokens": ld["max_total_num_tokens"]}} for ld in loads]
        return {**self.args.redacted(), **self.sglang_args(), "version": VERSION,
                "paused": self.engine.paused_mode, "model_info": self.model_info(),
                "max_total_num_tokens": self.engine.kv_capacity, "max_req_input_len": self.engine.context_length - 1,
                "internal_states": internal, "started": self.started}


def add_info_routes(app: FastAPI, *, engine: Any, args: ServerArgs, blocking: Callable[..., Awaitable[Any]]) -> None:
    """/model_info, /server_info (and their SGLang /get_* names) and /v1/loads."""
    server_info = ServerInfo(engine, args)

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


def add_debug_routes(app: FastAPI, *, engine: Any, blocking: Callable[..., Awaitable[Any]]) -> None:
    """/debug/integrity (--enable-debug-endpoints): the scheduler's KV bookkeeping checked on every rank."""
    @app.get("/debug/integrity")
    async def debug_integrity() -> Response:
        await blocking(engine.check_integrity)
        stats = await blocking(engine.stats)
        loads = await blocking(engine.loads)
        return json_response({"ok": True, "kv_used": stats["kv_used"], "kv_total": stats["kv_total"],
                              "cached_tokens": sum(ld["num_cached_tokens"] for ld in loads),
                              "running": stats["running"],
                              "waiting": stats["waiting"], "paused": engine.paused_mode})
