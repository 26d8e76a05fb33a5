"""The real sglang-router (PyPI sglang-router, its Rust binary) in front of two real rollout-serves:
registration, /get_load polling, routed generations through the router on /generate,
/v1/completions and /v1/chat/completions (routing rows checked against transformers' router top-k,
given by the workers' --default-return-routed-experts where the router drops the field), a worker removed and
added again, and RolloutClient(router_url=...) fanning pause / continue / abort / flush / weight
pushes out to every worker the router lists."""
import asyncio
import base64
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from oracle import hf_router_topk, same_sets
from rollout.config import DEFAULT_MODEL_PATH
from server_proc import ServerProcess, free_port
from trainer_bridge.client import RolloutClient
from trainer_bridge.weight_sync import make_weight_sync

pytest.importorskip("sglang_router")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
L, K = 4, 4
FLAGS = ["--enable-return-routed-experts", "--default-return-routed-experts", "--dtype", "float32"]


def wait_for(fn, timeout=90.0, what="condition"):
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = fn()
            if value:
                return value
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.5)


def workers(router):
    return httpx.get(router + "/workers", timeout=10).json()["workers"]


def hits(server_url, path):
    """rollout_http_requests_total for path on one server (any method and status)."""
    total = 0
    for line in httpx.get(server_url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("rollout_http_requests_total{") and f'path="{path}"' in line:
            total += int(float(line.rsplit(" ", 1)[1]))
    return total


def check_rows(b64, seq):
    rows = torch.from_numpy(np.frombuffer(base64.b64decode(b64), dtype="<i4").reshape(len(seq) - 1, L, K).copy())
    assert same_sets(rows, hf_router_topk(DEFAULT_MODEL_PATH, seq[:-1], K, L))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    log = tmp_path_factory.mktemp("router") / "router.log"
    with ServerProcess(FLAGS) as a, ServerProcess(FLAGS) as b:
        port = free_port()
        with open(log, "w") as f:
            proc = subprocess.Popen([sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                                     "--port", str(port), "--worker-urls", a.url, b.url, "--policy", "power_of_two",
                                     "--log-level", "warn"], stdout=f, stderr=subprocess.STDOUT)
        router = f"http://127.0.0.1:{port}"
        try:
            wait_for(lambda: len([w for w in workers(router) if w["is_healthy"]]) == 2, what=f"2 workers: {log}")
            yield {"router": router, "servers": [a.url, b.url]}
        finally:
            proc.terminate()
            proc.wait(30)
        assert a.alive and b.alive, a.log() + b.log()


def test_registration_and_get_load(fleet):
    listed = workers(fleet["router"])
    assert sorted(w["url"] for w in listed) == sorted(fleet["servers"])
    assert all(w["model_id"] == "tiny-moe" and w["metadata"]["model_type"] == "qwen3_moe" for w in listed)
    for url in fleet["servers"]:
        assert hits(url, "/server_info") + hits(url, "/get_server_info") >= 1
        assert hits(url, "/model_info") + hits(url, "/get_model_info") >= 1
        loads = httpx.get(url + "/get_load", timeout=10).json()
        assert set(loads[0]) == {"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens", "num_pending_tokens",
                                 "ts_tic"}
    # power_of_two reads the workers' loads from /get_load
    wait_for(lambda: all(hits(u, "/get_load") > 1 for u in fleet["servers"]), what="the router polling /get_load")


def test_routed_generations_through_the_router(fleet):
    router = fleet["router"]
    before = [hits(u, "/generate") for u in fleet["servers"]]
    for i in range(6):
        ids = [5 + i, 17, 99, 230, 41, 8]
        r = httpx.post(router + "/generate", json={"input_ids": ids, "return_routed_experts": True,
                                                   "sampling_params": {"temperature": 0, "max_new_tokens": 5,
                                                                       "ignore_eos": True}}, timeout=120)
        assert r.status_code == 200, r.text
        out = r.json()
        check_rows(out["meta_info"]["routed_experts"], ids + out["output_ids"])
    assert all(hits(u, "/generate") > n for u, n in zip(fleet["servers"], before)), "both workers served"
    # NOTE: the router's completion schema takes a string (or strings) as prompt, not token ids
    r = httpx.post(router + "/v1/completions", json={
        "model": "tiny-moe", "prompt": "Q: 12+7= A:", "max_tokens": 4, "temperature": 0, "ignore_eos": True,
        "return_routed_experts": True, "return_token_ids": True}, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    check_rows(r.json()["sglext"]["routed_experts"], choice["prompt_token_ids"] + choice["token_ids"])
    # NOTE: the router rebuilds chat bodies and drops return_routed_experts (and return_token_ids): the
    # workers' default gives routing; the tokens come from the same greedy request sent to a worker
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "12+7?"}]}),
                       ("/v1/completions", {"prompt": "Q: 3+4= A:"})):
        body = {"model": "tiny-moe", "max_tokens": 4, "temperature": 0, "ignore_eos": True, **body}
        r = httpx.post(router + path, json=body, timeout=120)
        assert r.status_code == 200, r.text
        direct = httpx.post(fleet["servers"][0] + path, json={**body, "return_token_ids": True}, timeout=120).json()
        choice = direct["choices"][0]
        assert r.json()["sglext"]["routed_experts"] == direct["sglext"]["routed_experts"]
        check_rows(r.json()["sglext"]["routed_experts"], choice["prompt_token_ids"] + choice["token_ids"])
    r = httpx.post(router + "/v1/completions", json={"model": "tiny-moe", "prompt": "Q: 3+4= A:", "max_tokens": 2,
                                                     "return_routed_experts": False}, timeout=120)
    assert r.status_code == 200 and "sglext" not in r.json(), r.text


