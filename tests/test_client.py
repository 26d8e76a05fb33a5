"""RolloutClient and weight sync: against real rollout-serve processes, and against mock servers
(httpx.MockTransport) for the retry/abort/validation logic."""
from __future__ import annotations

import asyncio
import base64
import json

import httpx
import numpy as np
import pytest
import torch

from trainer_bridge.client import (NoServerError, RequestRejected, RolloutClient, SampleError)
from trainer_bridge.launch import LocalServers, share_cpus
from trainer_bridge.weight_sync import make_weight_sync

PROMPTS = [[51, 28, 223, 21, 25, 13, 22, 23, 31, 269, 28], [51, 28, 223, 27, 12, 19, 20, 31, 269, 28]]
SP = {"temperature": 1.0, "max_new_tokens": 6}
FLAGS = ["--enable-return-routed-experts", "--dtype", "float32", "--kv-cache-bytes", str(32 << 20)]


def arun(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def two_servers(tmp_path_factory):
    sync_dir = tmp_path_factory.mktemp("sync")
    with LocalServers(2, FLAGS + ["--allowed-weight-dirs", str(sync_dir), "--log-level", "warning"]) as srv:
        srv.sync_dir = sync_dir
        yield srv


# ---- real servers -------------------------------------------------------------------------------
def test_servers_on_one_host_share_its_cpus(two_servers):
    import os

    usable = len(os.sched_getaffinity(0))
    assert share_cpus(["--x"], 1) == ["--x"] and share_cpus(["--cpu-threads", "3"], 2) == ["--cpu-threads", "3"]
    assert share_cpus(["--cpu-threads=3"], 2) == ["--cpu-threads=3"]
    assert share_cpus([], 2) == ["--cpu-threads", str(max(1, usable // 2))]
    for url in two_servers.urls:   # what the engine processes run
        state = httpx.get(url + "/server_info", timeout=30).json()["internal_states"][0]
        assert state["cpu_threads"] == max(1, usable // 2)


def test_groups_shapes_validation_and_balance(two_servers):
    async def go():
        async with RolloutClient(two_servers.urls) as c:
            assert c.info.num_layers == 4 and c.info.top_k == 4 and c.info.num_experts == 16
            seen = []
            samples = await c.generate_groups(PROMPTS, 4, SP, seed=3, rid_prefix="g-", on_sample=seen.append)
            loads = c.loads()
            server_loads = await c.server_loads()
            return c.info, samples, seen, loads, server_loads
    info, samples, seen, loads, server_loads = arun(go())
    assert [s.rid for s in samples] == [f"g-{i}-{k}" for i in range(2) for k in range(4)]
    assert len(seen) == 8 and {s.rid for s in seen} == {s.rid for s in samples}
    for s in samples:
        assert s.group_id == s.meta["prompt_index"]
        assert s.prompt_ids.tolist() == PROMPTS[s.meta["prompt_index"]]
        assert s.routed_experts.shape == (s.num_tokens - 1, 4, 4) and s.routed_experts.dtype == torch.int32
        assert len(s.rollout_logprobs) == s.response_length and (s.rollout_logprobs <= 0).all()
        assert s.weight_version == "default"
        assert s.meta["wire_bytes"] > s.meta["routing_bytes"] > 0
    # least-outstanding balance over two idle servers: both get work, nothing left outstanding
    assert all(d["completed"] >= 2 and d["outstanding"] == 0 for d in loads.values())
    assert sum(d["completed"] for d in loads.values()) == 8
    assert all("loads" in v for v in server_loads.values())


def test_stream_matches_non_stream_and_formats_agree(two_servers):
    async def go(stream, fmt):
        async with RolloutClient(two_servers.urls[:1], stream=stream, routing_format=fmt) as c:
            return await c.generate_groups(PROMPTS, 2, SP, seed=11, rid_prefix=f"{stream}-{fmt}-")
    ref = arun(go(False, "compact"))
    for stream, fmt in ((True, "compact"), (False, "int32"), (True, "int32")):
        got = arun(go(stream, fmt))
        for a, b in zip(ref, got):
            assert a.response_ids.tolist() == b.response_ids.tolist()
            assert torch.equal(a.routed_experts, b.routed_experts)
            assert torch.allclose(a.rollout_logprobs, b.rollout_logprobs, atol=1e-4)
    assert arun(go(False, "compact"))[0].meta["routing_bytes"] * 3 < arun(go(False, "int32"))[0].meta["routing_bytes"]


def test_pause_abort_resubmits_and_client_abort_returns_partial(two_servers):
    # NOTE: long enough that the requests still run when the pause / abort lands (~1.5 ms a token)
    long = {"temperature": 1.0, "max_new_tokens": 1200, "ignore_eos": True}

    async def go():
        async with RolloutClient(two_servers.urls) as c:
            task = asyncio.ensure_future(c.generate_groups(PROMPTS, 4, long, seed=5, rid_prefix="p-"))
            while sum(d["outstanding"] for d in c.loads().values()) < 8:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)
            await c.pause("abort")
            assert c.paused
            await asyncio.sleep(0.3)
            assert not task.done()
            await c.continue_generation()
            resumed = await task
            resubmitted = c.resubmitted
            # this client's own abort: partial samples, not retried
            task = asyncio.ensure_future(c.generate_groups(PROMPTS[:1], 2, long, seed=6, rid_prefix="a-"))
            while sum(d["outstanding"] for d in c.loads().values()) < 2:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)
            await c.abort()
            aborted = await task
            return resumed, resubmitted, aborted
    resumed, resubmitted, aborted = arun(go())
    assert resubmitted >= 1
    assert len(resumed) == 8 and all(s.meta["finish_reason"] == "length" and s.response_length == 1200
                                     for s in resumed)
    assert len(aborted) == 2
    assert all(s.meta["finish_reason"] == "abort" and s.response_length < 1200 for s in aborted)
    for s in aborted:  # partial but consistent: routing rows match the tokens
        assert s.routed_experts.shape[0] == s.num_tokens - 1


@pytest.mark.parametrize("mode", ["tensor", "disk", "distributed"])
def test_weight_sync_modes(two_servers, mode):
    from safetensors.torch import load_file
    from rollout.config import DEFAULT_MODEL_PATH

    base = load_file(f"{DEFAULT_MODEL_PATH}/model.safetensors")
    # the trainer's in-memory (fused-expert) names, as transformers' state_dict gives them
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_PATH, dtype=torch.float32)
    named = {k: v.detach().clone() for k, v in model.state_dict().items()}
    perturbed = {k: (v * 1.5 if k == "lm_head.weight" else v) for k, v in named.items()}
    assert base  # the checkpoint itself uses per-expert names; both layouts load

    async def go():
        async with RolloutClient(two_servers.urls) as c:
            sync = make_weight_sync(mode, c, sync_dir=str(two_servers.sync_dir))
            try:
                ref = await c.generate_groups(PROMPTS, 2, SP, seed=1, rid_prefix=f"{mode}-a-")
                r1 = await sync.push(perturbed, f"{mode}-1")
                changed = await c.generate_groups(PROMPTS, 2, SP, seed=1, rid_prefix=f"{mode}-b-")
                versions = await c.weight_versions()
                r2 = await sync.push(named, f"{mode}-2")
                back = await c.generate_groups(PROMPTS, 2, SP, seed=1, rid_prefix=f"{mode}-c-")
            finally:
                await sync.close()
            return ref, r1, changed, versions, r2, back
    ref, r1, changed, versions, r2, back = arun(go())
    assert set(versions.values()) == {f"{mode}-1"}
    assert r1.servers == tuple(two_servers.urls) and r1.bytes > 4_000_000
    assert all(s.weight_version == f"{mode}-1" for s in changed)
    assert all(s.weight_version == f"{mode}-2" for s in back)
    assert any(not torch.allclose(a.rollout_logprobs[:1], b.rollout_logprobs[:1]) for a, b in zip(ref, changed))
    for a, b in zip(ref, back):  # the original weights again: the same samples (same seeds)
        assert a.response_ids.tolist() == b.response_ids.tolist()
        assert torch.allclose(a.rollout_logprobs, b.rollout_logprobs, atol=1e-4)


def test_kill_one_of_two_servers_mid_request_loses_and_duplicates_nothing():
    long = {"temperature": 1.0, "max_new_tokens": 48, "ignore_eos": True}
    with LocalServers(2, FLAGS + ["--log-level", "warning"]) as servers:
        async def go():
            # NOTE: at most 4 in flight, so requests are still being sent to both servers after
            # the first sample arrives (with all 32 in flight at once, server 0 could have finished
            # its whole share before the kill, and nothing would fail over).
            async with RolloutClient(servers.urls, retry_backoff_s=0.0, max_concurrency=4) as c:
                killed = []

                def on_sample(s):
                    if not killed:
                        servers.servers[0].kill()
                        killed.append(s.rid)
                samples = await c.generate_groups(PROMPTS * 4, 4, long, seed=9, rid_prefix="k-",
                                                  on_sample=on_sample)
                return samples, c.loads()
        samples, loads = arun(go())
    rids = [s.rid for s in samples]
    assert len(samples) == 32 and len(set(rids)) == 32
    assert sorted(rids) == sorted(f"k-{i}-{k}" for i in range(8) for k in range(4))
    assert all(s.response_length == 48 and s.meta["finish_reason"] == "length" for s in samples)
    dead, alive = servers.urls[0], servers.urls[1]
    assert loads[dead]["alive"] is False and loads[dead]["failures"] >= 1
    assert loads[alive]["alive"] is True
    assert any(s.meta["attempts"] > 1 and s.meta["server"] == alive for s in samples)


# ---- mock servers ---------------------------------------------------------------------------------
MODEL_INFO = {"num_hidden_layers": 2, "num_experts": 4, "num_experts_per_tok": 2, "moe_layer_ids": [0, 1],
              "vocab_size": 32, "weight_version": "7", "architecture": "Mock"}


def _response(body, routing=None, finish="stop", n_out=3):
    prompt = body["input_ids"]
    out = [5 + i for i in range(n_out)]
    T = len(prompt) + len(out)
    if routing is None:
        routing = np.tile(np.array([[0, 1], [2, 3]], dtype=np.int32), (T - 1, 1, 1))
    enc = base64.b64encode(np.ascontiguousarray(routing, dtype="<i4").tobytes()).decode()
    return {"text": "x", "output_ids": out, "meta_info": {
        "id": body["rid"], "finish_reason": {"type": finish}, "prompt_tokens": len(prompt),
        "completion_tokens": len(out), "weight_version": "7",
        "output_token_logprobs": [[-0.5, t, None] for t in out], "routed_experts": enc,
        "routed_experts_start_len": 0}}


def mock_transport(behaviour):
    """behaviour(host, body, call_index) -> httpx.Response | dict | Exception."""
    calls = []

    async def handler(request: httpx.Request):
        host = request.url.host
        if request.url.path == "/model_info":
            return httpx.Response(200, json=MODEL_INFO)
        body = json.loads(request.content) if request.content else {}
        calls.append((host, request.url.path, body.get("rid")))
        res = behaviour(host, request.url.path, body, len(calls))
        if isinstance(res, Exception):
            raise res
        if isinstance(res, httpx.Response):
            return res
        return httpx.Response(200, json=res)
    return httpx.MockTransport(handler), calls


def mock_client(behaviour, n=2, **kw):
    transport, calls = mock_transport(behaviour)
    urls = [f"http://s{i}" for i in range(n)]
    return RolloutClient(urls, routing_format="int32", transport=transport, retry_backoff_s=0.0, **kw), calls


def test_mock_retry_same_rid_on_other_server_after_connect_error_and_503():
    def behaviour(host, path, body, i):
        if host == "s0":
            return httpx.ConnectError("refused")
        return _response(body)

    async def go():
        c, calls = mock_client(behaviour)
        async with c:
            samples = await c.generate_groups([[1, 2, 3]] * 3, 2, SP, rid_prefix="m-")
            return samples, calls, c.loads()
    samples, calls, loads = arun(go())
    assert [s.rid for s in samples] == [f"m-{i}-{k}" for i in range(3) for k in range(2)]
    assert all(s.meta["server"] == "http://s1" for s in samples)
    assert loads["http://s0"]["alive"] is False
    # every rid reached s1 exactly once; the retries kept the rid
    s1 = [rid for host, path, rid in calls if host == "s1" and path == "/generate"]
    assert sorted(s1) == sorted(s.rid for s in samples)

    def behaviour503(host, path, body, i):
        if host == "s0":
            return httpx.Response(503, json={"error": {"message": "engine stopped"}})
        return _response(body)
    c, calls = mock_client(behaviour503)
    sample = arun(_one(c))
    assert sample.meta["server"] == "http://s1" and c.loads()["http://s0"]["alive"] is False


def test_mock_server_restarted_with_other_weights_is_left_until_a_sync():
    """A server its supervisor restarted on the same port answers with its checkpoint's weights:
    its samples are not taken (the request goes elsewhere) and it is dead to the client."""
    def behaviour(host, path, body, i):
        out = _response(body)
        out["meta_info"]["weight_version"] = "0" if host == "s0" else "7"
        return out

    async def go():
        c, calls = mock_client(behaviour)
        async with c:
            for url in c.urls:
                c.pushed(url, "7")
            samples = await c.generate_groups([[1, 2, 3]] * 2, 2, SP, rid_prefix="v-")
            return samples, c.loads()
    samples, loads = arun(go())
    assert {s.meta["server"] for s in samples} == {"http://s1"} and {s.weight_version for s in samples} == {"7"}
    assert loads["http://s0"]["alive"] is False and "weight_version '0'" in loads["http://s0"]["last_error"]

    from trainer_bridge.client.server_state import ServerState
    state = ServerState("http://s", 0)
    assert state.holds("anything")                                      # nothing pushed: no check
    state.weight_version, state.pending_version = "1", "2"
    assert state.holds("1") and state.holds(2) and not state.holds("0")   # mid-push: old or new


async def _one(c, rid="one"):
    async with c:
        return await c.generate([1, 2, 3], SP, rid=rid)


def test_mock_timeout_retries_elsewhere_without_marking_dead():
    def behaviour(host, path, body, i):
        if path == "/abort_request":
            return {"success": True, "num_aborted": 1}
        if host == "s0":
            return httpx.ReadTimeout("slow")
        return _response(body)
    c, calls = mock_client(behaviour)
    s = arun(_one(c))
    assert s.meta["attempts"] >= 1 and s.meta["server"] == "http://s1"
    assert c.loads()["http://s0"]["alive"] is True
    assert ("s0", "/abort_request", None) in [(h, p, None) for h, p, _ in calls if p == "/abort_request"]


def test_mock_4xx_is_not_retried_and_no_server_left_is_an_error():
    def bad(host, path, body, i):
        return httpx.Response(400, json={"error": {"message": "sampling_params.top_p out of range"}})
    c, calls = mock_client(bad)
    with pytest.raises(RequestRejected, match="top_p"):
        arun(_one(c))
    assert len([x for x in calls if x[1] == "/generate"]) == 1

    def down(host, path, body, i):
        return httpx.ConnectError("refused")
    c, _ = mock_client(down)
    with pytest.raises(NoServerError, match="no live server|failed"):
        arun(_one(c))


def test_mock_server_side_abort_is_resubmitted_once_and_not_duplicated():
    state = {"aborted": False}

    def behaviour(host, path, body, i):
        if not state["aborted"]:
            state["aborted"] = True
            return _response(body, finish="abort", n_out=1)
        return _response(body)
    c, calls = mock_client(behaviour, n=1)
    s = arun(_one(c, rid="ab"))
    assert s.meta["finish_reason"] == "stop" and s.response_length == 3
    assert c.resubmitted == 1 and [rid for _, p, rid in calls if p == "/generate"] == ["ab", "ab"]


@pytest.mark.parametrize("message", ["Abort before prefill", "aborted while queued"])
def test_mock_own_abort_before_prefill_needs_no_routing_whatever_the_message(message):
    """A request this client aborted before the server computed any KV comes back with no output
    and no routed_experts: a partial sample without routing, told by the missing field (never by
    the wording of finish_reason.message)."""
    async def go():
        aborted = asyncio.Event()

        async def handler(request: httpx.Request):
            if request.url.path == "/model_info":
                return httpx.Response(200, json=MODEL_INFO)
            body = json.loads(request.content)
            if request.url.path == "/abort_request":
                aborted.set()
                return httpx.Response(200, json={"success": True, "num_aborted": 1})
            await aborted.wait()
            return httpx.Response(200, json={"text": "", "output_ids": [], "meta_info": {
                "id": body["rid"], "finish_reason": {"type": "abort", "message": message},
                "prompt_tokens": 3, "completion_tokens": 0, "output_token_logprobs": []}})
        c = RolloutClient(["http://s0"], routing_format="int32", transport=httpx.MockTransport(handler),
                          retry_backoff_s=0.0)
        async with c:
            task = asyncio.ensure_future(c.generate([1, 2, 3], SP, rid="queued"))
            while c.loads()["http://s0"]["outstanding"] == 0:
                await asyncio.sleep(0.01)
            assert await c.abort() == 1
            return await task, c.resubmitted
    s, resubmitted = arun(go())
    assert s.meta["finish_reason"] == "abort" and s.response_length == 0 and s.routed_experts is None
    assert resubmitted == 0


@pytest.mark.parametrize("routing, match", [
    (np.zeros((5, 2, 2), dtype=np.int32), "repeats an expert id"),          # duplicate ids in a row
    (np.full((5, 2, 2), 9, dtype=np.int32), r"outside \[0, 4\)"),           # id out of range
    (np.tile(np.array([[0, 1], [2, 3]], dtype=np.int32), (2, 1, 1)), "shape"),  # wrong row count
])
def test_mock_invalid_routing_is_rejected_naming_the_sample(routing, match):
    def behaviour(host, path, body, i):
        return _response(body, routing=routing)
    c, _ = mock_client(behaviour, n=1)
    with pytest.raises(SampleError, match=match) as ei:
        arun(_one(c, rid="bad-sample"))
    assert "bad-sample" in str(ei.value) and "http://s0" in str(ei.value)


def test_client_argument_errors():
    with pytest.raises(ValueError, match="at least one"):
        RolloutClient([])
    with pytest.raises(ValueError, match="routing_format"):
        RolloutClient("http://x", routing_format="json")
    with pytest.raises(ValueError, match="repeat"):
        RolloutClient(["http://x", "http://x/"[:-1]])
