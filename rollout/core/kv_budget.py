"""KVBudget: the bytes one engine rank gives its KV cache.

`kv_cache_bytes` when set (default 512 MiB); with SGLang's `mem_fraction_static` instead, that share
of the memory free when the engine starts (the GPU's; on CPU the host's available memory, split
evenly among the DP ranks, which share it), less the model's weights. The free memory is measured
before the model loads and the weights counted after, as SGLang sizes its pool.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch

from rollout.config.engine_config import DEFAULT_KV_CACHE_BYTES, EngineConfig

_MEMINFO = "/proc/meminfo"


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def host_available_bytes() -> int:
    """MemAvailable (Linux); else the physical memory (os.sysconf)."""
    try:
        with open(_MEMINFO) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def free_memory_bytes(device: torch.device, ranks_on_host: int) -> int:
    """The memory this rank may count as free: the GPU's free memory, or its share of the host's
    (among the DP ranks of its node)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    return host_available_bytes() // ranks_on_host


@dataclass(frozen=True)
class KVBudget:
    device: str
    kv_cache_bytes: int                      # the fixed size, when mem_fraction_static is unset
    mem_fraction_static: Optional[float] = None
    free_at_start: int = 0                   # bytes free before the model loaded (mem_fraction_static)

    @classmethod
    def before_load(cls, cfg: EngineConfig, device: torch.device) -> "KVBudget":
        """Measured before the model loads (the weights are counted after: bytes_after_load)."""
        if cfg.mem_fraction_static is None:
            return cls(str(device), cfg.kv_cache_bytes or DEFAULT_KV_CACHE_BYTES)
        return cls(str(device), 0, cfg.mem_fraction_static, free_memory_bytes(device, cfg.local_dp_size))

    def bytes_after_load(self, model: torch.nn.Module, bytes_per_slot: int) -> int:
        """The KV cache's bytes, given the loaded model; ValueError naming mem_fraction_static when its
        share of the free memory does not leave room for two KV slots beside the weights."""
        if self.mem_fraction_static is None:
            return self.kv_cache_bytes
        weights = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
        share = int(self.mem_fraction_static * self.free_at_start)
        if share - weights < 2 * bytes_per_slot:
            raise ValueError(f"mem_fraction_static={self.mem_fraction_static}: that share of the "
                             f"{_gib(self.free_at_start)} free on {self.device} at startup is {_gib(share)}, which "
                             f"leaves no room for a KV cache beside the model's {_gib(weights)} of weights; raise it "
                             f"or size the cache with --kv-cache-bytes or --max-total-tokens")
        return share - weights
