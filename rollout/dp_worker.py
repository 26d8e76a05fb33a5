"""DP worker: one DP-attention rank in its own process, an EngineCore stepped by the DPCoordinator.

Protocol over one duplex pipe (the coordinator's side is rollout/dp_coordinator.py):
  coordinator -> worker: ("add", req, needs_detokenizer)   no reply
                         ("step",)                          every rank steps together
                         ("call", method, args)             an EngineCore command
                         ("stop",)
  worker -> coordinator: ("ready", info) once, then per step/call
                         ("ok", result, has_work, items) | ("raise", exc, has_work, items)
                         ("fatal", traceback_text)           then the worker exits
`items` are the StreamChunks / RolloutOutputs the rank produced (sinks live in the front end).
"""
from __future__ import annotations

import os
import pickle
import sys
import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from rollout.config import EngineConfig
from rollout.detokenizer import IncrementalDetokenizer
from rollout.engine_core import EngineCore
from rollout.models.ep_group import EPGroup

COMMANDS = frozenset({
    "abort", "abort_all", "flush_cache", "check_integrity", "stats_report", "load_report", "recent_layouts",
    "pause", "resume", "retract_running", "hold_admission", "release_admission", "try_swap_weights",
    "set_weight_version",
})
COLLECTIVE_TIMEOUT = timedelta(seconds=600)


def _picklable(exc: BaseException) -> BaseException:
    try:
        pickle.dumps(exc)
        return exc
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def worker_main(rank: int, cfg: EngineConfig, store_port: int, conn: Any) -> None:
    try:
        if cfg.device.startswith("cuda"):
            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
            cfg = cfg.replace(device=str(device))
            backend = "nccl"
        else:
            device = torch.device("cpu")
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // cfg.dp_size))
            backend = "gloo"
            # NOTE: the ranks are processes of one host and talk over loopback; gloo would otherwise
            # bind the address the hostname resolves to. Set here, in the worker process only.
            if sys.platform.startswith("linux"):
                os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=COLLECTIVE_TIMEOUT)
        dist.init_process_group(backend, store=store, rank=rank, world_size=cfg.dp_size,
                                timeout=COLLECTIVE_TIMEOUT)
        core = EngineCore(cfg, ep_group=EPGroup(rank=rank, size=cfg.dp_size, device=device))
    except BaseException:  # noqa: BLE001
        conn.send(("fatal", f"DP rank {rank} failed to start:\n{traceback.format_exc()}"))
        return
    outbox: list[Any] = []
    conn.send(("ready", {"kv_capacity": core.kv_capacity, "context_length": core.context_length,
                         "weight_version": core.weight_version}))
    try:
        _serve(core, conn, outbox)
    except (EOFError, OSError):
        pass  # the coordinator went away: nothing left to serve
    except BaseException:  # noqa: BLE001
        try:
            conn.send(("fatal", f"DP rank {rank} failed:\n{traceback.format_exc()}"))
        except (EOFError, OSError):
            pass
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass
    # NOTE: skip the interpreter's teardown (about a second with torch loaded); nothing is left to flush
    # but stdio.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _serve(core: EngineCore, conn: Any, outbox: list[Any]) -> None:
    def drain() -> list[Any]:
        items = list(outbox)
        outbox.clear()
        return items

    while True:
        msg = conn.recv()
        kind = msg[0]
        if kind == "add":
            _, req, needs_detok = msg
            req.sink = outbox.append
            if needs_detok:
                skip = req.params.skip_special_tokens
                req.detokenizer = IncrementalDetokenizer(
                    lambda t, s=skip: core.tokenizer.decode(t, skip_special_tokens=s))
            core.add_request(req)
        elif kind == "step":
            core.step()  # NOTE: a failure here is fatal (the other ranks may sit in a collective)
            conn.send(("ok", None, core.has_work(), drain()))
        elif kind == "call":
            _, name, args = msg
            assert name in COMMANDS, name
            try:
                result = getattr(core, name)(*args)
                conn.send(("ok", result, core.has_work(), drain()))
            except Exception as exc:  # noqa: BLE001 (a command error goes back to its caller)
                conn.send(("raise", _picklable(exc), core.has_work(), drain()))
        elif kind == "stop":
            return
        else:
            raise AssertionError(f"unknown DP worker message {kind!r}")
