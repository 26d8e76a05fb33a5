"""Routed experts on the wire: the formats a request may ask for and the rows' encoding in them
(capture/codec.py)."""
from __future__ import annotations

from typing import Any

from rollout.server.responses import ApiError

ROUTING_FORMATS = ("int32", "compact")


def check_routing_format(value: Any, param: str = "routed_experts_format") -> str:
    if value is None:
        return "int32"
    if value not in ROUTING_FORMATS:
        raise ApiError(400, f"{param} must be one of {list(ROUTING_FORMATS)}, got {value!r}"[:300], param=param)
    return value


def encode_rows(rows: Any, fmt: str, start: int, info: Any, dtype: str = "int32") -> str:
    """A stream chunk's rows; finished outputs go through RolloutOutput.meta_info, and both through
    capture.codec.encode_engine_rows."""
    from capture.codec import encode_engine_rows  # noqa: PLC0415

    return encode_engine_rows(rows, fmt, num_experts=info.num_experts, start=start, layer_ids=info.moe_layer_ids,
                              dtype=dtype)
