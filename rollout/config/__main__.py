"""`python -m rollout.config`: validate engine config files, print the sizes they imply (--show) or the
equivalent `rollout-serve` flags (--flags; used by scripts/slurm/lib.sh)."""
from __future__ import annotations

import json
import shlex
import sys
from typing import Optional, Sequence

from rollout.config.cli_parser import CliParser
from rollout.config.config_file import (ConfigFileError, format_sizes, implied_sizes, load_engine_config,
                                        load_engine_config_file, serve_flags)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = CliParser(prog="python -m rollout.config",
                  description="Validate engine config files and print the sizes they imply.")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--show", nargs="+", metavar="YAML", help="configs/engine/<name>.yaml ...: print the "
                      "capture buffer rows/bytes and host store bytes the config implies")
    what.add_argument("--flags", metavar="YAML", help="print the rollout-serve flags equivalent to the config "
                      "(one shell-quoted line; used by scripts/slurm/*.sbatch)")
    p.add_argument("--json", action="store_true", help="with --show: print JSON instead of text")
    ns = p.parse_args(argv)
    if ns.flags:
        try:
            print(shlex.join(serve_flags(load_engine_config(ns.flags))))
        except ConfigFileError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        return 0
    out = []
    for path in ns.show:
        try:
            out.append(implied_sizes(load_engine_config_file(path)))
        except ConfigFileError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    if ns.json:
        print(json.dumps(out if len(out) > 1 else out[0], indent=2))
    else:
        print("\n\n".join(format_sizes(s) for s in out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