def test_worker_removed_and_added(fleet):
    router, (a, b) = fleet["router"], fleet["servers"]
    wid = next(w["id"] for w in workers(router) if w["url"] == b)
    assert httpx.delete(f"{router}/workers/{wid}", timeout=30).status_code < 300
    wait_for(lambda: [w["url"] for w in workers(router)] == [a], what="worker removed")
    before = hits(b, "/generate")
    for _ in range(3):
        r = httpx.post(router + "/generate", json={"input_ids": [3, 4, 5], "sampling_params": {"max_new_tokens": 2}},
                       timeout=120)
        assert r.status_code == 200 and "routed_experts" in r.json()["meta_info"]
    assert hits(b, "/generate") == before
    assert httpx.post(router + "/workers", json={"url": b}, timeout=60).status_code < 300
    wait_for(lambda: sorted(w["url"] for w in workers(router) if w["is_healthy"]) == sorted([a, b]),
             what="worker added back")


def test_rollout_client_behind_the_router(fleet):
    router, servers = fleet["router"], fleet["servers"]
    weights = load_file(f"{DEFAULT_MODEL_PATH}/model.safetensors")

    async def run():
        async with RolloutClient(router_url=router, routing_format="int32") as client:
            assert sorted(client.urls) == sorted(servers)
            samples = await client.generate_groups([[11, 22, 33, 44], [9, 8, 7]], n=2, sampling_params={
                "temperature": 1.0, "max_new_tokens": 4, "ignore_eos": True})
            paused = await client.pause("retract")
            states = [httpx.get(u + "/server_info", timeout=10).json()["paused"] for u in servers]
            flushed = await client.flush_cache()
            resumed = await client.continue_generation()
            sync = make_weight_sync("tensor", client)
            result = await sync.push({"lm_head.weight": weights["lm_head.weight"].clone()}, "router-v1")
            versions = [httpx.get(u + "/get_weight_version", timeout=10).json()["weight_version"] for u in servers]
            late = await client.generate([1, 2, 3], {"temperature": 0, "max_new_tokens": 2})
            return samples, paused, states, flushed, resumed, result, versions, late
    samples, paused, states, flushed, resumed, result, versions, late = asyncio.run(run())
    assert len(samples) == 4
    for s in samples:
        check_rows_tensor = s.routed_experts
        seq = s.prompt_ids.tolist() + s.response_ids.tolist()
        assert same_sets(check_rows_tensor, hf_router_topk(DEFAULT_MODEL_PATH, seq[:-1], K, L))
    assert sorted(paused) == sorted(servers) and states == ["retract", "retract"]
    assert sorted(flushed) == sorted(servers) and sorted(resumed) == sorted(servers)
    assert sorted(result.servers) == sorted(servers) and versions == ["router-v1", "router-v1"]
    assert late.weight_version == "router-v1"
