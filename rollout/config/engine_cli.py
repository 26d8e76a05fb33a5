"""The engine's command line, generated from the EngineConfig fields and their Flag metadata:
the argparse group, the EngineConfig a parsed command line gives, and the flags that give a config.
"""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from rollout.config.engine_config import EngineConfig
from rollout.config.flag import Flag, flag_of

GROUP_TITLE = "engine"


def _flagged() -> list[tuple[dataclasses.Field, Flag]]:
    out = []
    for f in dataclasses.fields(EngineConfig):
        fl = flag_of(f)
        if fl is not None:
            out.append((f, fl))
    return out


def add_engine_arguments(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """Adds the `engine` argument group: one flag per EngineConfig field (except no_flag ones)."""
    group = parser.add_argument_group(GROUP_TITLE)
    for f, fl in _flagged():
        fl.add_to(group, f)
    return group


def engine_config_from_args(ns: argparse.Namespace) -> EngineConfig:
    """The EngineConfig of a command line parsed with add_engine_arguments's group; raises
    EngineConfig's ValueError (naming the field) for a bad value."""
    return EngineConfig(**{f.name: fl.field_value(f, getattr(ns, fl.dest(f))) for f, fl in _flagged()})


def engine_flags(cfg: EngineConfig) -> list[str]:
    """The flags that reproduce cfg: one per field that differs from the default, in field order.
    Raises ValueError naming the field when a no_flag field differs from its default."""
    default = EngineConfig()
    out: list[str] = []
    for f in dataclasses.fields(EngineConfig):
        value = getattr(cfg, f.name)
        if value == getattr(default, f.name):
            continue
        fl = flag_of(f)
        if fl is None:
            raise ValueError(f"{f.name}: has no rollout-serve flag")
        out += fl.args(f, value)
    return out


def engine_cli_values(cfg: EngineConfig) -> dict[str, Any]:
    """cfg's settings keyed as the command line spells them (`disable_prefix_caching`, ...), the
    flat form /server_info lists; no_flag fields are left out."""
    return {fl.dest(f): fl.cli_value(f, getattr(cfg, f.name)) for f, fl in _flagged()}
