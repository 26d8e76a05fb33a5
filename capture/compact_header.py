"""The compact routed-experts format's header (capture/codec.py describes the whole format):
its layout constants, `CompactHeader`, and the parser that checks a header against the
message's length."""
from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import torch

MAGIC = b"REXC"
VERSION = 2
FIXED = struct.Struct("<4sBBHHIQ")  # magic, version, dtype code, num_layers, top_k, rows, start
CODE_U8_NONE = 1  # uint8, 255 = none
CODE_I16 = 2  # int16, -1 = none
CODE_U8 = 3  # uint8, no sentinel: ids 0..255
CODE_TO_DTYPE = {CODE_U8_NONE: torch.uint8, CODE_I16: torch.int16, CODE_U8: torch.uint8}
NP_DTYPE = {torch.uint8: np.dtype("u1"), torch.int16: np.dtype("<i2")}
U8_NONE = 255


@dataclass(frozen=True)
class CompactHeader:
    rows: int
    num_layers: int
    top_k: int
    dtype: torch.dtype
    layer_ids: tuple[int, ...]
    start: int

    @property
    def header_bytes(self) -> int:
        return FIXED.size + bitmap_len(self.num_layers)

    @property
    def payload_bytes(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return self.rows * len(self.layer_ids) * self.top_k * itemsize


def bitmap_len(num_layers: int) -> int:
    return (num_layers + 7) // 8


def parse_header(raw: bytes, total: int) -> tuple[CompactHeader, int]:
    """(header, payload dtype code) of raw, the first bytes of a message of `total` bytes."""
    if len(raw) < FIXED.size:
        raise ValueError(
            f"compact routed experts: {len(raw)} bytes is shorter than the {FIXED.size}-byte header"
        )
    magic, version, code, num_layers, top_k, rows, start = FIXED.unpack_from(raw)
    if magic != MAGIC:
        raise ValueError(f"compact routed experts: bad magic {magic!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise ValueError(f"compact routed experts: unsupported version {version}, expected {VERSION}")
    if code not in CODE_TO_DTYPE:
        raise ValueError(f"compact routed experts: unknown payload dtype code {code}")
    if num_layers == 0 or top_k == 0:
        raise ValueError(f"compact routed experts: num_layers={num_layers}, top_k={top_k} must be >= 1")
    n_bitmap = bitmap_len(num_layers)
    if len(raw) < FIXED.size + n_bitmap:
        raise ValueError("compact routed experts: truncated layer bitmap")
    bits = np.unpackbits(
        np.frombuffer(raw, dtype=np.uint8, count=n_bitmap, offset=FIXED.size), bitorder="little"
    )
    if bits[num_layers:].any():
        raise ValueError("compact routed experts: layer bitmap has bits past num_layers")
    if not bits.any():
        raise ValueError("compact routed experts: layer bitmap names no layer")
    info = CompactHeader(
        rows=rows,
        num_layers=num_layers,
        top_k=top_k,
        dtype=CODE_TO_DTYPE[code],
        layer_ids=tuple(np.flatnonzero(bits[:num_layers]).tolist()),
        start=start,
    )
    expected = info.header_bytes + info.payload_bytes
    if total != expected:
        raise ValueError(
            f"compact routed experts: {total} bytes, header says {expected} "
            f"(rows={rows}, {len(info.layer_ids)} of {num_layers} layers, top_k={top_k}, {info.dtype})"
        )
    return info, code
