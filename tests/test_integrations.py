"""docs/integrations.md ("Use with slime, Miles, verl, AReaL") runs as written.

The server is started from the doc's own `rollout-serve` line (its model, device, host and port
replaced by the embedded model on a free loopback port) and the router from its
`sglang_router.launch_router` line (PyPI sglang-router, its Rust binary; host and port replaced),
without workers: the slime example registers the server as slime does. Then each python example
of the doc runs in a fresh interpreter, in the doc's order, with `localhost:30000`,
`localhost:29000` and `/shared/weights` rewritten to the server, the router and a temporary
directory. The bodies the doc names without showing (AReaL's xccl update) are sent here too.
"""
from __future__ import annotations

import datetime
import os
import subprocess
import sys
import threading
import time

import httpx
import pytest

from doc_blocks import blocks, shell_commands, under
from server_proc import ROOT, ServerProcess, free_port

pytest.importorskip("sglang_router")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

DOC = ROOT / "docs" / "integrations.md"
SERVER_ADDR, ROUTER_ADDR, SHARED = "localhost:30000", "localhost:29000", "/shared/weights"
REPLACED = {"--model-path", "--device", "--host", "--port"}   # flags whose values are this machine's


def _doc_commands() -> tuple[list[str], list[str]]:
    """The doc's rollout-serve flags and the router's command line, from "The servers"."""
    (block,) = under(DOC, "The servers", "bash")
    cmds = shell_commands(block.code)
    serve = next(c for c in cmds if c[0] == "rollout-serve")
    router = next(c for c in cmds if "sglang_router.launch_router" in c)
    flags, i = [], 1
    while i < len(serve):
        if serve[i] in REPLACED:
            i += 2
            continue
        flags.append(serve[i])
        i += 1
    return flags, router


def _without(words: list[str], names: set[str]) -> list[str]:
    out, i = [], 0
    while i < len(words):
        if words[i] in names:
            i += 2
            continue
        out.append(words[i])
        i += 1
    return out


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    shared = tmp_path_factory.mktemp("shared-weights")
    flags, router_cmd = _doc_commands()
    flags = [str(shared) if f == SHARED else f for f in flags]
    log = tmp_path_factory.mktemp("router") / "router.log"
    with ServerProcess(flags) as srv:
        port = free_port()
        cmd = [sys.executable if w == "python" else w for w in _without(router_cmd, {"--host", "--port"})]
        with open(log, "w") as f:
            proc = subprocess.Popen(cmd + ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warn"],
                                    stdout=f, stderr=subprocess.STDOUT)
        router = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    if httpx.get(router + "/workers", timeout=5).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
                time.sleep(0.3)
            yield {"server": srv.url, "router": router, "shared": shared}
        finally:
            proc.terminate()
            proc.wait(30)
        assert srv.alive, srv.log()


def test_the_doc_flags_are_the_ones_a_fleet_needs():
    flags, router = _doc_commands()
    assert {"--enable-return-routed-experts", "--default-return-routed-experts", "--allowed-weight-dirs"} <= set(flags)
    assert router[:3] == ["python", "-m", "sglang_router.launch_router"]


def test_every_example_is_left_to_this_test():
    """tests/test_docs.py skips this doc's blocks (its server has none of these flags)."""
    for b in blocks(DOC):
        assert b.skip, f"{DOC.name}:{b.line}: mark it <!-- doc-test: skip (...) -->"
    assert {b.heading for b in blocks(DOC) if b.lang == "python"} == {"slime", "Miles", "verl", "AReaL"}


def test_examples_run_in_order(fleet, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    for b in [b for b in blocks(DOC) if b.lang == "python"]:
        code = (b.code.replace(SERVER_ADDR, fleet["server"].removeprefix("http://"))
                .replace(ROUTER_ADDR, fleet["router"].removeprefix("http://")).replace(SHARED, str(fleet["shared"])))
        script = tmp_path / f"example_{b.line}.py"
        script.write_text(code)
        r = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=600)
        assert r.returncode == 0, f"{DOC.name}:{b.line} ({b.heading}) failed\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"


def test_areal_xccl_bodies(fleet):
    """areal/engine/sglang_remote.py: build_init_weights_group_request (master_port a string) and
    build_distributed_weight_update_requests (group_name, abort_all_requests)."""
    import torch.distributed as dist
    from safetensors.torch import load_file

    from trainer_bridge.weight_sync import init_custom_process_group

    server, port, answers = fleet["server"], free_port(), {}

    def post(name, body):
        answers[name] = httpx.post(f"{server}/{name}", json=body, timeout=300)

    t = threading.Thread(target=post, args=("init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": str(port), "rank_offset": 1, "world_size": 2,
        "backend": "gloo", "group_name": "update_weight_group"}))
    t.start()
    group = init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", 2, 0, "update_weight_group",
                                      datetime.timedelta(seconds=120))
    t.join()
    assert answers["init_weights_update_group"].json()["success"], answers["init_weights_update_group"].text
    model_path = httpx.get(f"{server}/model_info").json()["model_path"]
    value = load_file(f"{model_path}/model.safetensors")["lm_head.weight"]   # the served value: nothing changes
    t = threading.Thread(target=post, args=("update_weights_from_distributed", {
        "names": ["lm_head.weight"], "dtypes": [str(value.dtype).removeprefix("torch.")], "shapes": [list(value.shape)],
        "group_name": "update_weight_group", "abort_all_requests": True}))
    t.start()
    dist.broadcast(value.contiguous(), src=0, group=group)
    t.join()
    assert answers["update_weights_from_distributed"].json()["success"], answers["update_weights_from_distributed"].text
    httpx.post(f"{server}/destroy_weights_update_group", json={"group_name": "update_weight_group"}).raise_for_status()
    dist.destroy_process_group(group)
