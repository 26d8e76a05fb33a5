"""Wire codecs for routed-expert ids.

Routing tensor: ``[rows, num_layers, top_k]`` integer, ``-1`` = no routing (dense layers, padding).

Formats (``RoutedExpertsFormat``):

``int32``
    base64 (standard alphabet) of little-endian int32, flat row-major, no header. Byte-identical
    to SGLang's ``meta_info.routed_experts``; clients decode it with
    ``np.frombuffer(base64.b64decode(s), np.int32).reshape(rows, num_layers, top_k)``, so
    decoding needs ``num_layers`` and ``top_k``.

``compact``
    base64 of ``header + layer bitmap + payload`` (layout: capture/compact_header.py). Only the
    layers in ``layer_ids`` (the MoE layers) are carried; every other layer decodes as all -1.
    ``encode_routed_experts(..., layer_ids=None)`` derives the list from the tensor: the layers
    holding any id >= 0, or all layers when there is none (``rows == 0``, or every entry is -1):
    nothing to derive from, and the list is never empty. An explicit ``layer_ids`` must be a
    non-empty set of ids in ``[0, num_layers)``; a layer left out of it must be all -1, else
    ``ValueError`` (never a silent drop). Layers in ``layer_ids`` may still hold -1 entries. The
    payload dtype is chosen per message from ``num_experts`` and the carried payload
    (compact_header.py's table): uint8 without a sentinel when it fits, else with, else int16.

    ``narrowest_dtype(num_experts)`` is a different thing: the dtype that holds every id *plus*
    a sentinel, whatever the data (uint8 up to 255 experts, int16 up to 32768). The host store
    uses it, since it must be able to hold "none" in any slot; the wire format can look at the
    data it carries and drop the sentinel when no entry needs it.

    NOTE: decoding expands dropped layers, so the decoded tensor is up to
    ``4 * num_layers / len(layer_ids)`` times the payload; a non-empty layer list keeps that
    bounded (an empty one would let a 30-byte string claim 2**32 rows).
"""

from __future__ import annotations

import base64
import binascii
import enum
from typing import Iterable, Optional, Union

import numpy as np
import torch

from capture.compact_header import (CODE_I16, CODE_TO_DTYPE, CODE_U8, CODE_U8_NONE, FIXED, MAGIC, NP_DTYPE,
                                    U8_NONE, VERSION, CompactHeader, bitmap_len, parse_header)

__all__ = ["RoutedExpertsFormat", "CompactHeader", "encode_routed_experts", "encode_engine_rows", "ROW_DTYPES",
           "decode_routed_experts", "routed_experts_format_of", "compact_header", "narrowest_dtype"]


class RoutedExpertsFormat(str, enum.Enum):
    """The routing wire formats: the one list every endpoint and client checks against."""

    INT32 = "int32"
    COMPACT = "compact"

    @classmethod
    def parse(cls, fmt: Union[str, "RoutedExpertsFormat"]) -> "RoutedExpertsFormat":
        """The format named by fmt, or ValueError naming the allowed ones."""
        try:
            return cls(fmt)
        except ValueError:
            raise ValueError(f"routed_experts_format must be one of {[f.value for f in cls]}, "
                             f"got {fmt!r}"[:300]) from None


def narrowest_dtype(num_experts: int) -> torch.dtype:
    """Dtype holding ids ``0..num_experts-1`` plus a "none" sentinel, whatever the data.

    uint8 when the ids leave 255 free as the sentinel (``num_experts <= 255``), else int16 with
    -1 as the sentinel (``num_experts <= 32768``). Used by the host store. The compact wire
    format picks its own payload dtype per message and may use uint8 with no sentinel for 256
    experts (see the module docstring).
    """
    if isinstance(num_experts, bool) or not isinstance(num_experts, (int, np.integer)):
        raise ValueError(f"num_experts must be an int, got {num_experts!r}")
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    if num_experts <= 255:
        return torch.uint8
    if num_experts <= 32768:
        return torch.int16
    raise ValueError(
        f"num_experts={num_experts} exceeds 32768, the most int16 holds with a -1 sentinel"
    )


_MAX_U16 = 0xFFFF
_MAX_U32 = 0xFFFFFFFF
_MAX_U64 = 0xFFFFFFFFFFFFFFFF
_I32 = np.iinfo(np.int32)
# the headerless format's element types (encode_engine_rows' dtype), little-endian
ROW_DTYPES = {"int32": "<i4", "int16": "<i2", "uint8": "u1"}


# ---------------------------------------------------------------------------------------- encode


