"""ReqToTokenPool: one row of KV slot ids per admitted request (SGLang's req_to_token table).

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
from __future__ import annotations

import torch

from rollout.batch.host_staging import to_device
from rollout.batch.kv_pool import SINK_SLOT

SINK_ROW = 0


class ReqToTokenPool:
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
