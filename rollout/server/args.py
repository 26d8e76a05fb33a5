"""ServerArgs: the frozen settings of `rollout-serve` (an EngineConfig + the HTTP/security flags) and its CLI."""
from __future__ import annotations

import argparse
import dataclasses
import os
import resource
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from rollout.config import EngineConfig
from rollout.config.engine_cli import add_engine_arguments, engine_cli_values, engine_config_from_args

DEFAULT_MAX_REQUEST_BYTES = 64 * 2**20
DEFAULT_TIMEOUT_KEEP_ALIVE = 75
DEFAULT_TIMEOUT_READ_S = 60
# NOTE: under a supervisor's kill timeout (Kubernetes' terminationGracePeriodSeconds and SLURM's KillWait
# are 30 s by default), leaving time to abort the rest and write their partial answers
DEFAULT_SHUTDOWN_DRAIN_S = 20.0
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
# NOTE: file descriptors kept for the server's own use (engine pipes and shared memory, checkpoint
# files, logs) when the connection cap is derived from the process's RLIMIT_NOFILE
FD_RESERVE = 256
MIN_CONNECTIONS = 64


def default_max_connections() -> int:
    """The connection cap when --max-connections is not given: the soft RLIMIT_NOFILE (`ulimit -n`)
    less FD_RESERVE, at least MIN_CONNECTIONS."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(MIN_CONNECTIONS, soft - FD_RESERVE)


@dataclass(frozen=True, kw_only=True)
class ServerArgs:
    # the engine's settings; their flags are generated from EngineConfig's fields (rollout/config/engine_cli.py)
    engine: EngineConfig = field(default_factory=EngineConfig)
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
    # a connection's request headers, then its body, must each arrive within this (slowloris)
    timeout_read: int = DEFAULT_TIMEOUT_READ_S
    # open HTTP connections past this get a JSON 503 and are closed (None: from RLIMIT_NOFILE)
    max_connections: Optional[int] = None
    # on SIGTERM / SIGINT: how long the requests in flight may run on before they are aborted
    shutdown_drain_s: float = DEFAULT_SHUTDOWN_DRAIN_S
    incremental_streaming_output: bool = False
    allow_pickled_weight_tensors: bool = False
    # NOTE: for fleets behind sglang-router, which rebuilds /generate bodies from its own schema and
    # drops return_routed_experts: /generate requests that do not say return routing
    default_return_routed_experts: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.engine, EngineConfig):
            raise ValueError(f"engine must be an EngineConfig, got {type(self.engine).__name__}")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"port must be an integer in [0, 65535], got {self.port!r}")
        if isinstance(self.max_request_bytes, bool) or not isinstance(self.max_request_bytes, int) \
                or self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes must be an integer >= 1024, got {self.max_request_bytes!r}")
        if isinstance(self.timeout_keep_alive, bool) or not isinstance(self.timeout_keep_alive, int) \
                or not 1 <= self.timeout_keep_alive <= 86400:
            raise ValueError(f"timeout_keep_alive must be an integer in [1, 86400] (seconds), "
                             f"got {self.timeout_keep_alive!r}")
        if isinstance(self.timeout_read, bool) or not isinstance(self.timeout_read, int) \
                or not 1 <= self.timeout_read <= 86400:
            raise ValueError(f"timeout_read must be an integer in [1, 86400] (seconds), got {self.timeout_read!r}")
        if self.max_connections is not None and (isinstance(self.max_connections, bool) or not isinstance(
                self.max_connections, int) or not 1 <= self.max_connections <= 1 << 24):
            raise ValueError(f"max_connections must be an integer in [1, {1 << 24}], got {self.max_connections!r}")
        if isinstance(self.shutdown_drain_s, bool) or not isinstance(self.shutdown_drain_s, (int, float)) \
                or not 0 <= self.shutdown_drain_s <= 86400:
            raise ValueError(f"shutdown_drain_s must be a number in [0, 86400] (seconds), "
                             f"got {self.shutdown_drain_s!r}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {LOG_LEVELS}, got {self.log_level!r}")
        for name in ("api_key", "admin_api_key"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty string when given")
        if self.default_return_routed_experts and not self.engine.enable_return_routed_experts:
            raise ValueError("default_return_routed_experts needs enable_return_routed_experts "
                             "(--enable-return-routed-experts)")
        object.__setattr__(self, "allowed_weight_dirs", tuple(self.allowed_weight_dirs or ()))

    @property
    def model_name(self) -> str:
        """The name /v1/models lists (the model directory's name unless --served-model-name)."""
        return self.served_model_name or os.path.basename(os.path.normpath(self.engine.model_path))

    @property
    def connection_cap(self) -> int:
        """The open connections served at once (--max-connections, else default_max_connections())."""
        return self.max_connections if self.max_connections is not None else default_max_connections()

    @property
    def weight_dirs(self) -> tuple[str, ...]:
        """Directories /update_weights_from_disk may read: the model's own directory and
        --allowed-weight-dirs, symlinks and `..` resolved."""
        dirs = [self.engine.model_path, *self.allowed_weight_dirs]
        return tuple(dict.fromkeys(os.path.realpath(d) for d in dirs))

    def redacted(self) -> dict[str, Any]:
        """Every setting, flat (the engine's under their flag names, as `disable_prefix_caching`), with
        the keys replaced by whether they are set (for /server_info)."""
        out = engine_cli_values(self.engine)
        out.update((f.name, getattr(self, f.name)) for f in self._http_fields())
        for name in ("api_key", "admin_api_key"):
            out[name] = "<set>" if out[name] else None
        return out

    # ---- CLI -----------------------------------------------------------------------------------
    @staticmethod
    def parser() -> argparse.ArgumentParser:
        p = argparse.ArgumentParser(
            prog="rollout-serve",
            description="HTTP server (SGLang-compatible /generate, OpenAI /v1/*) for the MoE rollout engine.")
        add_engine_arguments(p)
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
        h.add_argument("--timeout-read", type=int, default=DEFAULT_TIMEOUT_READ_S,
                       help="seconds a connection may take to send a request's headers, and then its body "
                            "(slower or silent connections are closed)")
        h.add_argument("--max-connections", type=int, default=None,
                       help="open HTTP connections served at once; a request on a connection past it gets a JSON "
                            f"503 and the connection closes (default: `ulimit -n` less {FD_RESERVE}, at least "
                            f"{MIN_CONNECTIONS})")
        h.add_argument("--shutdown-drain-s", type=float, default=DEFAULT_SHUTDOWN_DRAIN_S,
                       help="on SIGTERM/SIGINT: seconds the requests in flight may run on before the rest are "
                            "aborted (partial outputs, finish_reason abort); a second signal aborts at once")
        h.add_argument("--log-level", default="info", choices=LOG_LEVELS)
        h.add_argument("--enable-debug-endpoints", action="store_true", help=argparse.SUPPRESS)
        h.add_argument("--incremental-streaming-output", action="store_true",
                       help="streamed /generate chunks carry only what is new, with routing deltas (default: "
                            "cumulative chunks, as SGLang)")
        h.add_argument("--allow-pickled-weight-tensors", action="store_true",
                       help="let /update_weights_from_tensor load SGLang's pickled serialized_named_tensors "
                            "(runs code from the request: only for a trusted, colocated trainer; needs the admin "
                            "key when keys are set)")
        h.add_argument("--default-return-routed-experts", action="store_true",
                       help="/generate returns routed experts unless a request sends return_routed_experts: false "
                            "(for fleets behind sglang-router, which drops the field; needs "
                            "--enable-return-routed-experts)")
        return p

    @classmethod
    def from_cli(cls, argv: Optional[Sequence[str]] = None) -> "ServerArgs":
        parser = cls.parser()
        ns = parser.parse_args(argv)
        try:
            return cls(engine=engine_config_from_args(ns),
                       **{f.name: getattr(ns, f.name) for f in cls._http_fields()})
        except ValueError as exc:
            parser.error(str(exc))
            raise  # unreachable: parser.error exits

    @classmethod
    def _http_fields(cls) -> tuple[dataclasses.Field, ...]:
        """The server's own fields (all but `engine`); each is a flag of the same name."""
        return tuple(f for f in dataclasses.fields(cls) if f.name != "engine")
