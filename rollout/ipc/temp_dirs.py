"""The temporary directories a rollout process leaves when it is killed (kill -9, the OOM killer):
`rollout-<pid>-*` (the front end's IPC sockets, rollout/ipc/transport.py) and
`rollout-weights-<pid>-*` (an engine's weights spilled by release_memory_occupation,
rollout/core/memory_saver.py). Each name carries the pid of the process that made it; a directory
whose process is gone is removed by the next front end that starts (or by the front end that saw
its engine die)."""
from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from typing import Iterable, Optional

from rollout.ipc.transport import pid_alive

logger = logging.getLogger(__name__)

_OWNED = re.compile(r"^rollout-(?:weights-)?(\d+)-[A-Za-z0-9_]+$")


def owned_dirs(root: Optional[str] = None) -> list[tuple[str, int]]:
    """(path, pid) of every rollout temporary directory under root (the temp directory)."""
    root = root or tempfile.gettempdir()
    out = []
    try:
        names = os.listdir(root)
    except OSError:
        return out
    for name in names:
        m = _OWNED.match(name)
        path = os.path.join(root, name)
        if m and os.path.isdir(path) and not os.path.islink(path):
            out.append((path, int(m.group(1))))
    return out


def remove_dirs_of(pids: Iterable[int], root: Optional[str] = None) -> int:
    """Removes the directories made by these (exited) processes; returns how many."""
    wanted = set(pids)
    gone = [path for path, pid in owned_dirs(root) if pid in wanted]
    for path in gone:
        shutil.rmtree(path, ignore_errors=True)
    return len(gone)


def remove_stale_dirs(root: Optional[str] = None) -> int:
    """Removes the directories whose process no longer runs; returns how many."""
    stale = [pid for _, pid in owned_dirs(root) if pid != os.getpid() and not pid_alive(pid)]
    removed = remove_dirs_of(stale, root)
    if removed:
        logger.info("removed %d temporary director%s left by exited rollout processes", removed,
                    "y" if removed == 1 else "ies")
    return removed
