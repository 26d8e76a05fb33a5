"""CliParser: an argparse parser whose errors are one line on stderr (exit 2), never the usage block.

An unknown flag names the closest known one: `rollout-serve: error: unrecognized arguments:
--max-running-request 8 (did you mean --max-running-requests?); --help lists the flags`.
"""
from __future__ import annotations

import argparse
import difflib
from typing import NoReturn

USAGE_ERROR_EXIT = 2


class CliParser(argparse.ArgumentParser):
    def options(self) -> list[str]:
        return [o for a in self._actions for o in a.option_strings if o.startswith("--")]

    def error(self, message: str) -> NoReturn:
        if message.startswith("unrecognized arguments:"):
            near = [difflib.get_close_matches(w.split("=", 1)[0], self.options(), n=1, cutoff=0.75)
                    for w in message.split(":", 1)[1].split() if w.startswith("--")]
            hints = sorted({n[0] for n in near if n})
            if hints:
                message += f" (did you mean {' or '.join(hints)}?)"
        if message.startswith(("unrecognized arguments:", "argument ", "the following arguments")):
            message += "; --help lists the flags"
        line = " ".join(f"{self.prog}: error: {message}".split())
        self.exit(USAGE_ERROR_EXIT, line + "\n")