def encode_routed_experts(
    routed_experts: torch.Tensor,
    fmt: Union[str, RoutedExpertsFormat] = "int32",
    *,
    num_experts: Optional[int] = None,
    start: int = 0,
    layer_ids: Optional[Iterable[int]] = None,
) -> str:
    """Encode ``[rows, num_layers, top_k]`` expert ids (-1 = none) to an ASCII base64 str.

    ``num_experts`` is required for ``compact`` (with the carried data, it picks the payload
    dtype) and optional for ``int32`` (ids are range-checked against it when given). ``start``
    and ``layer_ids`` are carried by ``compact`` only; ``int32`` has nowhere to put them and
    ignores them.
    """
    fmt = RoutedExpertsFormat.parse(fmt)
    arr = _as_numpy(routed_experts)  # [rows, num_layers, top_k]
    if fmt is RoutedExpertsFormat.INT32:
        if num_experts is not None:
            _check_positive(num_experts=num_experts)
        _check_ids(arr, num_experts)
        return _b64(np.ascontiguousarray(arr, dtype="<i4"))

    if num_experts is None:
        raise ValueError("num_experts is required for routed_experts_format='compact'")
    narrowest_dtype(num_experts)  # validates num_experts
    _check_ids(arr, num_experts)
    rows, num_layers, top_k = arr.shape
    if rows > _MAX_U32 or num_layers > _MAX_U16 or top_k > _MAX_U16:
        raise ValueError(
            f"routed experts shape {tuple(arr.shape)} too large for the compact header "
            f"(rows <= {_MAX_U32}, num_layers and top_k <= {_MAX_U16})"
        )
    if isinstance(start, bool) or not isinstance(start, (int, np.integer)) or not 0 <= start <= _MAX_U64:
        raise ValueError(f"start (routed_experts_start_len) must be an int >= 0, got {start!r}")

    present = _present_mask(arr, layer_ids)  # [num_layers] bool
    payload = arr if present.all() else arr[:, _layer_index(present), :]  # [rows, n_present, top_k]
    code = _payload_code(payload, int(num_experts))
    # NOTE: under code 1 the uint8 cast wraps -1 to 255, the sentinel; under code 3 there is no
    # -1 and ids are <= 255. Ids are range-checked above.
    payload = np.ascontiguousarray(payload.astype(NP_DTYPE[CODE_TO_DTYPE[code]], copy=False))
    header = FIXED.pack(MAGIC, VERSION, code, num_layers, top_k, rows, int(start))
    bitmap = np.packbits(present, bitorder="little").tobytes()
    return base64.b64encode(header + bitmap + payload.tobytes()).decode("ascii")


def encode_engine_rows(rows: Union[torch.Tensor, np.ndarray], fmt: str = "int32", *, num_experts: int = 0,
                       start: int = 0, layer_ids: Iterable[int] = (), dtype: str = "int32") -> str:
    """The one encoder of routing rows the engine produced, for finished outputs and stream
    chunks alike. ``int32`` skips ``encode_routed_experts``' type and range checks (the ids come
    from the router's top-k, -1 for dense layers, in range by construction): a 1-token stream
    chunk costs ~2 us instead of ~11. ``compact`` is ``encode_routed_experts`` (it needs the
    range scan to choose its payload dtype). dtype: the element type of the headerless format
    (ROW_DTYPES; int16 / uint8 narrow it for clients that decode with that dtype, and uint8 writes
    -1 as 255)."""
    if fmt == "compact":
        return encode_routed_experts(rows, "compact", num_experts=num_experts, start=start,
                                     layer_ids=tuple(layer_ids) or None)
    if fmt != "int32":
        RoutedExpertsFormat.parse(fmt)   # raises, naming the allowed formats
    if dtype not in ROW_DTYPES:
        raise ValueError(f"routed_experts_dtype must be one of {list(ROW_DTYPES)}, got {dtype!r}")
    arr = rows.numpy() if isinstance(rows, torch.Tensor) else rows
    return base64.b64encode(arr.astype(ROW_DTYPES[dtype], copy=False).tobytes()).decode("ascii")


def _payload_code(payload: np.ndarray, num_experts: int) -> int:
    """The module docstring's table: uint8 without sentinel when it fits, else with, else int16."""
    if num_experts > 256:
        return CODE_I16
    if payload.size == 0 or int(payload.min()) >= 0:
        return CODE_U8
    return CODE_U8_NONE if num_experts <= 255 else CODE_I16


