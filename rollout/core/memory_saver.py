"""MemorySaver: SGLang's release/resume_memory_occupation for a colocated trainer, on one EngineCore.

`release({"kv_cache"})` flushes the prefix cache and frees the KV pool's storage; `release({"weights"})`
writes the weights to a private temporary safetensors file and frees their storage. The tensor
objects stay (their storage is resized to 0 bytes), so every reference the runners hold stays valid;
`resume` gives the storage back (KV zeroed, weights read back). A weight push needs the weights
resumed first, so the weights after resume are the latest pushed. Refused while requests hold KV,
and with CUDA graphs (a replay would read freed memory).
"""
from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any, Iterable, Optional

import torch

from rollout.host_malloc import zero_lazily
from rollout.ipc.control_values import MEMORY_TAGS as TAGS


def _unique_storages(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    seen, out = set(), []
    for t in tensors:
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            out.append(t)
    return out


class MemorySaver:
    def __init__(self, core: Any):
        self.core = core
        self._held: dict[str, list[tuple[torch.Tensor, int]]] = {}   # tag -> (tensor, storage bytes)
        self._dir: Optional[str] = None

    @property
    def released(self) -> tuple[str, ...]:
        return tuple(t for t in TAGS if t in self._held)

    def _tensors(self, tag: str) -> list[torch.Tensor]:
        """The tag's tensors: the KV pool's (hidden states included) or the weights, and the
        drafter's (speculative decoding: its KV, its own weights)."""
        drafter = self.core.scheduler.drafter
        extra = drafter.memory(tag) if drafter is not None else []
        if tag == "kv_cache":
            pool = self.core.kv_pool
            return list(pool.kv_buffers) + ([pool.hidden] if pool.hidden is not None else []) + extra
        return _unique_storages([*(p.data for p in self.core.model.parameters()), *extra])

    def release(self, tags: tuple[str, ...]) -> list[str]:
        core = self.core
        if core.scheduler.running:
            raise ValueError("release_memory_occupation: requests hold KV; pause generation (abort or retract) "
                             "or wait until they finish")
        runners = core.runner.runners.values()
        if any(getattr(r, "backend", None) is not None and r.backend.uses_graphs for r in runners):
            raise ValueError("release_memory_occupation is not supported with CUDA graphs (their replays read "
                             "the released memory)")
        done = []
        for tag in tags:
            if tag in self._held:
                continue
            tensors = self._tensors(tag)
            if tag == "kv_cache":
                flushed = core.cache.flush()
                assert flushed, "prefix cache locked with no running request"
            else:
                self._backup_weights(tensors)
            held = []
            for t in tensors:
                storage = t.untyped_storage()
                held.append((t, storage.nbytes()))
                storage.resize_(0)
            self._held[tag] = held
            done.append(tag)
        if core.device.type == "cuda":
            torch.cuda.empty_cache()
        return done

    def resume(self, tags: tuple[str, ...]) -> list[str]:
        done = []
        for tag in tags:
            held = self._held.pop(tag, None)
            if held is None:
                continue
            for t, nbytes in held:
                t.untyped_storage().resize_(nbytes)
                if tag == "kv_cache":
                    zero_lazily(t)
            if tag == "weights":
                self._restore_weights([t for t, _ in held])
            done.append(tag)
        return done

    def discard(self) -> None:
        """The engine is closing: the weights file goes (nothing reads it again)."""
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def _backup_weights(self, tensors: list[torch.Tensor]) -> None:
        from safetensors.torch import save_file  # noqa: PLC0415

        self._dir = tempfile.mkdtemp(prefix=f"rollout-weights-{os.getpid()}-")
        save_file({f"t{i}": t.detach().cpu().contiguous() for i, t in enumerate(tensors)},
                  os.path.join(self._dir, "weights.safetensors"))

    def _restore_weights(self, tensors: list[torch.Tensor]) -> None:
        from safetensors.torch import load_file  # noqa: PLC0415

        assert self._dir is not None
        saved = load_file(os.path.join(self._dir, "weights.safetensors"))
        for i, t in enumerate(tensors):
            t.copy_(saved[f"t{i}"])
        shutil.rmtree(self._dir, ignore_errors=True)
        self._dir = None
