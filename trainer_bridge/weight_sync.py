"""Push the trainer's weights to every live rollout server after a step (behind sglang-router:
to every worker the router lists).

Three ways, one interface (``await sync.push(named_tensors, version)``):

``disk``         safetensors written to ``sync_dir/v{version}/model.safetensors`` (a directory the
                 servers can read: start them with ``--allowed-weight-dirs sync_dir``), then
                 ``POST /update_weights_from_disk`` on every server; older version dirs are removed.
``tensor``       the same safetensors bytes in the body of ``POST /update_weights_from_tensor``
                 (``application/octet-stream``, ``?weight_version=``) to every server.
``distributed``  a torch.distributed group of its own (TCP rendezvous at ``TRAIN_WEIGHT_SYNC_ADDR``:
                 ``TRAIN_WEIGHT_SYNC_PORT`` when set, else 127.0.0.1 and a free port; gloo on CPU,
                 NCCL on GPU): the trainer is rank 0, then every engine process of every server
                 (server ``i``'s DP ranks take the next ``dp_size`` ranks, as slime numbers an
                 SGLang server's TP workers). ``POST /update_weights_from_distributed`` (names,
                 dtypes, shapes) goes to every server while rank 0 broadcasts each tensor, in
                 ``names`` order; each engine process receives them into its own weights, bucket by
                 bucket. The group is rebuilt when the set of live servers changes (a dead member
                 would hang the broadcast).

Tensors are HF-named (transformers' in-memory names such as ``mlp.experts.gate_up_proj`` are
accepted by the servers' loader). Each server answers with its new ``weight_version``, which the
next rollouts carry; ``push`` checks it.
"""
from __future__ import annotations

import asyncio
import datetime
import gc
import logging
import os
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import httpx
import torch

from rollout.weight_group import init_custom_process_group

from .client import RolloutClient, RolloutError

logger = logging.getLogger(__name__)

__all__ = ["WeightSync", "SyncResult", "SYNC_MODES", "make_weight_sync", "init_custom_process_group"]

SYNC_MODES = ("disk", "tensor", "distributed")


@dataclass(frozen=True)
class SyncResult:
    version: str
    mode: str
    seconds: float
    bytes: int  # payload bytes sent per server (disk: file size written once)
    servers: tuple[str, ...]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WeightSync:
    """Base: ``push`` to the client's live servers, check each answered ``version``."""

    mode = ""

    def __init__(self, client: RolloutClient):
        self.client = client
        self.history: list[SyncResult] = []

    async def push(self, named: dict[str, torch.Tensor], version: str) -> SyncResult:
        """Pushes to the live servers and to dead ones that answer /health again (restarted by
        their supervisor): those rejoin (the client sends them requests again) only once they
        hold these weights. While it runs, the client takes samples of the old or the new version
        from them (and from each, afterwards, only those of the version it holds)."""
        t0 = time.perf_counter()
        await self.client.refresh_workers()   # behind sglang-router: every worker it lists now
        back = tuple(await self.client.recovered())
        urls = tuple(self.client.alive_urls) + back
        if not urls:
            raise RolloutError("weight sync: no live rollout server")
        for url in urls:
            self.client.pushing(url, str(version))
        try:
            return await self._push_to(named, str(version), urls, back, t0)
        finally:
            for url in urls:
                self.client.pushing(url, None)

    async def _push_to(self, named, version: str, urls: tuple[str, ...], back: tuple[str, ...],
                       t0: float) -> SyncResult:
        try:
            res = self._result(await self._push(named, str(version), urls), urls, str(version), t0)
            for url in back:
                logger.warning("rollout server %s is back (restarted); it has weight_version %s and takes "
                               "requests again", url, version)
                self.client.revive(url)
            return res
        except (RolloutError, RuntimeError) as exc:
            # NOTE: a server that died after its last rollout (so the client never saw it fail)
            # breaks the push; the live ones keep their old weights: push again to them, once.
            alive = tuple(await self.client.check_servers())
            if not alive or alive == urls:
                raise
            reason = f"{type(exc).__name__}: {exc}"
        # NOTE: retried outside the except block, once the failed attempt's traceback (whose frames
        # hold that attempt's process group) is gone, and the group collected. (With distributed
        # sync the live servers still wait out their receive of the broken broadcast, the group's
        # timeout_s, before they accept the new group: see docs/trainer.md.)
        gc.collect()
        logger.warning("weight sync (%s) to %s failed (%s); %d server(s) gone, pushing again to %s", self.mode,
                       ", ".join(urls), reason[:300], len(urls) - len(alive), ", ".join(alive))
        return self._result(await self._push(named, str(version), alive), alive, str(version), t0)

    def _result(self, pushed: tuple[dict, int], urls: tuple[str, ...], version: str, t0: float) -> SyncResult:
        answers, nbytes = pushed
        for url, ans in answers.items():
            if not isinstance(ans, dict) or not ans.get("success", False):
                raise RolloutError(f"weight sync ({self.mode}) to {url} failed: {ans}")
            if str(ans.get("weight_version")) != version:
                raise RolloutError(f"weight sync ({self.mode}) to {url}: server reports weight_version "
                                   f"{ans.get('weight_version')!r}, expected {version!r}")
        for url in answers:
            self.client.pushed(url, version)
        res = SyncResult(version, self.mode, time.perf_counter() - t0, nbytes, urls)
        self.history.append(res)
        return res

    async def _push(self, named, version, urls) -> tuple[dict, int]:
        raise NotImplementedError

    async def _post_each(self, urls, path: str, *, retry: bool = True, **kw) -> dict:
        http = self.client._http
        headers = {**self.client._headers(admin=True), **kw.pop("headers", {})}

        async def one(url: str):
            for attempt in range(2):
                try:
                    r = await http.post(url + path, headers=headers, timeout=600, **kw)
                    break
                except httpx.HTTPError as exc:
                    # NOTE: one retry when the server is still up (a stale keep-alive connection
                    # fails the same way); every update is idempotent (same tensors, same version).
                    if retry and attempt == 0 and await self.client._healthy(self.client._server(url)):
                        continue
                    self.client.mark_dead(url, f"weight sync failed: {type(exc).__name__}: {exc}")
                    raise RolloutError(f"weight sync: {url}{path}: {type(exc).__name__}: {exc}") from None
            try:
                return r.json()
            except ValueError:
                return {"success": False, "message": f"HTTP {r.status_code}: {r.text[:300]}"}
        return dict(zip(urls, await asyncio.gather(*(one(u) for u in urls))))

    async def close(self) -> None:
        pass


