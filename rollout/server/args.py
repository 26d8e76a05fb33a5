"""ServerArgs: the frozen settings of `rollout-serve` (engine flags + HTTP/security flags) and its CLI."""
from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from rollout.config import ATTENTION_BACKENDS, DEFAULT_MODEL_PATH, DTYPES, MOE_BACKENDS, EngineConfig

DEFAULT_MAX_REQUEST_BYTES = 64 * 2**20
DEFAULT_TIMEOUT_KEEP_ALIVE = 75
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


@dataclass(frozen=True, kw_only=True)
class ServerArgs:
    # ---- engine (mirrors EngineConfig) ----
    model_path: str = DEFAULT_MODEL_PATH
    tokenizer_path: Optional[str] = None
    dtype: str = "auto"
    device: str = "cpu"
    dp_size: int = 1
    enable_return_routed_experts: bool = False
    max_running_requests: int = 128
    chunked_prefill_size: Optional[int] = 1024
    max_total_tokens: Optional[int] = None
    kv_cache_bytes: Optional[int] = None
    context_length: Optional[int] = None
    disable_prefix_caching: bool = False
    decode_graph_batch_sizes: tuple[int, ...] = ()
    prefill_graph_token_sizes: tuple[int, ...] = ()
    seed: int = 0
    weight_version: str = "default"
    stream_interval: int = 1
    max_capture_buffer_rows: Optional[int] = None
    enable_profile_graph_capture: bool = False
    profile_graph_capture_dir: Optional[str] = None
    moe_backend: Optional[str] = None
    attention_backend: Optional[str] = None
    # ---- HTTP ----
    host: str = "127.0.0.1"
    port: int = 30000
    served_model_name: Optional[str] = None
    api_key: Optional[str] = None
    admin_api_key: Optional[str] = None
    allowed_weight_dirs: tuple[str, ...] = ()
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    log_level: str = "info"
    enable_debug_endpoints: bool = False
    # NOTE: well above HTTP clients' pool expiry (httpx 5 s, aiohttp 15 s): a server that closes an
    # idle connection first races the client's next request on it
    timeout_keep_alive: int = DEFAULT_TIMEOUT_KEEP_ALIVE
    incremental_streaming_output: bool = False
    allow_pickled_weight_tensors: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"port must be an integer in [0, 65535], got {self.port!r}")
        if isinstance(self.max_request_bytes, bool) or not isinstance(self.max_request_bytes, int) \
                or self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes must be an integer >= 1024, got {self.max_request_bytes!r}")
        if isinstance(self.timeout_keep_alive, bool) or not isinstance(self.timeout_keep_alive, int) \
                or not 1 <= self.timeout_keep_alive <= 86400:
            raise ValueError(f"timeout_keep_alive must be an integer in [1, 86400] (seconds), "
                             f"got {self.timeout_keep_alive!r}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {LOG_LEVELS}, got {self.log_level!r}")
        for name in ("api_key", "admin_api_key"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty string when given")
        object.__setattr__(self, "allowed_weight_dirs", tuple(self.allowed_weight_dirs or ()))
        self.engine_config()  # validates every engine field with EngineConfig's messages

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            model_path=self.model_path, tokenizer_path=self.tokenizer_path, dtype=self.dtype, device=self.device,
            dp_size=self.dp_size, enable_return_routed_experts=self.enable_return_routed_experts,
            max_running_requests=self.max_running_requests, chunked_prefill_size=self.chunked_prefill_size,
            max_total_tokens=self.max_total_tokens, kv_cache_bytes=self.kv_cache_bytes,
            context_length=self.context_length, enable_prefix_caching=not self.disable_prefix_caching,
            decode_graph_batch_sizes=self.decode_graph_batch_sizes,
            prefill_graph_token_sizes=self.prefill_graph_token_sizes, seed=self.seed,
            weight_version=self.weight_version, max_capture_buffer_rows=self.max_capture_buffer_rows,
            stream_interval=self.stream_interval, enable_profile_graph_capture=self.enable_profile_graph_capture,
            profile_graph_capture_dir=self.profile_graph_capture_dir, moe_backend=self.moe_backend,
            attention_backend=self.attention_backend)

    @property
    def model_name(self) -> str:
        """The name /v1/models lists (the model directory's name unless --served-model-name)."""
        return self.served_model_name or os.path.basename(os.path.normpath(self.model_path))

    @property
    def weight_dirs(self) -> tuple[str, ...]:
        """Directories /update_weights_from_disk may read: the model's own directory and
        --allowed-weight-dirs, symlinks and `..` resolved."""
        dirs = [self.model_path, *self.allowed_weight_dirs]
        return tuple(dict.fromkeys(os.path.realpath(d) for d in dirs))

    def redacted(self) -> dict[str, Any]:
        """Every field, with the keys replaced by whether they are set (for /server_info)."""
        out = dataclasses.asdict(self)
        for name in ("api_key", "admin_api_key"):
            out[name] = "<set>" if out[name] else None
        return out

    # ---- CLI -----------------------------------------------------------------------------------
    @staticmethod
    def parser() -> argparse.ArgumentParser:
        p = argparse.ArgumentParser(
            prog="rollout-serve",
            description="HTTP server (SGLang-compatible /generate, OpenAI /v1/*) for the MoE rollout engine.")
        e = p.add_argument_group("engine")
        e.add_argument("--model-path", default=DEFAULT_MODEL_PATH,
                       help="checkpoint directory (default: the embedded tiny MoE model)")
        e.add_argument("--tokenizer-path", default=None, help="tokenizer directory (default: the model path)")
        e.add_argument("--dtype", default="auto", choices=DTYPES)
        e.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
        e.add_argument("--dp-size", type=int, default=1)
        e.add_argument("--enable-return-routed-experts", action="store_true",
                       help="capture routed experts so requests may ask for them")
        e.add_argument("--max-running-requests", type=int, default=128)
        e.add_argument("--chunked-prefill-size", type=int, default=1024,
                       help="tokens per prefill forward; -1 or 0 = whole prompts")
        e.add_argument("--max-total-tokens", type=int, default=None, help="KV cache slots")
        e.add_argument("--kv-cache-bytes", type=int, default=None,
                       help="KV cache size when --max-total-tokens is unset (default 512 MiB)")
        e.add_argument("--context-length", type=int, default=None)
        e.add_argument("--disable-prefix-caching", action="store_true")
        e.add_argument("--decode-graph-batch-sizes", type=int, nargs="*", default=[])
        e.add_argument("--prefill-graph-token-sizes", type=int, nargs="*", default=[])
        e.add_argument("--seed", type=int, default=0)
        e.add_argument("--weight-version", default="default", help="initial weight_version label")
        e.add_argument("--stream-interval", type=int, default=1,
                       help="streaming: tokens per chunk unless a request sets sampling_params.stream_interval")
        e.add_argument("--max-capture-buffer-rows", type=int, default=None,
                       help="refuse configs whose routed-expert capture buffer needs more rows")
        e.add_argument("--enable-profile-graph-capture", action="store_true",
                       help="write one profiler trace per captured graph shape")
        e.add_argument("--profile-graph-capture-dir", default=None)
        e.add_argument("--moe-backend", default=None, choices=MOE_BACKENDS,
                       help="router and experts kernels (default: triton on CUDA, torch on CPU)")
        e.add_argument("--attention-backend", default=None, choices=ATTENTION_BACKENDS,
                       help="attention kernels (default: flashinfer on CUDA when installed, else triton; torch on CPU)")
        h = p.add_argument_group("server")
        h.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
        h.add_argument("--port", type=int, default=30000, help="0 picks a free port (printed at start)")
        h.add_argument("--served-model-name", default=None)
        h.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (all but /health)")
        h.add_argument("--admin-api-key", default=None,
                       help="key required by weight updates, pause/continue, flush_cache and abort_all")
        h.add_argument("--allowed-weight-dirs", nargs="*", default=[],
                       help="directories /update_weights_from_disk may read (besides the model's own)")
        h.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                       help="larger request bodies get 413")
        h.add_argument("--timeout-keep-alive", type=int, default=DEFAULT_TIMEOUT_KEEP_ALIVE,
                       help="seconds an idle HTTP connection stays open (keep it above clients' pool expiry)")
        h.add_argument("--log-level", default="info", choices=LOG_LEVELS)
        h.add_argument("--enable-debug-endpoints", action="store_true", help=argparse.SUPPRESS)
        h.add_argument("--incremental-streaming-output", action="store_true",
                       help="streamed /generate chunks carry only what is new, with routing deltas (default: "
                            "cumulative chunks, as SGLang)")
        h.add_argument("--allow-pickled-weight-tensors", action="store_true",
                       help="let /update_weights_from_tensor load SGLang's pickled serialized_named_tensors "
                            "(runs code from the request: only for a trusted, colocated trainer; needs the admin "
                            "key when keys are set)")
        return p

    @classmethod
    def from_cli(cls, argv: Optional[Sequence[str]] = None) -> "ServerArgs":
        parser = cls.parser()
        ns = parser.parse_args(argv)
        chunk = ns.chunked_prefill_size
        try:
            return cls(
                model_path=ns.model_path, tokenizer_path=ns.tokenizer_path, dtype=ns.dtype, device=ns.device,
                dp_size=ns.dp_size, enable_return_routed_experts=ns.enable_return_routed_experts,
                max_running_requests=ns.max_running_requests,
                chunked_prefill_size=None if chunk is not None and chunk <= 0 else chunk,
                max_total_tokens=ns.max_total_tokens, kv_cache_bytes=ns.kv_cache_bytes,
                context_length=ns.context_length,
                disable_prefix_caching=ns.disable_prefix_caching,
                decode_graph_batch_sizes=tuple(ns.decode_graph_batch_sizes),
                prefill_graph_token_sizes=tuple(ns.prefill_graph_token_sizes), seed=ns.seed,
                weight_version=ns.weight_version, max_capture_buffer_rows=ns.max_capture_buffer_rows,
                stream_interval=ns.stream_interval, enable_profile_graph_capture=ns.enable_profile_graph_capture,
                profile_graph_capture_dir=ns.profile_graph_capture_dir, attention_backend=ns.attention_backend,
                host=ns.host, port=ns.port,
                served_model_name=ns.served_model_name, api_key=ns.api_key, admin_api_key=ns.admin_api_key,
                allowed_weight_dirs=tuple(ns.allowed_weight_dirs), max_request_bytes=ns.max_request_bytes,
                log_level=ns.log_level, enable_debug_endpoints=ns.enable_debug_endpoints, moe_backend=ns.moe_backend,
                timeout_keep_alive=ns.timeout_keep_alive,
                incremental_streaming_output=ns.incremental_streaming_output,
                allow_pickled_weight_tensors=ns.allow_pickled_weight_tensors)
        except ValueError as exc:
            parser.error(str(exc))
            raise  # unreachable: parser.error exits
