"""rollout-serve's startup, up to the app: the flags, the port, the model directory; each failure is
one line on stderr, never a traceback: a bad flag exits 2, a failure to start 1 (a taken port, a
missing model directory or a Hub id, an engine that cannot load), and Ctrl-C before the server is
up 130, as after. Node R > 0 of a server that spans nodes binds no port: it starts its engine
processes (serve_node). The port is bound and the model directory checked before torch is imported, so
these fail in a second."""
from __future__ import annotations

import os
import socket
import sys
from typing import Callable, NoReturn, Optional, Sequence

from rollout.config.model_dir import check_model_dir
from rollout.server.args import ServerArgs
from rollout.server.startup_error import StartupError

PROG = "rollout-serve"
FAILED_EXIT = 1
INTERRUPTED_EXIT = 130


def bind(host: str, port: int) -> socket.socket:
    """The listening socket; StartupError when the address cannot be had."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise StartupError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise StartupError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def _exit(code: int, line: str) -> NoReturn:
    print(f"{PROG}: {line}", file=sys.stderr, flush=True)
    sys.exit(code)


def interrupted() -> NoReturn:
    """Ctrl-C before the server is up: one line, exit 130. NOTE: os._exit, because CPython exits by
    SIGINT itself (status -2, not 130) once a KeyboardInterrupt has crossed C code (torch's import),
    even when it was caught; what the interrupted startup made is already undone."""
    print(f"{PROG}: interrupted before the server was up", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(INTERRUPTED_EXIT)


def _load(args: ServerArgs) -> Callable[[ServerArgs, socket.socket], None]:
    """The model directory checked, then the app imported (torch, FastAPI: seconds): its serve()."""
    try:
        check_model_dir(args.engine.model_path, "--model-path")
    except ValueError as exc:
        raise StartupError(str(exc)) from None
    try:
        from rollout.server.app import serve  # noqa: PLC0415
    except ImportError as exc:
        raise StartupError(f"cannot import the server's dependencies: {exc} (bash scripts/setup_env.sh installs "
                           f"them)") from None
    return serve


def serve_node(args: ServerArgs) -> NoReturn:
    """`--node-rank R > 0`: this node's engine processes only, no HTTP (rollout/frontend/engine_node.py);
    exits when they have ended: 0 after the server stopped them, 1 when one failed."""
    import logging  # noqa: PLC0415

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        check_model_dir(args.engine.model_path, "--model-path")
    except ValueError as exc:
        raise StartupError(str(exc)) from None
    from rollout.frontend.engine_node import EngineNode  # noqa: PLC0415

    node = EngineNode(args.engine)
    try:
        code = node.run()
    except (ValueError, OSError, RuntimeError) as exc:
        raise StartupError(f"{node.name}: {exc}") from None
    if code:
        _exit(code, f"error: {node.name}: {node.message or 'an engine failed'}")
    print(f"{PROG}: {node.name}: the engines ended", file=sys.stderr, flush=True)
    sys.exit(0)


def main(argv: Optional[Sequence[str]] = None) -> None:
    try:
        args = ServerArgs.from_cli(argv)
        if args.engine.node_rank > 0:
            serve_node(args)
        # NOTE: bound before the model loads: a taken port fails in a second, not after the load
        sock = bind(args.host, args.port)
        try:
            serve = _load(args)
        except BaseException:
            sock.close()
            raise
        serve(args, sock)
    except StartupError as exc:
        _exit(FAILED_EXIT, f"error: {exc}")
    except KeyboardInterrupt:
        interrupted()
