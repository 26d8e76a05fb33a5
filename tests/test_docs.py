"""The examples in README.md and docs/*.md run as written.

- ```python blocks: executed in order, one fresh interpreter per document (blocks share names, like
  a notebook), from the repository root.
- ```bash / ```sh / ```console blocks: every `curl` command in them runs against a real
  `rollout-serve` (tests/server_proc.py, started with --enable-return-routed-experts); other
  commands in those blocks (starting servers, sbatch, scripts) are not run here.
- `localhost:30000` (the documented default address) is rewritten to the test server's address.
- A block is skipped when the line right before its fence is `<!-- doc-test: skip (reason) -->`
  (for examples that need a GPU, a cluster or a checkpoint that is not here, or that another
  test runs in the setting they need); the reason is required.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from doc_blocks import blocks, curl_commands
from server_proc import ROOT, ServerProcess

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DEFAULT_ADDR = "localhost:30000"


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
