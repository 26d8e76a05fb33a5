"""DPCoordinator: the front end's engine under DP attention (dp_size worker processes).

It offers Rollout's engine thread the same small interface as EngineCore (add_request, has_work,
step, abort, abort_all, flush_cache, check_integrity, stats_report, ...). Requests go to one rank
(least loaded, `routed_dp_rank` pins one, the n samples of one prompt stay together so they share
its prefix cache); every step goes to every rank, which step together (an idle rank runs an empty
forward). The ranks send back (rid-carrying) chunks and outputs and the coordinator calls the
request's sink here, in the front-end process. A worker that dies or fails makes every later call
raise EngineDeadError and the other workers are stopped: the engine never hangs on a dead rank.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from multiprocessing import connection as mp_connection
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rollout.config import EngineConfig
from rollout.dp_worker import worker_main
from rollout.engine import EngineDeadError
from rollout.models.registry import architecture_of, model_class, read_config, resolve_dtype
from rollout.output import RolloutOutput
from rollout.request import Req
from rollout.stream_chunk import StreamChunk
from rollout.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class DPCoordinator:
    STARTUP_TIMEOUT_S = 600.0
    REPLY_TIMEOUT_S = 900.0     # one step or command; a live but stuck rank counts as dead after this
    STOP_TIMEOUT_S = 10.0

    def __init__(self, cfg: EngineConfig):
        assert cfg.dp_size > 1, cfg.dp_size
        self.cfg = cfg
        self.dp_size = cfg.dp_size
        hf_cfg, gen = read_config(cfg.model_path)
        self.info = model_class(architecture_of(hf_cfg)).spec_from_config(hf_cfg, gen).info
        self.tokenizer = Tokenizer(cfg.resolved_tokenizer_path)
        self.context_length = cfg.context_length or self.info.max_position_embeddings
        self.weight_version = cfg.weight_version
        self.paused_mode: Optional[str] = None
        self._meta_model: Optional[torch.nn.Module] = None
        self._sinks: dict[str, Callable[[Any], None]] = {}
        self._owner: dict[str, int] = {}
        self._load = [0] * self.dp_size
        self._groups: dict[str, list[int]] = {}       # n>1 base rid -> [rank, members in flight]
        self._group_of: dict[str, str] = {}           # member rid -> its group's base rid
        self._has_work = [False] * self.dp_size
        self._dead: Optional[str] = None
        # NOTE: the rendezvous store listens on a free port picked by the OS (port 0), in this process.
        self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        ctx = mp.get_context("spawn")
        self._conns: list[Any] = []
        self._procs: list[Any] = []
        try:
            for rank in range(self.dp_size):
                parent, child = ctx.Pipe(duplex=True)
                proc = ctx.Process(target=worker_main, args=(rank, cfg, self._store.port, child),
                                   name=f"rollout-dp{rank}", daemon=True)
                proc.start()
                child.close()
                self._conns.append(parent)
                self._procs.append(proc)
            ready = [self._recv(rank, self.STARTUP_TIMEOUT_S) for rank in range(self.dp_size)]
        except BaseException:
            self.close()
            raise
        for msg in ready:
            assert msg[0] == "ready", msg
        self.kv_capacity = ready[0][1]["kv_capacity"]

    # ---- transport ---------------------------------------------------------------------------
    def _die(self, reason: str) -> None:
        if self._dead is None:
            # NOTE: the ranks left in a collective with a dead rank fail too; name the dead one first.
            crashed = [f"DP rank {r} exited with code {c}" for r, c in self._crashed(wait_s=1.0)]
            crashed = [c for c in crashed if c not in reason]
            if crashed:
                reason = "; ".join(crashed) + f" ({reason})"
            self._dead = reason
            logger.error("DP engine stopped: %s", reason)
        self.close()
        raise EngineDeadError(self._dead)

    def _crashed(self, wait_s: float) -> list[tuple[int, int]]:
        """(rank, exit code) of workers that died abnormally, waiting up to wait_s for a first one."""
        sentinels = [p.sentinel for p in self._procs]
        if sentinels:
            mp_connection.wait(sentinels, timeout=wait_s)
        out = []
        for rank, proc in enumerate(self._procs):
            if not proc.is_alive():
                proc.join(timeout=1.0)
                if proc.exitcode not in (0, None):
                    out.append((rank, proc.exitcode))
        return out

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)

    def _recv(self, rank: int, timeout: float) -> tuple:
        """rank's next message; any rank dying (or a fatal report) on the way kills the engine."""
        conn = self._conns[rank]
        deadline = time.monotonic() + timeout
        sentinels = {p.sentinel: r for r, p in enumerate(self._procs)}
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self._die(f"DP rank {rank} sent no reply in {timeout:.0f} s")
            ready = mp_connection.wait([conn, *sentinels], timeout=min(left, 1.0))
            if conn in ready:
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    self._die(f"DP rank {rank} closed its pipe (exit code {self._procs[rank].exitcode})")
                if msg[0] == "fatal":
                    self._die(msg[1])
                return msg
            for s in ready:
                r = sentinels[s]
                if not (r == rank and conn.poll()):
                    self._procs[r].join(timeout=1.0)
                    self._die(self._last_words(r) or f"DP rank {r} exited with code {self._procs[r].exitcode}")

    def _last_words(self, rank: int) -> Optional[str]:
        """The fatal report a dead rank left in its pipe (its traceback), if any."""
        conn = self._conns[rank]
        try:
            while conn.poll():
                msg = conn.recv()
                if msg[0] == "fatal":
                    return msg[1]
        except (EOFError, OSError):
            pass
        return None

    def _send(self, rank: int, msg: tuple) -> None:
        try:
            self._conns[rank].send(msg)
        except (EOFError, OSError, BrokenPipeError):
            self._die(f"DP rank {rank} is gone (exit code {self._procs[rank].exitcode})")

    def _absorb(self, rank: int, msg: tuple) -> Any:
        kind, result, has_work, items = msg
        self._has_work[rank] = has_work
        for item in items:
            self._deliver(item)
        if kind == "raise":
            raise result
        assert kind == "ok", kind
        return result

    def _deliver(self, item: Any) -> None:
        rid = item.rid
        sink = self._sinks.get(rid)
        if isinstance(item, RolloutOutput) or (isinstance(item, StreamChunk) and item.finished):
            self._sinks.pop(rid, None)
            rank = self._owner.pop(rid, None)
            if rank is not None:
                self._load[rank] -= 1
            base = self._group_of.pop(rid, None)
            if base is not None:
                group = self._groups[base]
                group[1] -= 1
                if group[1] <= 0:
                    del self._groups[base]
        if sink is not None:
            sink(item)

    def _call_all(self, name: str, *args: Any) -> list[Any]:
        self._check_alive()
        for rank in range(self.dp_size):
            self._send(rank, ("call", name, args))
        replies = [self._recv(rank, self.REPLY_TIMEOUT_S) for rank in range(self.dp_size)]
        results, error = [], None
        for rank, msg in enumerate(replies):
            try:
                results.append(self._absorb(rank, msg))
            except Exception as exc:  # noqa: BLE001 (absorb every rank's items, then raise)
                error = error or exc
                results.append(None)
        if error is not None:
            raise error
        return results

    def _call_one(self, rank: int, name: str, *args: Any) -> Any:
        self._check_alive()
        self._send(rank, ("call", name, args))
        return self._absorb(rank, self._recv(rank, self.REPLY_TIMEOUT_S))

    # ---- EngineCore's interface ----------------------------------------------------------------
    @property
    def capture_enabled(self) -> bool:
        return self.cfg.enable_return_routed_experts

    def _pick_rank(self, req: Req) -> int:
        if req.routed_dp_rank is not None:
            return req.routed_dp_rank
        if req.params.n > 1:
            group = self._groups.get(req.rid.rsplit("_", 1)[0])
            if group is not None:
                return group[0]
        return min(range(self.dp_size), key=lambda r: (self._load[r], r))

    def add_request(self, req: Req) -> None:
        self._check_alive()
        rank = self._pick_rank(req)
        wire = dataclasses.replace(req, sink=None, detokenizer=None)
        self._send(rank, ("add", wire, req.detokenizer is not None))
        if req.sink is not None:
            self._sinks[req.rid] = req.sink
        self._owner[req.rid] = rank
        self._load[rank] += 1
        self._has_work[rank] = True
        if req.params.n > 1:
            base = req.rid.rsplit("_", 1)[0]
            group = self._groups.setdefault(base, [rank, 0])
            if group[0] == rank:
                group[1] += 1
                self._group_of[req.rid] = base

    def has_work(self) -> bool:
        # NOTE: dead: report work, so the engine thread steps and step() raises to every waiter.
        return self._dead is not None or any(self._has_work)

    def step(self) -> None:
        self._check_alive()
        for rank in range(self.dp_size):
            self._send(rank, ("step",))
        replies = [self._recv(rank, self.REPLY_TIMEOUT_S) for rank in range(self.dp_size)]
        for rank, msg in enumerate(replies):
            self._absorb(rank, msg)

    def abort(self, rid: str) -> bool:
        rank = self._owner.get(rid)
        if rank is None:
            return False
        return bool(self._call_one(rank, "abort", rid))

    def abort_all(self) -> int:
        return sum(self._call_all("abort_all"))

    def flush_cache(self) -> bool:
        # NOTE: each rank refuses while its requests hold KV; ranks that could flush did (harmless)
        return all(self._call_all("flush_cache"))

    def set_weight_version(self, version: str) -> None:
        self._call_all("set_weight_version", version)
        self.weight_version = version

    def check_integrity(self) -> None:
        self._call_all("check_integrity")

    def stats_report(self) -> dict:
        per_rank = self._call_all("stats_report")
        merged: dict[str, Any] = {}
        for stats in per_rank:
            for key, value in stats.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    merged[key] = merged.get(key, 0) + value
        merged["dp_ranks"] = per_rank
        return merged

    def load_report(self) -> list[dict]:
        out = []
        for rank, rows in enumerate(self._call_all("load_report")):
            out += [dict(row, dp_rank=rank) for row in rows]
        return out

    def recent_layouts(self) -> list[list]:
        """Per rank: the GatherLayouts of its latest forwards (all ranks agree step by step)."""
        return self._call_all("recent_layouts")

    # ---- server support (every rank) -----------------------------------------------------------
    @property
    def model(self) -> torch.nn.Module:
        """The model's structure on the meta device (names, shapes, dtypes); weights live in the ranks."""
        if self._meta_model is None:
            hf_cfg, gen = read_config(self.cfg.model_path)
            cls = model_class(architecture_of(hf_cfg))
            with torch.device("meta"):
                self._meta_model = cls(cls.spec_from_config(hf_cfg, gen)).to(resolve_dtype(self.cfg.dtype, hf_cfg))
        return self._meta_model

    def pause(self, mode: str) -> int:
        count = sum(self._call_all("pause", mode))
        self.paused_mode = mode
        return count

    def resume(self) -> bool:
        was = any(self._call_all("resume"))
        self.paused_mode = None
        return was

    def retract_running(self) -> int:
        return sum(self._call_all("retract_running"))

    def hold_admission(self) -> None:
        self._call_all("hold_admission")

    def release_admission(self) -> None:
        self._call_all("release_admission")

    def try_swap_weights(self, staged: dict, weight_version: Optional[str]) -> Optional[int]:
        # NOTE: a rank that swapped while another still runs requests swaps again on the next poll
        # (the same tensors, and a second cache flush): harmless, and all ranks end on the new weights.
        counts = self._call_all("try_swap_weights", staged, weight_version)
        if any(c is None for c in counts):
            return None
        if weight_version is not None:
            self.weight_version = weight_version
        return counts[0]

    # ---- lifecycle ---------------------------------------------------------------------------
    def close(self) -> None:
        """Stops every worker (politely, then by force); idempotent."""
        if self._dead is None:
            self._dead = "DP engine is shut down"
        for rank, proc in enumerate(self._procs):
            if proc.is_alive():
                try:
                    self._conns[rank].send(("stop",))
                except (EOFError, OSError):
                    pass
        deadline = time.monotonic() + self.STOP_TIMEOUT_S
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=2.0)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=2.0)
        for conn in self._conns:
            conn.close()
        self._conns = []
        self._procs = []