def _as_numpy(t) -> np.ndarray:
    if isinstance(t, torch.Tensor):
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise ValueError(f"routed experts must be an integer tensor, got {t.dtype}")
        arr = t.detach().cpu().numpy()
    elif isinstance(t, np.ndarray):
        if t.dtype.kind not in "iu":
            raise ValueError(f"routed experts must be an integer array, got {t.dtype}")
        arr = t
    else:
        raise ValueError(f"routed experts must be a torch.Tensor, got {type(t).__name__}")
    if arr.ndim != 3:
        raise ValueError(
            f"routed experts must have shape [rows, num_layers, top_k], got {tuple(arr.shape)}"
        )
    if arr.shape[1] == 0 or arr.shape[2] == 0:
        raise ValueError(f"routed experts need num_layers >= 1 and top_k >= 1, got {tuple(arr.shape)}")
    return arr


def _check_ids(arr: np.ndarray, num_experts: Optional[int]) -> None:
    hi = int(_I32.max) if num_experts is None else min(int(num_experts) - 1, int(_I32.max))
    if arr.size == 0:
        return
    lo_v, hi_v = int(arr.min()), int(arr.max())
    if lo_v >= -1 and hi_v <= hi:
        return
    bad_v = lo_v if lo_v < -1 else hi_v
    where = tuple(int(i) for i in np.argwhere(arr == bad_v)[0])
    bound = f"num_experts={num_experts}" if num_experts is not None else "int32"
    raise ValueError(
        f"routed expert id {bad_v} at [row, layer, slot]={list(where)} is out of range "
        f"[-1, {hi}] ({bound}; -1 means no routing)"
    )


def _present_mask(arr: np.ndarray, layer_ids: Optional[Iterable[int]]) -> np.ndarray:
    rows, num_layers, _ = arr.shape
    if layer_ids is None:
        mask = (arr >= 0).any(axis=(0, 2)) if rows else np.zeros(num_layers, dtype=bool)
        return mask if mask.any() else np.ones(num_layers, dtype=bool)
    ids = list(layer_ids)
    if not ids:
        raise ValueError("layer_ids must name at least one layer")
    mask = np.zeros(num_layers, dtype=bool)
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or not 0 <= i < num_layers:
            raise ValueError(f"layer_ids entry {i!r} is not a layer id in [0, {num_layers})")
        if mask[i]:
            raise ValueError(f"layer_ids has layer {i} twice")
        mask[i] = True
    if rows and not mask.all():
        routed = (arr[:, ~mask, :] >= 0).any(axis=(0, 2))
        if routed.any():
            dropped = np.flatnonzero(~mask)[routed].tolist()
            raise ValueError(
                f"layers {dropped} hold expert ids but are not in layer_ids; "
                "only all -1 (dense) layers may be left out"
            )
    return mask


def _layer_index(mask: np.ndarray) -> Union[slice, np.ndarray]:
    ids = np.flatnonzero(mask)
    if len(ids) and ids[-1] - ids[0] + 1 == len(ids):
        return slice(int(ids[0]), int(ids[-1]) + 1)  # a view, not a gather copy
    return ids


def _b64(arr: np.ndarray) -> str:
    return base64.b64encode(arr.reshape(-1).view(np.uint8)).decode("ascii")


# ---------------------------------------------------------------------------------------- decode

_COMPACT_B64 = base64.b64encode(MAGIC).decode("ascii")[:5]  # "UkVYQ": the 5 characters fixed by b"REXC"


def routed_experts_format_of(s: Union[str, bytes]) -> RoutedExpertsFormat:
    """The format of a ``routed_experts`` payload, by its content: ``compact`` when it starts with
    the compact magic, else ``int32`` (a server that ignores ``routed_experts_format``, as SGLang
    does, answers int32)."""
    if isinstance(s, (bytes, bytearray, memoryview)):
        s = bytes(s[:5]).decode("ascii", "replace")
    compact = isinstance(s, str) and s.startswith(_COMPACT_B64)
    return RoutedExpertsFormat.COMPACT if compact else RoutedExpertsFormat.INT32


