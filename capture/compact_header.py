"""The compact routed-experts format's header: its layout constants, `CompactHeader`, and the
parser that checks a header against the message's length (capture/codec.py encodes and decodes).

base64 of ``header + layer bitmap + payload``, little-endian everywhere::

    offset size  field
    0      4     magic  b"REXC"
    4      1     version (2)
    5      1     payload dtype code (table below)
    6      2     num_layers   (u16)
    8      2     top_k        (u16)
    10     4     rows         (u32)
    14     8     start        (u64) absolute position of row 0 (routed_experts_start_len)
    22     ceil(num_layers / 8)  present-layer bitmap, bit i of byte j = layer 8*j + i
    ...    rows * len(layer_ids) * top_k * itemsize   payload [rows, len(layer_ids), top_k]

The payload dtype is chosen per message, from ``num_experts`` and the carried payload
(the layers in the bitmap only), first rule that applies::

    code  dtype  "none" (-1) stored as   chosen when
    3     uint8  (no sentinel)           num_experts <= 256 and the payload holds no -1
    1     uint8  255                     num_experts <= 255 (payload holds -1)
    2     int16  -1                      otherwise (num_experts <= 32768)

Code 3 is preferred whenever it applies, also for <= 255 experts: in MoE layers every real
token has ``top_k`` valid ids and dense layers are dropped through the bitmap, so the
sentinel is usually not needed, and 256-expert models (DeepSeek-V3) fit one byte per id.
A -1 inside a carried layer (padding rows, an all -1 tensor, an explicit ``layer_ids`` entry
for an all -1 layer) moves a 256-expert message to int16. Decoders must read the code byte:
the same uint8 byte 255 is id 255 under code 3 and "none" under code 1.
``CompactHeader.dtype`` is the payload dtype (uint8 for codes 1 and 3).

Version 1 (codes 1 and 2 only, so 256 experts always went to int16) is rejected on decode.
"""
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
