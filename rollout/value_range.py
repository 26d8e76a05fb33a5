"""The allowed values of a setting, and the one ValueError for a value outside them.

Every config of the project (EngineConfig, SamplingParams, ServerArgs, TrainConfig and its
LossConfig) checks its numbers and choices with these functions (check_host_port for an address),
so that every refusal reads the same way, naming the field, what it allows and what it got:

    dp_size must be an integer >= 1, got 0
    top_p must be a number in (0, 1], got 1.5
    mem_fraction_static must be a number in (0, 1] or None, got 0
    dtype must be one of ('auto', 'float32', 'bfloat16', 'float16'), got 'fp8'
    dist_init_addr must be HOST:PORT with a port in [1, 65535], got 'node0'

A bool is never a number here (True is not 1), and a float that is not finite is never in a range.
"""
from __future__ import annotations

import math
from typing import Any, Iterable, Optional


def _fmt(x: float) -> str:
    if isinstance(x, float) and x.is_integer() and abs(x) < 1e15:
        return str(int(x))
    return str(x)


def describe_range(lo: Optional[float] = None, hi: Optional[float] = None, *, integer: bool = False,
                   lo_open: bool = False, hi_open: bool = False, or_none: bool = False) -> str:
    """How a range reads in an error message and in --help: "an integer >= 1", "a number in (0, 1]"."""
    kind = "an integer" if integer else "a number"
    if lo is not None and hi is not None:
        span = f"{kind} in {'(' if lo_open else '['}{_fmt(lo)}, {_fmt(hi)}{')' if hi_open else ']'}"
    elif lo is not None:
        span = f"{kind} {'>' if lo_open else '>='} {_fmt(lo)}"
    elif hi is not None:
        span = f"{kind} {'<' if hi_open else '<='} {_fmt(hi)}"
    else:
        span = kind
    return span + (" or None" if or_none else "")


def in_range(value: Any, lo: Optional[float] = None, hi: Optional[float] = None, *, integer: bool = False,
             lo_open: bool = False, hi_open: bool = False) -> bool:
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        return False
    if isinstance(value, float) and not math.isfinite(value):
        return False
    if lo is not None and (value < lo or (lo_open and value == lo)):
        return False
    return hi is None or not (value > hi or (hi_open and value == hi))


def check_range(name: str, value: Any, lo: Optional[float] = None, hi: Optional[float] = None, *,
                integer: bool = False, lo_open: bool = False, hi_open: bool = False, or_none: bool = False,
                allowed: str = "", why: str = "", error: type[ValueError] = ValueError) -> Any:
    """value when it is a number (an int when `integer`) within [lo, hi] (ends open as asked; None:
    unbounded), or None when `or_none`; else `error` (ValueError) "NAME must be ALLOWED (WHY), got
    VALUE". `allowed` replaces the generated description where the range alone would mislead."""
    if value is None and or_none:
        return value
    if in_range(value, lo, hi, integer=integer, lo_open=lo_open, hi_open=hi_open):
        return value
    text = allowed or describe_range(lo, hi, integer=integer, lo_open=lo_open, hi_open=hi_open, or_none=or_none)
    raise error(f"{name} must be {text}{f' ({why})' if why else ''}, got {value!r}")


def check_choice(name: str, value: Any, choices: Iterable[Any], *, or_none: bool = False, why: str = "",
                 error: type[ValueError] = ValueError) -> Any:
    """value when it is one of `choices` (or None when `or_none`), else `error` "NAME must be one of
    CHOICES (WHY), got VALUE"."""
    choices = tuple(choices)
    if value is None and or_none:
        return value
    # NOTE: True == 1 and 1.0 == 1: a choice must match in type as well as value
    if any(value == c and type(value) is type(c) for c in choices):
        return value
    raise error(f"{name} must be one of {choices}{' or None' if or_none else ''}{f' ({why})' if why else ''}, "
                f"got {value!r}")


def check_host_port(name: str, value: Any, *, error: type[ValueError] = ValueError) -> tuple[str, int]:
    """(host, port) of "HOST:PORT" ("[v6]:PORT" for an IPv6 address), the port in [1, 65535]; else
    `error` "NAME must be HOST:PORT with a port in [1, 65535], got VALUE"."""
    allowed = "HOST:PORT with a port in [1, 65535]"
    if isinstance(value, str) and ":" in value:
        host, _, port = value.rpartition(":")
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
        if host and port.isdigit() and not any(c in host for c in "/ @?#") and in_range(int(port), 1, 65535):
            return host, int(port)
    raise error(f"{name} must be {allowed}, got {value!r}")