def decode_routed_experts(
    s: Union[str, bytes],
    fmt: Union[str, RoutedExpertsFormat, None] = None,
    *,
    num_layers: Optional[int] = None,
    top_k: Optional[int] = None,
) -> torch.Tensor:
    """Decode to a ``torch.int32`` tensor ``[rows, num_layers, top_k]`` with -1 restored.

    ``fmt=None`` (the default) reads the format from the payload: ``compact`` when it starts with
    the compact magic (``b"REXC"``, base64 ``"UkVYQ"``; as int32 that is id 1,129,858,386, never an
    expert id), else ``int32``. A ``compact`` payload carries its shape in its header, so
    ``decode_routed_experts(payload)`` needs nothing else; ``num_layers`` and ``top_k``, when
    given, must match it. ``int32`` has no header: it needs ``num_layers`` and ``top_k``
    (``/model_info``'s ``num_hidden_layers`` and ``num_experts_per_tok``); the rows follow from
    the length (``prompt_tokens + completion_tokens - 1 - routed_experts_start_len``).
    """
    if fmt is None:
        fmt = routed_experts_format_of(s)
    fmt = RoutedExpertsFormat.parse(fmt)
    raw = _unb64(s)
    if fmt is RoutedExpertsFormat.INT32:
        if num_layers is None or top_k is None:
            hint = (" (this payload starts with the compact magic: decode it with fmt='compact' or fmt=None)"
                    if raw[:len(MAGIC)] == MAGIC else "")
            raise ValueError("decoding routed_experts_format='int32' needs num_layers and top_k "
                             "(/model_info's num_hidden_layers and num_experts_per_tok)" + hint)
        _check_positive(num_layers=num_layers, top_k=top_k)
        row_bytes = 4 * num_layers * top_k
        if len(raw) % row_bytes:
            raise ValueError(
                f"int32 routed experts: {len(raw)} bytes is not a multiple of "
                f"4 * num_layers * top_k = {row_bytes}"
            )
        out = np.frombuffer(raw, dtype="<i4").astype(np.int32)  # copy: writable, native order
        return torch.from_numpy(out.reshape(-1, num_layers, top_k))

    info, code = parse_header(raw, len(raw))
    for name, want, got in (("num_layers", num_layers, info.num_layers), ("top_k", top_k, info.top_k)):
        if want is not None and want != got:
            raise ValueError(f"compact routed experts carry {name}={got}, caller expected {want}")
    n_present = len(info.layer_ids)
    payload = np.frombuffer(
        raw, dtype=NP_DTYPE[info.dtype], count=info.rows * n_present * info.top_k,
        offset=info.header_bytes,
    )
    payload = payload.reshape(info.rows, n_present, info.top_k)  # [rows, n_present, top_k]
    vals = payload.astype(np.int32)
    if code == CODE_U8_NONE:
        vals[payload == U8_NONE] = -1
    elif vals.size and int(vals.min()) < -1:
        raise ValueError(f"compact routed experts: int16 payload holds id {int(vals.min())} < -1")
    if n_present == info.num_layers:
        out = vals
    else:
        present = np.zeros(info.num_layers, dtype=bool)
        present[list(info.layer_ids)] = True
        out = np.empty((info.rows, info.num_layers, info.top_k), dtype=np.int32)
        out[:, _layer_index(~present), :] = -1
        out[:, _layer_index(present), :] = vals
    return torch.from_numpy(out)


def compact_header(s: Union[str, bytes]) -> CompactHeader:
    """Parse a compact string's header, decoding only its first bytes.

    The total length is checked from the base64 length; the payload's characters are not
    validated here (``decode_routed_experts`` does that).
    """
    if isinstance(s, (bytes, bytearray, memoryview)):
        try:
            s = bytes(s).decode("ascii")
        except UnicodeDecodeError:
            raise ValueError("routed experts must be ASCII base64") from None
    if not isinstance(s, str):
        raise ValueError(f"routed experts must be a base64 str, got {type(s).__name__}")
    n = len(s)
    if n % 4:
        raise ValueError(f"routed experts base64 length {n} is not a multiple of 4")
    total = n // 4 * 3 - (2 if s.endswith("==") else 1 if s.endswith("=") else 0)
    fixed_chars = -(-FIXED.size // 3) * 4
    head = _unb64(s[:fixed_chars])
    if len(head) < FIXED.size:
        parse_header(head, total)  # raises: truncated
    n_bitmap = bitmap_len(FIXED.unpack_from(head)[3])
    need = FIXED.size + n_bitmap
    return parse_header(_unb64(s[: -(-need // 3) * 4]), total)[0]


def _unb64(s: Union[str, bytes]) -> bytes:
    if isinstance(s, str):
        try:
            s = s.encode("ascii")
        except UnicodeEncodeError:
            raise ValueError("routed experts must be ASCII base64") from None
    elif not isinstance(s, (bytes, bytearray, memoryview)):
        raise ValueError(f"routed experts must be a base64 str, got {type(s).__name__}")
    try:
        return base64.b64decode(s, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"routed experts are not valid base64: {e}") from None


def _check_positive(**kw: int) -> None:
    for name, v in kw.items():
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
