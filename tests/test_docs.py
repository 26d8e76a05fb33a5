"""The examples in README.md and docs/*.md run as written.

- ```python blocks: executed in order, one fresh interpreter per document (blocks share names, like
  a notebook), from the repository root.
- ```bash / ```sh / ```console blocks: every `curl` command in them runs against a real
  `rollout-serve` (tests/server_proc.py, started with --enable-return-routed-experts); other
  commands in those blocks (starting servers, sbatch, scripts) are not run here.
- `localhost:30000` (the documented default address) is rewritten to the test server's address.
- A block is skipped when the line right before its fence is `<!-- doc-test: skip (reason) -->`
  (for examples that need a GPU, a cluster or a checkpoint that is not here); the reason is
  required.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from server_proc import ROOT, ServerProcess

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SKIP = re.compile(r"^<!--\s*doc-test:\s*skip\s*\((.+)\)\s*-->\s*$")
FENCE = re.compile(r"^(\s*)```(\w*)\s*$")
DEFAULT_ADDR = "localhost:30000"


@dataclass
class Block:
    path: Path
    line: int          # 1-based line of the opening fence
    lang: str
    code: str
    skip: str | None   # the reason, when marked


def blocks(path: Path) -> list[Block]:
    out, lines, i = [], path.read_text().splitlines(), 0
    while i < len(lines):
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
        out.append(Block(path, start + 1, m.group(2).lower(), "\n".join(body) + "\n", sm.group(1) if sm else None))
        i += 1
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


ALL = [b for p in DOCS for b in blocks(p)]


@pytest.fixture(scope="module")
def server():
    with ServerProcess(["--enable-return-routed-experts"]) as srv:
        yield srv


def _address(srv: ServerProcess) -> str:
    return srv.url.removeprefix("http://")


def test_docs_exist_and_have_runnable_examples():
    names = {p.name for p in DOCS}
    assert {"README.md", "protocol.md", "slurm.md", "trainer.md", "architecture.md"} <= names, names
    assert any(b.lang == "python" and not b.skip for b in ALL)
    assert any(curl_commands(b.code) for b in ALL if b.lang in ("bash", "sh", "console"))


@pytest.mark.parametrize("doc", [p for p in DOCS if any(b.lang == "python" and not b.skip for b in blocks(p))],
                         ids=lambda p: p.name)
def test_python_examples_run(doc, server, tmp_path):
    runnable = [b for b in blocks(doc) if b.lang == "python" and not b.skip]
    script = tmp_path / "run_blocks.py"
    payload = [{"line": b.line, "code": b.code.replace(DEFAULT_ADDR, _address(server))} for b in runnable]
    (tmp_path / "blocks.json").write_text(json.dumps(payload))
    script.write_text(textwrap.dedent(f"""\
        import json, sys, traceback
        ns = {{"__name__": "__main__"}}
        for b in json.load(open({str(tmp_path / "blocks.json")!r})):
            try:
                exec(compile(b["code"], {str(doc)!r} + ":" + str(b["line"]), "exec"), ns)
            except BaseException:
                traceback.print_exc()
                print("DOC-BLOCK-FAILED", {doc.name!r}, "line", b["line"], file=sys.stderr)
                sys.exit(1)
        """))
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="2", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               ROLLOUT_DOC_TEST_TMP=str(tmp_path))
    r = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"{doc.name}: a python example failed\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"


CURLS = [(b, i, c) for b in ALL if b.lang in ("bash", "sh", "console") and not b.skip
         for i, c in enumerate(curl_commands(b.code))]


@pytest.mark.parametrize("block, index, cmd", CURLS, ids=[f"{b.path.name}:{b.line}#{i}" for b, i, _ in CURLS])
def test_curl_examples_run(block, index, cmd, server):
    cmd = cmd.replace(DEFAULT_ADDR, _address(server))
    r = subprocess.run(["bash", "-c", cmd], cwd=ROOT, capture_output=True, text=True, timeout=120)
    where = f"{block.path.name}:{block.line}: {cmd}"
    assert r.returncode == 0, f"{where}\nrc={r.returncode}\n{r.stdout[-1000:]}\n{r.stderr[-1000:]}"
    out = r.stdout.strip()
    assert out, f"{where}: no output"
    docs = [line[6:] for line in out.splitlines() if line.startswith("data: ")] or [out]
    for d in docs:
        if d == "[DONE]":
            continue
        obj = json.loads(d)
        assert not (isinstance(obj, dict) and "error" in obj), f"{where}: {obj}"


def test_skip_markers_carry_a_reason():
    for b in ALL:
        if b.skip is not None:
            assert b.skip.strip(), f"{b.path}:{b.line}: skip marker without a reason"
