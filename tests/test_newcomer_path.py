"""README's first hour, run as written in a fresh copy of the repository: install, start the
server, the curl request, decoding the routing and the OpenAI client.

The copy holds the tracked files only (what a clone has, with this checkout's edits). README's
lines are found by the fenced block's place under its heading, not by line numbers:

- install: the shell block under a heading that names installing (its commands, as written); a
  README without one gets `bash scripts/setup_env.sh`, the script README's two commands run first.
  NOTE: the copy's `.venv` is made beforehand with this interpreter's packages on its path (a
  `.pth` line), and pip runs with no index: the install then resolves every dependency from
  them, offline, and installs the project itself (editable) into the copy's `.venv`. pip never
  uninstalls from outside the environment it installs into.
- serve: the `rollout-serve` command of the shell block under "Server", with `--port` of a free
  port appended (README's address is the default port, which this test must not take).
- curl: every curl command of that block, `localhost:30000` rewritten to that port.
- decode routing and OpenAI: the python blocks under "Server", run by the copy's `.venv/bin/python`.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import httpx
import pytest

from doc_blocks import curl_commands, headings, shell_commands, under
from server_proc import ROOT, free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
README = ROOT / "README.md"
DEFAULT_ADDR = "localhost:30000"
FALLBACK_INSTALL = [["bash", "scripts/setup_env.sh"]]


def install_commands() -> list[list[str]]:
    names = [text for _, _, text in headings(README) if re.search(r"\binstall", text, re.I)]
    cmds = [c for name in names for lang in ("bash", "sh") for b in under(README, name, lang)
            for c in shell_commands(b.code)]
    return cmds or FALLBACK_INSTALL


def serve_block():
    return next(b for b in under(README, "Server", "bash") if "rollout-serve" in b.code)


def serve_command() -> list[str]:
    return next(c for c in shell_commands(serve_block().code) if c[0].endswith("rollout-serve"))


def _env(clone: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PIP_", "VIRTUAL_ENV"))}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="2",
               PIP_NO_INDEX="1", PIP_CONFIG_FILE=os.devnull, PIP_NO_BUILD_ISOLATION="0", PIP_FIND_LINKS="",
               PIP_DISABLE_PIP_VERSION_CHECK="1", DS_BUILD_OPS="0")
    env["PATH"] = f"{clone / '.venv' / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return env


@pytest.fixture(scope="module")
def clone(tmp_path_factory):
    """A copy of the tracked files, installed by README's install lines."""
    dest = tmp_path_factory.mktemp("clone") / "rollout"
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for rel in filter(None, files.decode().split("\0")):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(dest / ".venv")], check=True)
    purelib = subprocess.run([str(dest / ".venv" / "bin" / "python"), "-c",
                              "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    Path(purelib, "_test_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = _env(dest)
    for cmd in install_commands():
        r = subprocess.run(cmd, cwd=dest, env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, f"install {cmd} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    assert (dest / ".venv" / "bin" / "rollout-serve").exists(), "the install made no .venv/bin/rollout-serve"
    return dest


@pytest.fixture(scope="module")
def served(clone):
    port = free_port()
    cmd = serve_command() + ["--port", str(port)]
    log = clone / "serve.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=clone, env=_env(clone), stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, f"{cmd} exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"{cmd} not healthy in 300 s:\n{log.read_text()[-3000:]}"
            time.sleep(0.2)
        yield {"url": url, "port": port, "log": log}
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def test_the_server_runs_from_the_copy(served, clone):
    info = httpx.get(served["url"] + "/model_info").json()
    assert Path(info["model_path"]).resolve().is_relative_to(clone.resolve()), info["model_path"]
    assert info["enable_return_routed_experts"] is True
    assert f"rollout-serve listening on {served['url']}" in served["log"].read_text()


def test_readme_curl(served, clone):
    cmds = curl_commands(serve_block().code)
    assert cmds, "README's Server block has no curl command"
    for cmd in cmds:
        cmd = cmd.replace(DEFAULT_ADDR, f"localhost:{served['port']}")
        r = subprocess.run(["bash", "-c", cmd], cwd=clone, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, f"{cmd}\n{r.stderr}"
        out = json.loads(r.stdout)
        meta = out["meta_info"]
        assert "routed_experts" in meta and meta["completion_tokens"] == len(out["output_ids"]) > 0


def test_readme_decode_and_openai_client(served, clone):
    code = "".join(b.code for b in under(README, "Server", "python"))
    assert "decode_routed_experts" in code and "OpenAI(" in code
    script = clone / "readme_server_examples.py"
    script.write_text(code.replace(DEFAULT_ADDR, f"localhost:{served['port']}"))
    r = subprocess.run([str(clone / ".venv" / "bin" / "python"), str(script)], cwd=clone, env=_env(clone),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    assert r.stdout.strip(), "the examples printed nothing"
