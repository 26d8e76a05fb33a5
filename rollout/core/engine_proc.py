"""engine_main: the entry point of an engine process (one per DP rank).

Builds the EngineCore here (the model is loaded in this process), says Ready, then runs the
EngineLoop until Shutdown, the front end's death, or an error. An error is reported as Fatal
(with its traceback) before the process exits non-zero; under DP, a rank whose peer died first
aborts its own requests so their partial outputs reach the front end.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import sys
import traceback
from datetime import timedelta
from typing import Any, Optional

import torch

from rollout.config import EngineConfig
from rollout.core.cpu_threads import CpuThreads
from rollout.core.engine_loop import EngineLoop, StepSync
from rollout.core.engine_core import EngineCore
from rollout.cpu_affinity import pin_process
from rollout.ipc.control_values import PEER_FAILED   # NOTE: the front end replaces it with the dead rank's name and exit code
from rollout.ipc.messages import Fatal, Ready, StepOut
from rollout.ipc.temp_dirs import pid_alive
from rollout.ipc.transport import EngineSockets

COLLECTIVE_TIMEOUT = timedelta(seconds=600)
logger = logging.getLogger(__name__)


def _join_dp_group(cfg: EngineConfig, rank: int, store_port: int) -> tuple[EngineConfig, Any]:
    import torch.distributed as dist  # noqa: PLC0415

    from rollout.models.ep_group import EPGroup  # noqa: PLC0415

    if cfg.device.startswith("cuda"):
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        cfg = cfg.replace(device=str(device))
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
        # NOTE: the ranks are processes of one host and talk over loopback; gloo would otherwise
        # bind the address the hostname resolves to. Set here, in the engine process only.
        if sys.platform.startswith("linux"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=COLLECTIVE_TIMEOUT)
    dist.init_process_group(backend, store=store, rank=rank, world_size=cfg.dp_size, timeout=COLLECTIVE_TIMEOUT)
    return cfg, EPGroup(rank=rank, size=cfg.dp_size, device=device)


def engine_main(config: dict, rank: int, to_engine_addr: str, from_engine_addr: str,
                store_port: Optional[int], parent_pid: int, sentinel_fd: Optional[int] = None) -> None:
    """sentinel_fd: the write end of the front end's exit pipe, held open (and never written)
    for the life of this process."""
    logging.basicConfig(level=os.environ.get("ROLLOUT_LOG_LEVEL", "WARNING"))
    sockets = EngineSockets(to_engine_addr, from_engine_addr)
    code = 0
    core: Optional[EngineCore] = None
    try:
        cfg = EngineConfig(**config)
        if cfg.cpu_affinity:
            pin_process(cfg.cpu_affinity_of(rank))
        threads = None if cfg.device.startswith("cuda") else CpuThreads(cfg.resolved_cpu_threads, cfg.cpu_reserve)
        ep_group = sync = None
        if cfg.dp_size > 1:
            cfg, ep_group = _join_dp_group(cfg, rank, store_port)
            sync = StepSync(ep_group.device)
        core = EngineCore(cfg, ep_group=ep_group, cpu_threads=threads)
        sockets.send(Ready(info={"kv_capacity": core.kv_capacity, "context_length": core.context_length,
                                 "weight_version": core.weight_version, "pid": os.getpid()}))
        # NOTE: the front end's pid, not os.getppid(): under forkserver the parent is the fork server
        EngineLoop(core, sockets, sync=sync, alive=lambda: pid_alive(parent_pid)).run()
    except BaseException:  # noqa: BLE001 (reported to the front end, then the process exits non-zero)
        code = 1
        text = traceback.format_exc()
        where = "failed to start" if core is None else "failed"
        if core is not None:
            try:
                core.abort_all(PEER_FAILED if cfg.dp_size > 1 else f"engine failed: {text.strip().splitlines()[-1]}")
                sockets.send(StepOut(updates=core.take_updates()))
            except BaseException:  # noqa: BLE001
                pass
        try:
            sockets.send(Fatal(traceback=f"engine rank {rank} {where}:\n{text}"))
        except BaseException:  # noqa: BLE001
            pass
    finally:
        if core is not None:
            core.close()
        try:
            import torch.distributed as dist  # noqa: PLC0415

            if dist.is_initialized():
                dist.destroy_process_group()
        except BaseException:  # noqa: BLE001
            pass
        sockets.close()
        sys.stdout.flush()
        sys.stderr.flush()
        # NOTE: skip the interpreter's teardown (about a second with torch loaded)
        os._exit(code)


if __name__ == "__main__":
    # NOTE: a terminal's Ctrl-C and SLURM's or a supervisor's SIGTERM reach the whole process group; the
    # engine ends when its front end tells it to (after aborting with partial outputs) or exits
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _cfg, _rank, _to, _from, _port, _parent, _fd = sys.argv[1:8]
    engine_main(json.loads(_cfg), int(_rank), _to, _from, int(_port) or None, int(_parent), int(_fd))
