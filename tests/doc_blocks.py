"""The fenced code blocks of a markdown document, each with the heading it sits under.

Used by the tests that run the documents' examples (tests/test_docs.py, tests/test_integrations.py,
tests/test_newcomer_path.py). A block is found by its language and the heading above it, never by
its line number, so that edits elsewhere in a document do not move what a test runs.
"""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

SKIP = re.compile(r"^<!--\s*doc-test:\s*skip\s*\((.+)\)\s*-->\s*$")
FENCE = re.compile(r"^(\s*)```(\w*)\s*$")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*$")


@dataclass
class Block:
    path: Path
    line: int               # 1-based line of the opening fence
    lang: str
    code: str
    skip: Optional[str]     # the reason, when marked
    heading: str            # the text of the nearest heading above ("" before the first)


def blocks(path: Path) -> list[Block]:
    out, lines, i, heading = [], Path(path).read_text().splitlines(), 0, ""
    while i < len(lines):
        h = HEADING.match(lines[i])
        if h:
            heading = h.group(2)
        m = FENCE.match(lines[i])
        if not m or not m.group(2):
            i += 1
            continue
        start, indent, body = i, m.group(1), []
        i += 1
        while i < len(lines) and not re.match(rf"^{indent}```\s*$", lines[i]):
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
            i += 1
        prev = lines[start - 1] if start > 0 else ""
        sm = SKIP.match(prev.strip())
        if prev.strip().startswith("<!--") and "doc-test" in prev and not sm:
            raise AssertionError(f"{path}:{start}: malformed doc-test marker {prev!r}; "
                                 f"use <!-- doc-test: skip (reason) -->")
        out.append(Block(Path(path), start + 1, m.group(2).lower(), "\n".join(body) + "\n",
                         sm.group(1) if sm else None, heading))
        i += 1
    return out


def headings(path: Path) -> list[tuple[int, int, str]]:
    """(1-based line, level, text) of each heading outside code blocks."""
    out, fence = [], None
    for n, line in enumerate(Path(path).read_text().splitlines(), start=1):
        m = FENCE.match(line)
        if m and (fence is None and m.group(2) or fence is not None and m.group(1) == fence):
            fence = m.group(1) if fence is None else None
            continue
        h = HEADING.match(line)
        if fence is None and h:
            out.append((n, len(h.group(1)), h.group(2)))
    return out


def under(path: Path, heading: str, lang: str) -> list[Block]:
    """The ``lang`` blocks under the heading whose text starts with ``heading`` (its subsections
    included: until the next heading of the same or a higher level)."""
    hs, ranges = headings(path), []
    for i, (n, level, text) in enumerate(hs):
        if text.startswith(heading):
            end = next((m for m, lv, _ in hs[i + 1:] if lv <= level), 10**9)
            ranges.append((n, end))
    return [b for b in blocks(path) if b.lang == lang and any(a < b.line < z for a, z in ranges)]


def shell_commands(code: str) -> list[list[str]]:
    """The commands of a shell block as argument lists (shlex: continuation lines joined, quotes
    and comments as the shell reads them)."""
    out, cur = [], ""
    for line in code.splitlines():
        if line.rstrip().endswith("\\"):
            cur += line.rstrip()[:-1] + " "
            continue
        try:
            words = shlex.split(cur + line, comments=True)
        except ValueError:      # an open quote: the command goes on on the next line
            cur += line + "\n"
            continue
        cur = ""
        if words:
            out.append(words)
    assert not cur.strip(), f"unterminated shell command: {cur!r}"
    return out


def curl_commands(code: str) -> list[str]:
    """The curl commands of a shell block, with their continuation lines (trailing backslash, or
    an open single-quoted argument)."""
    cmds, cur = [], None
    for line in code.splitlines():
        if cur is None:
            if line.strip().startswith("curl "):
                cur = [line]
            else:
                continue
        else:
            cur.append(line)
        text = "\n".join(cur)
        if not text.rstrip().endswith("\\") and text.count("'") % 2 == 0:
            cmds.append(text)
            cur = None
    assert cur is None, f"unterminated curl command: {cur}"
    return cmds
