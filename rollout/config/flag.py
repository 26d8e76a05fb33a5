"""Flag: how one field of a frozen config (EngineConfig, ServerArgs) is spelled on the command line.

Each field carries one in its metadata (`field(metadata=flag(...))`, or `no_flag(reason)` for a
field that has no flag); rollout/config/flag_group.py builds the argparse group, the config and the
flag list from them. The kind of flag follows the field's default: a bool is a switch (`--name`, or
with `negate` a switch that turns the setting off), a tuple takes zero or more values
(`nargs="*"`), anything else takes one value. Every flag has help text, and `--help` shows its
default after it: `default_text`, else the default itself ("off" for a switch).
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Optional

METADATA_KEY = "flag"
NO_FLAG_KEY = "no_flag"


@dataclass(frozen=True, kw_only=True)
class Flag:
    help: str = ""
    default_text: Optional[str] = None              # how the default reads in --help (needed when it is None)
    type: Optional[Callable[[str], Any]] = None    # of one value; None = the string as given
    choices: Optional[tuple[str, ...]] = None
    name: Optional[str] = None                      # the option; default --<field-name>
    aliases: tuple[str, ...] = ()                   # further spellings (SGLang's, where they differ)
    negate: bool = False                            # bool fields: the switch sets the field to False
    off_aliases: tuple[str, ...] = ()               # bool fields: hidden switches that keep the default (SGLang's opposite switch)
    none_at_most: Optional[int] = None              # int values <= this mean None ...
    none_spelling: Optional[str] = None             # ... and None is written as this value
    hidden: bool = False                            # accepted, left out of --help

    def __post_init__(self) -> None:
        if (self.none_at_most is None) != (self.none_spelling is None):
            raise ValueError("Flag: none_at_most and none_spelling go together")

    # ---- names -----------------------------------------------------------------------------
    def option(self, f: dataclasses.Field) -> str:
        return self.name or "--" + f.name.replace("_", "-")

    def dest(self, f: dataclasses.Field) -> str:
        """The argparse destination, and the key /server_info lists the setting under."""
        return self.option(f).removeprefix("--").replace("-", "_")

    def shown_default(self, f: dataclasses.Field) -> str:
        """The default as --help shows it."""
        if self.default_text is not None:
            return self.default_text
        default = f.default if f.default is not dataclasses.MISSING else None
        if isinstance(default, bool):
            return "off"
        if default is None:
            raise TypeError(f"{f.name}: a flag whose default is None needs default_text (what None means)")
        if isinstance(default, tuple):
            return " ".join(map(str, default)) if default else "none"
        return str(default)

    def help_text(self, f: dataclasses.Field) -> str:
        if self.hidden:
            return argparse.SUPPRESS
        if not self.help:
            raise TypeError(f"{f.name}: a flag needs help text")
        # NOTE: argparse %-formats help strings
        return f"{self.help} (default: {self.shown_default(f)})".replace("%", "%%")

    # ---- argparse ------------------------------------------------------------------------------
    def add_to(self, group: argparse._ArgumentGroup, f: dataclasses.Field) -> None:
        kw: dict[str, Any] = {"dest": self.dest(f), "help": self.help_text(f)}
        options = (self.option(f), *self.aliases)
        if isinstance(f.default, bool):
            if f.default != self.negate:   # a switch moves the setting away from its default
                raise TypeError(f"{f.name}: a default of {f.default} needs negate={not self.negate}")
            group.add_argument(*options, action="store_true", **kw)
            if self.off_aliases:
                group.add_argument(*self.off_aliases, action="store_const", const=False, default=False,
                                   dest=kw["dest"], help=argparse.SUPPRESS)
            return
        kw["default"] = list(f.default) if isinstance(f.default, tuple) else f.default
        if isinstance(f.default, tuple):
            kw["nargs"] = "*"
        if self.type is not None:
            kw["type"] = self.type
        if self.choices is not None:
            kw["choices"] = self.choices
        group.add_argument(*options, **kw)

    # ---- values: command line <-> config ---------------------------------------------------------
    def field_value(self, f: dataclasses.Field, cli_value: Any) -> Any:
        """The config value of a parsed command-line value."""
        if isinstance(f.default, bool):
            return not cli_value if self.negate else cli_value
        if isinstance(f.default, tuple):
            return tuple(cli_value)
        if self.none_at_most is not None and cli_value is not None and cli_value <= self.none_at_most:
            return None
        return cli_value

    def cli_value(self, f: dataclasses.Field, value: Any) -> Any:
        """The parsed command-line value that gives `value` (as /server_info lists it)."""
        return (not value) if isinstance(f.default, bool) and self.negate else value

    def args(self, f: dataclasses.Field, value: Any) -> list[str]:
        """The command-line words that set the field to `value` (which differs from the default)."""
        if isinstance(f.default, bool):
            if value == (not self.negate):
                return [self.option(f)]
        elif isinstance(value, tuple):
            return [self.option(f), *map(str, value)]
        elif value is not None:
            return [self.option(f), str(value)]
        elif self.none_spelling is not None:
            return [self.option(f), self.none_spelling]
        raise ValueError(f"{f.name}={value!r} cannot be written as a {self.option(f)} flag")


def flag(**kw: Any) -> dict[str, Any]:
    """Field metadata: the field's command-line spelling (see Flag)."""
    return {METADATA_KEY: Flag(**kw)}


def no_flag(reason: str) -> dict[str, Any]:
    """Field metadata: the field has no command-line flag, for `reason`."""
    return {NO_FLAG_KEY: reason}


def flag_of(f: dataclasses.Field) -> Optional[Flag]:
    """The field's Flag; None for a no_flag field. A field with neither is a mistake."""
    if NO_FLAG_KEY in f.metadata:
        return None
    if METADATA_KEY not in f.metadata:
        raise TypeError(f"{f.name}: metadata needs flag(...) or no_flag(reason)")
    return f.metadata[METADATA_KEY]
