"""One server across two nodes (`--nnodes 2 --node-rank R --dist-init-addr HOST:PORT`), with real
processes: two process trees on loopback (the default suite) and across a veth pair between two
network namespaces. The reference is a one-node server with the same --dp-size: with deterministic
inference a request's tokens, logprobs and routing rows do not depend on which node ran its rank,
so the two-node answers must equal it bitwise (a prefix hit and retractions included). A killed
node: the requests in flight on the surviving node come back as aborts whose tokens and routing
rows are exactly the reference's first ones, /health fails at once and node 0 exits non-zero."""
from __future__ import annotations

import base64
import os
import shutil
import subprocess
import threading
import time
import uuid

import httpx
import pytest

from server_proc import NodeProcess, ServerProcess, free_port, pid_alive
from tiny_models import random_prompts

DP = 4
FLAGS = ["--dp-size", str(DP), "--enable-deterministic-inference", "--enable-return-routed-experts",
         "--max-total-tokens", "100", "--chunked-prefill-size", "16", "--cpu-threads", "1"]
GREEDY = {"temperature": 0.0, "ignore_eos": True}
# a rank's 2 requests need 2 x (20 + 40) = 120 KV slots of its 100: retractions
FIRST = random_prompts(21, [20] * 8)
RANKS = [0, 2, 1, 3, 2, 0, 3, 1]                  # both nodes' ranks
SECOND = [p[:12] + q[:8] for p, q in zip(FIRST, random_prompts(22, [8] * 8))]   # prefix hits on the same ranks
KILLED_PROMPTS = random_prompts(23, [5] * 4)
KILLED_TOKENS = 90