def _contiguous_cpu(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu").contiguous() for k, v in named.items()}


class DiskSync(WeightSync):
    mode = "disk"

    def __init__(self, client: RolloutClient, sync_dir: Optional[str] = None, keep: int = 1):
        super().__init__(client)
        self._own_dir = sync_dir is None
        self.sync_dir = Path(sync_dir or tempfile.mkdtemp(prefix="weight-sync-"))
        self.sync_dir.mkdir(parents=True, exist_ok=True)
        self.keep = keep
        self._written: list[Path] = []

    async def _push(self, named, version, urls):
        from safetensors.torch import save_file

        d = self.sync_dir / f"v{version}"
        d.mkdir(parents=True, exist_ok=True)
        path = d / "model.safetensors"
        tmp = d / "model.safetensors.tmp"
        await asyncio.to_thread(save_file, _contiguous_cpu(named), str(tmp))
        tmp.rename(path)  # NOTE: atomic, so a server never reads a half-written file
        answers = await self._post_each(urls, "/update_weights_from_disk",
                                        json={"model_path": str(d), "weight_version": version})
        self._written.append(d)
        while len(self._written) > self.keep:
            shutil.rmtree(self._written.pop(0), ignore_errors=True)
        return answers, path.stat().st_size

    async def close(self) -> None:
        if self._own_dir:
            shutil.rmtree(self.sync_dir, ignore_errors=True)


class TensorSync(WeightSync):
    mode = "tensor"

    async def _push(self, named, version, urls):
        from safetensors.torch import save

        data = await asyncio.to_thread(save, _contiguous_cpu(named))
        answers = await self._post_each(urls, "/update_weights_from_tensor", content=data,
                                        params={"weight_version": version},
                                        headers={"Content-Type": "application/octet-stream"})
        return answers, len(data)


class DistributedSync(WeightSync):
    mode = "distributed"

    def __init__(self, client: RolloutClient, *, backend: str = "gloo", master_address: Optional[str] = None,
                 master_port: Optional[int] = None, timeout_s: float = 300.0):
        super().__init__(client)
        self.backend = backend
        # NOTE: the servers connect to this address; on a cluster it must be reachable from the
        # server nodes (scripts/slurm/train.sbatch exports TRAIN_WEIGHT_SYNC_ADDR / _PORT).
        self.master_address = master_address or os.environ.get("TRAIN_WEIGHT_SYNC_ADDR") or "127.0.0.1"
        env_port = os.environ.get("TRAIN_WEIGHT_SYNC_PORT")
        self.master_port = master_port or (int(env_port) if env_port else None)
        self.timeout_s = timeout_s
        self._group = None
        self._members: tuple[str, ...] = ()
        self._name = ""
        self._generation = 0

    async def _ensure_group(self, urls: tuple[str, ...]) -> None:
        if self._group is not None and self._members == urls:
            return
        await self._destroy(best_effort=True)
        self._generation += 1
        self._name = f"weight-sync-{id(self):x}-{self._generation}"
        port = self.master_port or _free_port()
        # NOTE: every engine process (DP rank) of a server is a member, as every TP worker of an
        # SGLang server: server i's ranks start after the trainer's and those of servers < i
        sizes = await asyncio.gather(*(self._engine_ranks(u) for u in urls))
        offsets = [1 + sum(sizes[:i]) for i in range(len(urls))]
        world = 1 + sum(sizes)
        body = {"master_address": self.master_address, "master_port": port, "world_size": world,
                "group_name": self._name, "backend": self.backend, "timeout_s": self.timeout_s}

        async def join(offset, url):
            return await self._post_each((url,), "/init_weights_update_group", retry=False,
                                         json={**body, "rank_offset": offset})
        joins = asyncio.gather(*(join(o, u) for o, u in zip(offsets, urls)))
        pg_fut = asyncio.to_thread(init_custom_process_group, self.backend,
                                   f"tcp://{self.master_address}:{port}", world, 0, self._name,
                                   datetime.timedelta(seconds=self.timeout_s))
        answers, pg = await asyncio.gather(joins, pg_fut)
        for a in answers:
            for url, ans in a.items():
                if not ans.get("success"):
                    raise RolloutError(f"init_weights_update_group on {url} failed: {ans}")
        self._group, self._members = pg, urls

    async def _engine_ranks(self, url: str) -> int:
        """The server's engine processes (its dp_size in /server_info; 1 when it does not say)."""
        try:
            r = await self.client._http.get(url + "/server_info", headers=self.client._headers(), timeout=30)
            size = r.json().get("dp_size", 1) if r.status_code == 200 else 1
        except (httpx.HTTPError, ValueError, AttributeError):
            size = 1
        return size if isinstance(size, int) and size >= 1 else 1

    async def _push(self, named, version, urls):
        await self._ensure_group(urls)
        named = _contiguous_cpu(named) if self.backend == "gloo" else named
        names = list(named)
        body = {"names": names, "dtypes": [str(named[n].dtype).removeprefix("torch.") for n in names],
                "shapes": [list(named[n].shape) for n in names], "weight_version": version}
        pg = self._group

        def broadcast():
            import torch.distributed as dist
            for n in names:
                dist.broadcast(named[n], src=0, group=pg)
        post = asyncio.ensure_future(self._post_each(urls, "/update_weights_from_distributed", retry=False,
                                                     json=body))
        sent = asyncio.ensure_future(asyncio.to_thread(broadcast))
        try:
            answers, _ = await asyncio.gather(post, sent)
        except BaseException:
            # NOTE: stop waiting for the servers' answers (they wait for the rest of the broken
            # broadcast)
            post.cancel()
            await self._destroy(best_effort=True)
            raise
        return answers, sum(t.numel() * t.element_size() for t in named.values())

    async def _destroy(self, best_effort: bool) -> None:
        if self._group is None:
            return
        pg, members, self._group, self._members = self._group, self._members, None, ()
        alive = [u for u in members if u in self.client.alive_urls]
        if alive:
            try:
                await self._post_each(tuple(alive), "/destroy_weights_update_group", json={"group_name": self._name})
            except RolloutError:
                if not best_effort:
                    raise
        try:
            import torch.distributed as dist
            dist.destroy_process_group(pg)
        except Exception:  # noqa: BLE001 (a broken group is gone either way)
            pass

    async def close(self) -> None:
        await self._destroy(best_effort=True)


def make_weight_sync(mode: str, client: RolloutClient, *, sync_dir: Optional[str] = None,
                     backend: str = "gloo") -> WeightSync:
    if mode == "disk":
        return DiskSync(client, sync_dir)
    if mode == "tensor":
        return TensorSync(client)
    if mode == "distributed":
        return DistributedSync(client, backend=backend)
    raise ValueError(f"weight sync mode must be one of {SYNC_MODES}, got {mode!r}")
