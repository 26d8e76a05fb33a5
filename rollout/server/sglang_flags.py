"""SGLangFlag: an SGLang server flag that names no setting of this server, accepted where it means
here what it means to SGLang and refused by name otherwise, with the reason and what to use instead
(so that an SGLang command line either starts as it would there or says in one line what differs).

SGLang's names for settings this server has are those settings' own flags or their aliases
(EngineConfig's Flag metadata: --disable-radix-cache, --data-parallel-size, --random-seed,
--mem-fraction-static, ...); the ones here have no setting behind them.
"""
from __future__ import annotations

import argparse
import textwrap
from dataclasses import dataclass
from typing import Any, Callable, NoReturn, Optional

from rollout.config.engine_config import EngineConfig

GROUP_TITLE = "SGLang's flags"


@dataclass(frozen=True, kw_only=True)
class SGLangFlag:
    options: tuple[str, ...]                     # SGLang's spellings, its main one first
    type: Optional[Callable[[str], Any]] = None  # None: a switch
    nargs: Optional[str] = None
    accepts: Callable[[Any, EngineConfig], bool]
    refusal: str                                 # why not, and what to use; {dp_size} is filled in
    help: str = ""                               # "" = refused whatever the value: left out of --help
    default_text: str = ""

    @property
    def dest(self) -> str:
        return "sglang_" + self.options[0].removeprefix("--").replace("-", "_")

    def add_to(self, group: argparse._ArgumentGroup) -> None:
        shown = f"{self.help} (default: {self.default_text})" if self.help else argparse.SUPPRESS
        if self.type is None:
            group.add_argument(*self.options, dest=self.dest, action="store_true", default=None, help=shown)
        else:
            group.add_argument(*self.options, dest=self.dest, type=self.type, nargs=self.nargs, default=None,
                               help=shown, metavar=self.dest.removeprefix("sglang_").upper())

    def refused(self, ns: argparse.Namespace, engine: EngineConfig) -> Optional[str]:
        """The one-line refusal of the value given, or None (not given, or accepted)."""
        value = getattr(ns, self.dest)
        if value is None or self.accepts(value, engine):
            return None
        words = value if isinstance(value, list) else [] if self.type is None else [value]
        given = " ".join([self.options[0], *map(str, words)])
        return f"{given}: {self.refusal.format(dp_size=engine.dp_size)}"


def _never(value: Any, engine: EngineConfig) -> bool:
    return False


def _always(value: Any, engine: EngineConfig) -> bool:
    return True


SGLANG_FLAGS: tuple[SGLangFlag, ...] = (
    SGLangFlag(options=("--tp-size", "--tensor-parallel-size"), type=int, accepts=lambda v, e: v == 1,
               refusal="tensor parallelism is not supported; use --dp-size (data-parallel ranks, the experts "
                       "sharded among them)",
               help="1 only: tensor parallelism is not supported; use --dp-size", default_text="1"),
    SGLangFlag(options=("--pp-size", "--pipeline-parallel-size"), type=int, accepts=lambda v, e: v == 1,
               refusal="pipeline parallelism is not supported; use --dp-size",
               help="1 only: pipeline parallelism is not supported; use --dp-size", default_text="1"),
    SGLangFlag(options=("--ep-size", "--expert-parallel-size", "--ep"), type=int,
               accepts=lambda v, e: v == e.dp_size,
               refusal="the experts are sharded over the data-parallel ranks: the expert-parallel size is "
                       "--dp-size ({dp_size}); set --dp-size instead",
               help="must equal --dp-size: the experts are sharded over the data-parallel ranks",
               default_text="--dp-size"),
    SGLangFlag(options=("--enable-dp-attention",), accepts=_always, refusal="",
               help="accepted, no effect: with --dp-size > 1 every rank runs its own attention (DP attention) and "
                    "holds a share of the experts", default_text="off"),
    SGLangFlag(options=("--trust-remote-code",), accepts=_always, refusal="",
               help="accepted, no effect: the engine runs its own model code and reads tokenizer.json, never "
                    "code from a checkpoint", default_text="off"),
    SGLangFlag(options=("--skip-server-warmup",), accepts=_always, refusal="",
               help="accepted, no effect: the server sends itself no warmup request", default_text="off"),
    SGLangFlag(options=("--kv-cache-dtype",), type=str, accepts=lambda v, e: v == "auto",
               refusal="the KV cache holds the model's dtype; use --dtype",
               help="auto only: the KV cache holds the model's dtype (--dtype)", default_text="auto"),
    # NOTE: SGLang's scheduler has not read it since its overlap scheduler replaced the loop that
    # ran N decode steps between looks at the queue; launch scripts still pass it
    SGLangFlag(options=("--num-continuous-decode-steps",), type=int, accepts=lambda v, e: v >= 1,
               refusal="must be at least 1",
               help="accepted, no effect (as in SGLang today): every decode step is scheduled", default_text="1"),
    SGLangFlag(options=("--enable-lora",), accepts=_never,
               refusal="LoRA adapters are not supported; merge the adapter into the checkpoint"),
    SGLangFlag(options=("--lora-paths",), type=str, nargs="*", accepts=_never,
               refusal="LoRA adapters are not supported; merge the adapter into the checkpoint"),
)


def add_sglang_flags(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    refused = ", ".join(fl.options[0] for fl in SGLANG_FLAGS if not fl.help)
    group = parser.add_argument_group(GROUP_TITLE, textwrap.fill(
        "SGLang's flags that name no setting here, accepted where they mean the same (SGLang's names for "
        "settings this server has are the flags and aliases above). Refused by name, with the reason: "
        f"{refused}.", width=78))
    for fl in SGLANG_FLAGS:
        fl.add_to(group)
    return group


def check_sglang_flags(ns: argparse.Namespace, engine: EngineConfig,
                       fail: Callable[[str], NoReturn]) -> None:
    """fail(one line) for the first SGLang flag given with a value that means something else here."""
    for fl in SGLANG_FLAGS:
        why = fl.refused(ns, engine)
        if why is not None:
            fail(why)