def _generate(url: str, prompts: list[list[int]], ranks: list[int], max_new_tokens: int) -> list[dict]:
    body = {"input_ids": prompts, "routed_dp_rank": ranks, "return_logprob": True, "return_routed_experts": True,
            "sampling_params": dict(GREEDY, max_new_tokens=max_new_tokens)}
    r = httpx.post(url + "/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def _answers(url: str) -> dict:
    return {"first": _generate(url, FIRST, RANKS, 40), "second": _generate(url, SECOND, RANKS, 40),
            "killed": _generate(url, KILLED_PROMPTS, [0, 1, 2, 3], KILLED_TOKENS)}


def _same(out: dict, ref: dict) -> None:
    """Tokens, logprobs (as JSON floats: every bit) and routing rows equal."""
    assert out["output_ids"] == ref["output_ids"]
    for key in ("output_token_logprobs", "routed_experts"):
        assert out["meta_info"][key] == ref["meta_info"][key], key
    assert out["meta_info"]["finish_reason"] == ref["meta_info"]["finish_reason"]


@pytest.fixture(scope="module")
def reference():
    """The one-node server's answers (the server is stopped before the two-node ones start: 2 CPUs)."""
    with ServerProcess(FLAGS) as srv:
        return _answers(srv.url)


class TwoNodes:
    """Node 0 (HTTP, ranks 0-1) and node 1 (ranks 2-3) of one server; node 1 optionally in a netns."""

    def __init__(self, host: str = "127.0.0.1", netns: str | None = None, dist_timeout: int = 120,
                 flags: list[str] = FLAGS):
        addr = f"{host}:{free_port()}"
        flags = [*flags, "--nnodes", "2", "--dist-init-addr", addr, "--dist-timeout", str(dist_timeout)]
        self.node1 = NodeProcess([*flags, "--node-rank", "1"], netns=netns)
        self.node0 = ServerProcess([*flags, "--node-rank", "0"], startup_timeout=180)

    def __enter__(self) -> "TwoNodes":
        self.node1.start()
        try:
            self.node0.start()
        except BaseException:
            self.node1.kill_tree()
            self.node1.stop(timeout=5)
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.node0.__exit__(*exc)
        finally:
            self.node1.stop()
            self.node1_log = self.node1.log()
            self.node1.remove_log()


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except OSError:
                pass
    return out


def test_two_nodes_on_loopback_equal_one_node(reference):
    with TwoNodes() as nodes:
        answers = {"first": _generate(nodes.node0.url, FIRST, RANKS, 40),
                   "second": _generate(nodes.node0.url, SECOND, RANKS, 40)}
        loads = httpx.get(nodes.node0.url + "/v1/loads").json()
        info = httpx.get(nodes.node0.url + "/server_info").json()
    for key in ("first", "second"):
        for out, ref in zip(answers[key], reference[key], strict=True):
            _same(out, ref)
    assert sum(o["meta_info"]["total_retractions"] for o in answers["first"]) > 0
    assert all(o["meta_info"]["cached_tokens"] >= 12 for o in answers["second"])
    assert [row["dp_rank"] for row in loads["loads"]] == list(range(DP))
    assert (info["nnodes"], info["dp_size"]) == (2, DP)
    assert "node 1 (DP ranks 2-3): the engines ended" in nodes.node1_log
    assert nodes.node1.proc.returncode == 0


def _kill_node1_mid_batch(nodes: TwoNodes, reference: dict) -> None:
    url = nodes.node0.url
    front = nodes.node0._server.proc.pid
    engines0 = _children(front)
    results: dict[int, tuple[int, dict]] = {}

    def one(rank: int) -> None:
        body = {"input_ids": KILLED_PROMPTS[rank], "routed_dp_rank": rank, "return_logprob": True,
                "return_routed_experts": True, "sampling_params": dict(GREEDY, max_new_tokens=KILLED_TOKENS)}
        r = httpx.post(url + "/generate", json=body, timeout=120)
        results[rank] = (r.status_code, r.json())

    threads = [threading.Thread(target=one, args=(r,)) for r in range(DP)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while sum(ld["num_running_reqs"] for ld in httpx.get(url + "/v1/loads").json()["loads"]) < DP:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    time.sleep(0.2)     # some tokens, far from KILLED_TOKENS (a step of 4 ranks takes milliseconds at best)
    nodes.node1.kill_tree()
    t0 = time.monotonic()
    while True:
        try:
            health = httpx.get(url + "/health", timeout=1).status_code
        except httpx.HTTPError:
            health = None    # already gone
        if health != 200:
            break
        assert time.monotonic() - t0 < 1.0, "/health still 200 a second after node 1 was killed"
        time.sleep(0.02)
    assert health in (503, None)
    for t in threads:
        t.join(15)
    assert sorted(results) == list(range(DP)), results
    for rank, (status, body) in results.items():
        if rank < 2:          # node 0's ranks: the exact partial outputs, as aborts naming the lost node
            meta, ref = body["meta_info"], reference["killed"][rank]
            assert status == 200 and meta["finish_reason"]["type"] == "abort", body
            assert "node 1 (DP ranks 2-3)" in meta["finish_reason"]["message"]
            n = len(body["output_ids"])
            assert 0 < n < KILLED_TOKENS
            assert body["output_ids"] == ref["output_ids"][:n]
            assert meta["output_token_logprobs"] == ref["meta_info"]["output_token_logprobs"][:n]
            # routing: int32 [prompt + output - 1 rows, layers, top_k], base64
            rows, ref_rows = (base64.b64decode(m["routed_experts"]) for m in (meta, ref["meta_info"]))
            row_bytes = len(ref_rows) // (len(KILLED_PROMPTS[rank]) + KILLED_TOKENS - 1)
            assert len(rows) == (len(KILLED_PROMPTS[rank]) + n - 1) * row_bytes
            assert rows == ref_rows[:len(rows)]
        else:                 # node 1's: 503 naming it
            assert status == 503 and "node 1 (DP ranks 2-3)" in str(body), body
    proc = nodes.node0._server.proc
    proc.wait(20)
    assert proc.returncode not in (0, None)
    assert "node 1 (DP ranks 2-3) is gone" in nodes.node0.log()
    deadline = time.monotonic() + 10
    while any(pid_alive(p) for p in engines0) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engines0 and not any(pid_alive(p) for p in engines0)
    leftovers = [d for d in os.listdir("/tmp") if d.startswith(f"rollout-{front}-")]
    assert not leftovers


def test_killed_node_returns_partials_fails_health_and_stops_the_server(reference):
    with TwoNodes() as nodes:
        _kill_node1_mid_batch(nodes, reference)


@pytest.mark.slow
def test_one_dead_engine_of_node_1_stops_its_node_and_the_server():
    """kill -9 of one engine process of node 1 (its launcher lives): node 1 stops its other engine and
    exits 1 naming the rank; node 0 answers its request in flight as an abort naming node 1 and
    exits non-zero."""
    with TwoNodes() as nodes:
        url = nodes.node0.url
        engines1 = sorted(_children(nodes.node1.proc.pid))
        assert len(engines1) == 2
        box = {}

        def one() -> None:
            body = {"input_ids": KILLED_PROMPTS[0], "routed_dp_rank": 0, "sampling_params": dict(GREEDY, max_new_tokens=90)}
            box["r"] = httpx.post(url + "/generate", json=body, timeout=120)

        t = threading.Thread(target=one)
        t.start()
        deadline = time.monotonic() + 60
        while httpx.get(url + "/v1/loads").json()["loads"][0]["num_running_reqs"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        os.kill(engines1[0], 9)
        t.join(30)
        meta = box["r"].json()["meta_info"]
        assert meta["finish_reason"]["type"] == "abort" and "node 1 (DP ranks 2-3)" in meta["finish_reason"]["message"]
        assert nodes.node1.proc.wait(20) == 1
        assert nodes.node0._server.proc.wait(20) not in (0, None)
        assert not any(pid_alive(p) for p in engines1)
    assert "exited with code -9" in nodes.node1_log


def _processes_naming(text: str) -> list[int]:
    """Pids whose command line contains text (an engine's holds its config, with dist_init_addr)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if text.encode() in f.read():
                        out.append(int(entry))
            except OSError:
                pass
    return out


def test_node_that_never_joins_is_a_startup_error():
    addr = f"127.0.0.1:{free_port()}"
    srv = ServerProcess([*FLAGS, "--nnodes", "2", "--node-rank", "0", "--dist-init-addr", addr, "--dist-timeout", "3"],
                        startup_timeout=60)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="exited with 1") as err:
        srv.start()
    assert time.monotonic() - t0 < 30    # the interpreter and torch's import, 3 s, the engines stopped
    assert "node 1 (DP ranks 2-3) did not join the rendezvous" in str(err.value)
    assert "within 3 s (--dist-timeout)" in str(err.value)
    assert not [p for p in _processes_naming(addr) if p != os.getpid()]   # node 0's engine processes too
    srv.stop()


def test_node_that_cannot_reach_node_0_fails_within_dist_timeout():
    node = NodeProcess([*FLAGS, "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", f"127.0.0.1:{free_port()}",
                        "--dist-timeout", "2"]).start()
    try:
        t0 = time.monotonic()
        assert node.proc.wait(60) == 1
        assert time.monotonic() - t0 < 45
        last = node.log().strip().splitlines()[-1]
        assert last.startswith("rollout-serve: error: node 1 (DP ranks 2-3): cannot reach the rendezvous at 127.0.0.1:")
        assert "within 2 s" in last
    finally:
        node.stop(timeout=1)
        node.remove_log()


def test_bad_node_flags_are_refused_before_anything_starts(capsys):
    from rollout.server.args import ServerArgs

    cases = [(["--nnodes", "2", "--dp-size", "3", "--dist-init-addr", "h:1"],
              "dp_size must be a multiple of nnodes (an equal share of DP ranks per node), got dp_size=3, nnodes=2"),
             (["--nnodes", "2", "--dp-size", "2"], "dist_init_addr (HOST:PORT on node 0) is required when nnodes > 1"),
             (["--nnodes", "2", "--dp-size", "2", "--node-rank", "2", "--dist-init-addr", "h:1"],
              "node_rank must be an integer in [0, 1] (nnodes=2), got 2"),
             (["--nnodes", "2", "--dp-size", "2", "--dist-init-addr", "h:0"],
              "dist_init_addr must be HOST:PORT with a port in [1, 65535], got 'h:0'"),
             (["--dist-timeout", "0"], "dist_timeout must be an integer in [1, 86400] (seconds), got 0")]
    for argv, message in cases:
        with pytest.raises(SystemExit) as exit_:
            ServerArgs.from_cli(argv)
        assert exit_.value.code == 2
        assert message in capsys.readouterr().err


def test_weight_updates_reach_every_rank_of_every_node(tiny_checkpoint):
    """A distributed push (trainer_bridge's DistributedSync: the trainer is rank 0, global DP rank r
    of the server rank 1 + r, whichever node runs it), then a disk update: greedy outputs on every
    rank are transformers' for the pushed checkpoint."""
    import asyncio

    from safetensors.torch import load_file

    from oracle import hf_greedy
    from rollout.config import DEFAULT_MODEL_PATH
    from trainer_bridge.client import RolloutClient
    from trainer_bridge.weight_sync import make_weight_sync

    a, b = tiny_checkpoint("qwen2_moe"), tiny_checkpoint("qwen2_moe", seed=1)
    prompt, n_new = [11, 57, 23, 200, 9, 31, 77, 5], 6
    want_a, want_b = hf_greedy(a, prompt, n_new), hf_greedy(b, prompt, n_new)
    assert want_a != want_b
    flags = ["--model-path", str(a), "--tokenizer-path", DEFAULT_MODEL_PATH, "--dtype", "float32", "--dp-size", "2",
             "--weight-update-bucket-bytes", "4096", "--cpu-threads", "1", "--allowed-weight-dirs", str(b)]
    greedy = {"temperature": 0.0, "max_new_tokens": n_new, "ignore_eos": True}

    def outputs(url: str) -> list[tuple[list[int], str]]:
        out = []
        for rank in (0, 1):
            r = httpx.post(url + "/generate", json={"input_ids": prompt, "sampling_params": greedy,
                                                    "routed_dp_rank": rank}, timeout=120).json()
            out.append((r["output_ids"], r["meta_info"]["weight_version"]))
        return out

    with TwoNodes(flags=flags) as nodes:
        url = nodes.node0.url
        assert outputs(url) == [(want_a, "default")] * 2

        async def push() -> None:
            async with RolloutClient([url]) as client:
                sync = make_weight_sync("distributed", client)
                try:
                    await sync.push(dict(sorted(load_file(f"{b}/model.safetensors").items())), "v-b")
                finally:
                    await sync.close()

        asyncio.run(push())
        assert outputs(url) == [(want_b, "v-b")] * 2
        r = httpx.post(url + "/update_weights_from_disk", json={"model_path": str(a), "weight_version": "disk-a"},
                       timeout=120)
        assert r.status_code == 200 and r.json()["success"], r.text
        assert outputs(url) == [(want_a, "disk-a")] * 2
        r = httpx.post(url + "/update_weights_from_disk", json={"model_path": str(b), "weight_version": "disk-b"},
                       timeout=120)
        assert r.status_code == 200 and r.json()["success"], r.text
        assert outputs(url) == [(want_b, "disk-b")] * 2


# ---- across network namespaces -------------------------------------------------------------------------
def _netns_pair():
    """(namespace, node 0's address): a namespace joined to this one by a veth pair on a private /24,
    or pytest.skip saying why it cannot be made. Removed by the caller (_remove_netns)."""
    if shutil.which("ip") is None:
        pytest.skip("needs iproute2 (`ip`) to make network namespaces")
    tag = uuid.uuid4().hex[:6]
    ns, veth0, veth1 = f"rollout-{tag}", f"rv0{tag}", f"rv1{tag}"
    net = f"10.{int(tag[:2], 16) % 200 + 20}.{int(tag[2:4], 16)}"
    steps = [["ip", "netns", "add", ns], ["ip", "link", "add", veth0, "type", "veth", "peer", "name", veth1],
             ["ip", "link", "set", veth1, "netns", ns], ["ip", "addr", "add", f"{net}.1/24", "dev", veth0],
             ["ip", "link", "set", veth0, "up"], ["ip", "-n", ns, "addr", "add", f"{net}.2/24", "dev", veth1],
             ["ip", "-n", ns, "link", "set", veth1, "up"], ["ip", "-n", ns, "link", "set", "lo", "up"]]
    for step in steps:
        r = subprocess.run(step, capture_output=True, text=True)
        if r.returncode:
            _remove_netns(ns, veth0)
            pytest.skip(f"cannot make a network namespace with a veth pair ({' '.join(step)}: {r.stderr.strip()})")
    return ns, veth0, f"{net}.1"


def _remove_netns(ns: str, veth0: str) -> None:
    subprocess.run(["ip", "link", "del", veth0], capture_output=True)
    subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@pytest.mark.slow
def test_two_nodes_across_network_namespaces(reference):
    """Node 1 inside its own network namespace, reaching node 0 only over a veth pair: its sockets
    and gloo take the veth's addresses (no loopback between the nodes)."""
    ns, veth0, host = _netns_pair()
    try:
        with TwoNodes(host=host, netns=ns) as nodes:
            out = _generate(nodes.node0.url, FIRST, RANKS, 40)
            for o, ref in zip(out, reference["first"], strict=True):
                _same(o, ref)
            _kill_node1_mid_batch(nodes, reference)
    finally:
        _remove_netns(ns, veth0)
