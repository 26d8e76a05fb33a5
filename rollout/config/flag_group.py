"""FlagGroup: the command line of a frozen config dataclass, generated from its fields' Flag metadata
(rollout/config/flag.py): the argparse group, the field values a parsed command line gives, the
flags that reproduce a config, and its settings keyed as the command line spells them.

EngineConfig's group is `engine` (rollout/config/engine_cli.py), ServerArgs' own fields are `server`
(rollout/server/args.py); `rollout-serve --help` is the two together.
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from rollout.config.flag import Flag, flag_of


@dataclass(frozen=True)
class FlagGroup:
    config_cls: type
    title: str
    description: Optional[str] = None

    def flagged(self) -> list[tuple[dataclasses.Field, Flag]]:
        """(field, Flag) of every field that has a flag, in field order."""
        out = []
        for f in dataclasses.fields(self.config_cls):
            fl = flag_of(f)
            if fl is not None:
                out.append((f, fl))
        return out

    def add_to(self, parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
        """Adds the argument group: one flag per field (except no_flag ones)."""
        group = parser.add_argument_group(self.title, self.description)
        for f, fl in self.flagged():
            fl.add_to(group, f)
        return group

    def field_values(self, ns: argparse.Namespace) -> dict[str, Any]:
        """field name -> value, of a command line parsed with this group."""
        return {f.name: fl.field_value(f, getattr(ns, fl.dest(f))) for f, fl in self.flagged()}

    def flags(self, cfg: Any) -> list[str]:
        """The flags that reproduce cfg: one per field that differs from the default, in field order.
        Raises ValueError naming the field when a no_flag field differs from its default."""
        default = self.config_cls()
        out: list[str] = []
        for f in dataclasses.fields(self.config_cls):
            value = getattr(cfg, f.name)
            if value == getattr(default, f.name):
                continue
            fl = flag_of(f)
            if fl is None:
                raise ValueError(f"{f.name}: has no rollout-serve flag")
            out += fl.args(f, value)
        return out

    def cli_values(self, cfg: Any) -> dict[str, Any]:
        """cfg's settings keyed as the command line spells them (`disable_prefix_caching`, ...), as
        argparse holds them after parsing; no_flag fields are left out."""
        return {fl.dest(f): fl.cli_value(f, getattr(cfg, f.name)) for f, fl in self.flagged()}
