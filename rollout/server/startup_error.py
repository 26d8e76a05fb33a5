"""StartupError: why rollout-serve could not start, in one line (printed on stderr; exit code 1)."""
from __future__ import annotations

import logging

logger = logging.getLogger("rollout.server")


class StartupError(Exception):
    @classmethod
    def of(cls, exc: BaseException) -> "StartupError":
        """The one line of a failure while the engine starts: a ValueError's or OSError's message (they
        name the setting), else the last line of the engine's traceback (logged whole at debug level)."""
        lines = str(exc).strip().splitlines()
        if isinstance(exc, (ValueError, OSError)) and len(lines) == 1:
            return cls(lines[0])
        if len(lines) <= 1:
            return cls(f"the engine failed to start: {lines[0] if lines else type(exc).__name__}")
        logger.debug("the engine failed to start:\n%s", str(exc).strip())
        return cls(f"the engine failed to start: {lines[-1]} (--log-level debug shows the traceback)")
