"""ServerArgs: the frozen settings of `rollout-serve` (an EngineConfig + the HTTP/security flags) and its CLI.

Like EngineConfig's, each field carries its flag in its metadata (rollout/config/flag.py); the parser
is generated from both (FlagGroup), with help text and default for every flag."""
from __future__ import annotations

import argparse
import os
import resource
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from rollout.config import EngineConfig
from rollout.config.cli_parser import CliParser
from rollout.config.config_file import ConfigFileError, load_engine_config
from rollout.config.engine_cli import add_engine_arguments, engine_cli_values, engine_config_from_args
from rollout.config.flag import flag, no_flag
from rollout.config.flag_group import FlagGroup
from rollout.server.batch_log import DECODE_LOG_INTERVAL
from rollout.server.sglang_flags import add_sglang_flags, check_sglang_flags
from rollout.value_range import check_choice, check_range

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


DESCRIPTION = """HTTP server (SGLang-compatible /generate, OpenAI /v1/*) for the MoE rollout engine,
with the routed experts of every token."""
EPILOG = """examples:
  rollout-serve --enable-return-routed-experts                      the embedded tiny model on 127.0.0.1:30000
  rollout-serve --config configs/engine/qwen3-30b-a3b.yaml --model-path /models/Qwen3-30B-A3B

--model-path is a local directory: weights are never downloaded (fetch them first, for instance with
`huggingface-cli download Qwen/Qwen3-30B-A3B --local-dir /models/Qwen3-30B-A3B`)."""


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
    engine: EngineConfig = field(default_factory=EngineConfig, metadata=no_flag("its fields' flags: the engine group"))
    # ---- HTTP ----
    host: str = field(default="127.0.0.1", metadata=flag(
        help="address to listen on (0.0.0.0: every interface; then set --api-key)",
        default_text="127.0.0.1, this machine only"))
    port: int = field(default=30000, metadata=flag(type=int, help="TCP port; 0 picks a free one (printed at start)"))
    served_model_name: Optional[str] = field(default=None, metadata=flag(
        help="the model name /v1/models lists", default_text="the model directory's name"))
    api_key: Optional[str] = field(default=None, metadata=flag(
        help="require 'Authorization: Bearer KEY' (all but /health)", default_text="none: no key asked"))
    admin_api_key: Optional[str] = field(default=None, metadata=flag(
        help="key required by weight updates, pause/continue, flush_cache and abort_all",
        default_text="none: --api-key, if set, opens them too"))
    allowed_weight_dirs: tuple[str, ...] = field(default=(), metadata=flag(
        help="directories /update_weights_from_disk may read (besides the model's own)"))
    max_request_bytes: int = field(default=DEFAULT_MAX_REQUEST_BYTES, metadata=flag(
        type=int, help="larger request bodies get 413", default_text="64 MiB"))
    log_level: str = field(default="info", metadata=flag(choices=LOG_LEVELS, help="log messages of this level and above"))
    decode_log_interval: int = field(default=DECODE_LOG_INTERVAL, metadata=flag(
        type=int, help="log a 'Decode batch' line (running requests, tokens, gen throughput) every this many "
                       "decode steps (at info level)"))
    enable_debug_endpoints: bool = field(default=False, metadata=flag(hidden=True))
    # NOTE: well above HTTP clients' pool expiry (httpx 5 s, aiohttp 15 s): a server that closes an
    # idle connection first races the client's next request on it
    timeout_keep_alive: int = field(default=DEFAULT_TIMEOUT_KEEP_ALIVE, metadata=flag(
        type=int, help="seconds an idle HTTP connection stays open (keep it above clients' pool expiry)"))
    # a connection's request headers, then its body, must each arrive within this (slowloris)
    timeout_read: int = field(default=DEFAULT_TIMEOUT_READ_S, metadata=flag(
        type=int, help="seconds a connection may take to send a request's headers, and then its body (slower or "
                       "silent connections are closed)"))
    # open HTTP connections past this get a JSON 503 and are closed (None: from RLIMIT_NOFILE)
    max_connections: Optional[int] = field(default=None, metadata=flag(
        type=int, help="open HTTP connections served at once; a request on a connection past it gets a JSON 503 "
                       "and the connection closes", default_text=f"`ulimit -n` less {FD_RESERVE}, at least "
                                                               f"{MIN_CONNECTIONS}"))
    # on SIGTERM / SIGINT: how long the requests in flight may run on before they are aborted
    shutdown_drain_s: float = field(default=DEFAULT_SHUTDOWN_DRAIN_S, metadata=flag(
        type=float, help="on SIGTERM/SIGINT: seconds the requests in flight may run on before the rest are aborted "
                         "(partial outputs, finish_reason abort); a second signal aborts at once"))
    incremental_streaming_output: bool = field(default=False, metadata=flag(
        help="streamed /generate chunks carry only what is new, with routing deltas, instead of SGLang's "
             "cumulative chunks"))
    allow_pickled_weight_tensors: bool = field(default=False, metadata=flag(
        help="let /update_weights_from_tensor load SGLang's pickled serialized_named_tensors (runs code from the "
             "request: only for a trusted, colocated trainer; needs the admin key when keys are set)"))
    # NOTE: for fleets behind sglang-router, which rebuilds /generate and chat bodies from its own
    # schemas and drops return_routed_experts: requests that do not say return routing
    default_return_routed_experts: bool = field(default=False, metadata=flag(
        help="/generate, /v1/completions and /v1/chat/completions return routed experts unless a request sends "
             "return_routed_experts: false (for fleets behind sglang-router, which drops the field; needs "
             "--enable-return-routed-experts)"))

    def __post_init__(self) -> None:
        if not isinstance(self.engine, EngineConfig):
            raise ValueError(f"engine must be an EngineConfig, got {type(self.engine).__name__}")
        check_range("port", self.port, 0, 65535, integer=True)
        check_range("max_request_bytes", self.max_request_bytes, 1024, integer=True)
        check_range("timeout_keep_alive", self.timeout_keep_alive, 1, 86400, integer=True, why="seconds")
        check_range("timeout_read", self.timeout_read, 1, 86400, integer=True, why="seconds")
        check_range("max_connections", self.max_connections, 1, 1 << 24, integer=True, or_none=True)
        check_range("shutdown_drain_s", self.shutdown_drain_s, 0, 86400, why="seconds")
        check_choice("log_level", self.log_level, LOG_LEVELS)
        check_range("decode_log_interval", self.decode_log_interval, 1, 1 << 30, integer=True, why="decode steps")
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
        out.update(SERVER_FLAGS.cli_values(self))
        for name in ("api_key", "admin_api_key"):
            out[name] = "<set>" if out[name] else None
        return out

    # ---- CLI -----------------------------------------------------------------------------------
    @staticmethod
    def parser() -> CliParser:
        """rollout-serve's parser: --config, the engine group and the server group (both generated from the
        fields' Flag metadata), then SGLang's flags (rollout/server/sglang_flags.py)."""
        p = CliParser(prog="rollout-serve", usage="rollout-serve [--config FILE] [flags]", description=DESCRIPTION,
                      epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("--config", metavar="FILE", default=None,
                       help="an engine preset (configs/engine/*.yaml): its engine settings, which flags given on "
                            "the command line override (default: none)")
        add_engine_arguments(p)
        SERVER_FLAGS.add_to(p)
        add_sglang_flags(p)
        return p

    @classmethod
    def from_cli(cls, argv: Optional[Sequence[str]] = None) -> "ServerArgs":
        """The ServerArgs of a command line; a bad flag or value exits 2 with one line on stderr."""
        parser = cls.parser()
        ns = parser.parse_args(argv)
        if ns.config is not None:
            try:
                preset = load_engine_config(ns.config)
            except ConfigFileError as exc:
                parser.error(f"--config {exc}")
            # NOTE: the preset's values become the defaults, so that the flags given still win
            parser.set_defaults(**engine_cli_values(preset))
            ns = parser.parse_args(argv)
        try:
            engine = engine_config_from_args(ns)
            args = cls(engine=engine, **SERVER_FLAGS.field_values(ns))
        except ValueError as exc:
            parser.error(str(exc))
        check_sglang_flags(ns, engine, parser.error)
        return args


SERVER_FLAGS = FlagGroup(ServerArgs, "server")
