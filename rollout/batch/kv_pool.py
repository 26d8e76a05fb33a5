"""KVPool: per-layer key/value tensors over a pool of token slots, with a slot allocator; and
ReqToTokenPool, the table of each admitted request's KV slots by position."""
from __future__ import annotations

import torch

from rollout.batch.host_device import to_device
from rollout.host_malloc import zero_lazily

SINK_SLOT = 0  # NOTE: slot 0 is never allocated; padding tokens write their KV there.


def _zeros(shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # NOTE: on CPU without writing it: pages are faulted in where slots are first used
    # (rollout/host_malloc.py; 2026-12-05: the 512 MiB default pool's startup 3 s -> 3 ms)
    return zero_lazily(torch.empty(shape, dtype=dtype, device=device))


class KVPool:
    """Token-slot KV memory. Slot 0 is the sink; slots 1..num_slots are allocatable.

    Two layouts: GQA (per layer [slots, 2, kvH, D], key and value side by side) or, with
    latent_dim > 0, MLA (per layer [slots, latent_dim]: the compressed latent then the rope key).
    With hidden_size > 0 each slot also holds the final-normed hidden state its forward computed
    (`hidden` [slots, hidden_size]): the input of the checkpoint's MTP layers (NEXTN drafts). A
    slot's hidden state is written by the forward that writes its KV, so it is valid exactly as
    long as the KV is, prefix-cache hits included.
    """

    def __init__(self, *, num_slots: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: str | torch.device = "cpu", latent_dim: int = 0,
                 hidden_size: int = 0):
        if num_slots <= 0:
            raise ValueError(f"num_slots must be > 0, got {num_slots}")
        self.num_slots = num_slots
        self.num_layers = num_layers
        self.dtype = dtype
        self.device = torch.device(device)
        # NOTE: a slot's key and value sit side by side ([slots, 2, kvH, D] per layer): attention
        # gathers both with one index_select (about a third faster on CPU than two gathers).
        self.latent_dim = latent_dim
        shape = (num_slots + 1, latent_dim) if latent_dim else (num_slots + 1, 2, num_kv_heads, head_dim)
        self.kv_buffers = [_zeros(shape, dtype, self.device) for _ in range(num_layers)]
        if not latent_dim:
            self.k_buffers = [kv[:, 0] for kv in self.kv_buffers]   # views [slots, kvH, D]
            self.v_buffers = [kv[:, 1] for kv in self.kv_buffers]
        self.hidden = _zeros((num_slots + 1, hidden_size), dtype, self.device) if hidden_size else None
        self._free = list(range(num_slots, 0, -1))  # pop() hands out low slots first

    @staticmethod
    def bytes_per_slot(*, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                       latent_dim: int = 0, hidden_size: int = 0) -> int:
        per_layer = latent_dim or 2 * num_kv_heads * head_dim
        return (num_layers * per_layer + hidden_size) * torch.empty((), dtype=dtype).element_size()

    def available(self) -> int:
        return len(self._free)

    def used(self) -> int:
        return self.num_slots - len(self._free)

    def alloc(self, n: int) -> torch.Tensor | None:
        """n free slots as an int64 tensor, or None (nothing taken) when fewer are free."""
        if n > len(self._free):
            return None
        if n == 0:
            return torch.empty(0, dtype=torch.int64)
        taken = self._free[-n:]
        del self._free[-n:]
        return torch.tensor(taken[::-1], dtype=torch.int64)

    def free(self, slots: torch.Tensor | list[int]) -> None:
        values = slots.tolist() if isinstance(slots, torch.Tensor) else list(slots)
        assert SINK_SLOT not in values, "the sink slot is never freed"
        self._free.extend(values)

    def write(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [num_tokens, num_kv_heads, head_dim] written at slots [num_tokens]."""
        # NOTE: padding tokens all write the sink slot: whichever wins, it holds finite values
        self.k_buffers[layer_id].index_copy_(0, slots, k.to(self.dtype))
        self.v_buffers[layer_id].index_copy_(0, slots, v.to(self.dtype))

    def write_latent(self, layer_id: int, slots: torch.Tensor, latent: torch.Tensor) -> None:
        """MLA layout: latent [num_tokens, latent_dim] written at slots [num_tokens]."""
        self.kv_buffers[layer_id].index_copy_(0, slots, latent.to(self.dtype))

    def write_hidden(self, slots: torch.Tensor, hidden: torch.Tensor) -> None:
        """Final-normed hidden states [num_tokens, hidden_size] written at slots [num_tokens]."""
        assert hidden.shape[0] == slots.shape[0], (hidden.shape, slots.shape)
        self.hidden.index_copy_(0, slots, hidden.to(self.dtype))

    def check_integrity(self) -> None:
        free = self._free
        assert len(free) == len(set(free)), "a slot is on the free list twice"
        assert all(1 <= s <= self.num_slots for s in free), "a free slot is out of range"
        assert len(free) + self.used() == self.num_slots


SINK_ROW = 0


class ReqToTokenPool:
    """One row of KV slot ids per admitted request (SGLang's req_to_token table).

    Row r, cell p holds the KV slot of position p of the request that owns row r. The scheduler
    appends a whole decode step's new slots with one tensor write and reads a batch's KV indices
    with one gather, instead of growing and padding one slot tensor per request. Row 0 is never
    handed out and stays all SINK_SLOT: padding requests of static-shape runners read it.

    Cells beyond a request's KV length may hold stale slot ids from the row's previous owner; every
    reader masks them (attention) or slices them off (kv_slots), and any slot id reads finite KV.
    int32 cells, as in SGLang: 1024 rows of a 128k context take 512 MiB.

    The table lives on the engine's device (`device_table`), written with index writes as slots are
    assigned, and a batch's KV indices are one device gather (no [B, max_seq] table on the host per
    step). On a GPU a host copy (`table`) is kept too, written alongside: the scheduler's own reads
    (a request's slots when it finishes, is cached or retracted, its routing rows) never wait on the
    device. On CPU the two are one tensor.
    """

    def __init__(self, *, num_rows: int, width: int, device: torch.device | str = "cpu"):
        if num_rows <= 0 or width <= 0:
            raise ValueError(f"num_rows and width must be > 0, got {num_rows} and {width}")
        self.num_rows = num_rows
        self.width = width
        self.device = torch.device(device)
        self.table = torch.full((num_rows + 1, width), SINK_SLOT, dtype=torch.int32)   # host memory
        self.device_table = self.table if self.device.type == "cpu" else self.table.to(self.device)
        self._free = list(range(num_rows, 0, -1))  # pop() hands out low rows first

    def alloc(self) -> int:
        if not self._free:
            raise RuntimeError(f"all {self.num_rows} request rows are in use (max_running_requests)")
        return self._free.pop()

    def free(self, row: int) -> None:
        assert row != SINK_ROW, "the sink row is never freed"
        self._free.append(row)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        """Positions start .. start+len(slots)-1 of the row's request live at these slots."""
        n = slots.numel()
        if n:
            cells = slots.to(torch.int32)
            self.table[row, start:start + n] = cells
            if self.device_table is not self.table:
                self.device_table[row, start:start + n].copy_(to_device(cells, self.device), non_blocking=True)

    def append_one(self, rows: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """One new slot per request (a decode step): table[rows[i], positions[i]] = slots[i]."""
        cells = slots.to(torch.int32)
        self.table.index_put_((rows, positions), cells)
        if self.device_table is not self.table:
            dev = self.device
            self.device_table.index_put_((to_device(rows, dev), to_device(positions, dev)), to_device(cells, dev))

    def slots(self, row: int, length: int) -> torch.Tensor:
        """The row's first `length` slots as a fresh int64 tensor (never a view of the table)."""
        return self.table[row, :length].to(torch.int64)

    def gather(self, rows: torch.Tensor, width: int) -> torch.Tensor:
        """[len(rows), width] int64 KV indices of these rows (stale cells past each length), on the
        device: one gather there."""
        return self.device_table[:, :width].index_select(0, to_device(rows, self.device)).to(torch.int64)

    def check_integrity(self, held_rows: list[int]) -> None:
        assert len(held_rows) == len(set(held_rows)), "a request row is held twice"
        assert not set(held_rows) & set(self._free), "a held request row is on the free list"
        assert len(held_rows) + len(self._free) == self.num_rows, (
            f"request row leak: {len(held_rows)} held + {len(self._free)} free != {self.num_rows}")
        assert bool((self.table[SINK_ROW] == SINK_SLOT).all()), "the sink row was written"
        assert torch.equal(self.device_table.cpu(), self.table), "the device table and its host copy differ"
