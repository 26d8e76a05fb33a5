"""The engine's command line, generated from the EngineConfig fields and their Flag metadata
(rollout/config/flag_group.py): the argparse group, the EngineConfig a parsed command line gives,
and the flags that give a config.
"""
from __future__ import annotations

import argparse
from typing import Any

from rollout.config.engine_config import EngineConfig
from rollout.config.flag_group import FlagGroup

GROUP_TITLE = "engine"
ENGINE_FLAGS = FlagGroup(EngineConfig, GROUP_TITLE)


def add_engine_arguments(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """Adds the `engine` argument group: one flag per EngineConfig field (except no_flag ones)."""
    return ENGINE_FLAGS.add_to(parser)


def engine_config_from_args(ns: argparse.Namespace) -> EngineConfig:
    """The EngineConfig of a command line parsed with add_engine_arguments's group; raises
    EngineConfig's ValueError (naming the field) for a bad value."""
    return EngineConfig(**ENGINE_FLAGS.field_values(ns))


def engine_flags(cfg: EngineConfig) -> list[str]:
    """The flags that reproduce cfg: one per field that differs from the default, in field order.
    Raises ValueError naming the field when a no_flag field differs from its default."""
    return ENGINE_FLAGS.flags(cfg)


def engine_cli_values(cfg: EngineConfig) -> dict[str, Any]:
    """cfg's settings keyed as the command line spells them (`disable_prefix_caching`, ...), the
    flat form /server_info lists; no_flag fields are left out."""
    return ENGINE_FLAGS.cli_values(cfg)
