"""rollout-serve against hostile input and a racing client: lone surrogates in every string field,
weights whose logits overflow, and a keep-alive connection the server closes as the client
writes to it. The server keeps serving, nothing is applied half-way, KV ends idle."""
import asyncio
import json

import httpcore
import httpx
import pytest
import torch
from safetensors.torch import load_file, save

from reliability_server import (GREEDY, admin, assert_idle_and_clean, check_routing, health_probe,  # noqa: F401
                                prompts, server, shape, weight_dir)
from rollout.config import DEFAULT_MODEL_PATH
from server_proc import ServerProcess, wait_idle
from trainer_bridge.client import RolloutClient

pytestmark = pytest.mark.timeout(600)
SURROGATE = "\ud800"


# ---- invalid Unicode ---------------------------------------------------------------------------
BODIES = {
    "/generate": {"text": ["hi", "there"], "sampling_params": {"max_new_tokens": 2, "stop": ["x"]}, "rid": "ok"},
    "/v1/completions": {"model": "m", "prompt": "hi", "max_tokens": 2, "stop": ["x"], "user": "u"},
    "/v1/chat/completions": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/abort_request": {"rid": "x", "abort_message": "m"},
    "/pause_generation": {"mode": "retract"},
    "/continue_generation": {},
    "/update_weights_from_disk": {"model_path": DEFAULT_MODEL_PATH, "weight_version": "v2"},
    "/update_weights_from_tensor": {"serialized_named_tensors": "AAAA", "weight_version": "v2"},
    "/init_weights_update_group": {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1,
                                   "world_size": 2, "group_name": "g", "backend": "gloo"},
    "/update_weights_from_distributed": {"names": ["lm_head.weight"], "dtypes": ["float32"], "shapes": [[1]],
                                         "weight_version": "v2"},
    "/destroy_weights_update_group": {"group_name": "g"},
}


def _string_paths(obj, path=""):
    if isinstance(obj, str):
        yield path
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _string_paths(v, f"{path}.{k}" if path else k)
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _string_paths(v, f"{path}[{i}]")


def _poison(obj, path):
    obj = json.loads(json.dumps(obj))
    parts = path.replace("[", ".[").split(".")
    parent = obj
    for part in parts[:-1]:
        parent = parent[int(part[1:-1])] if part.startswith("[") else parent[part]
    last = parts[-1]
    if last.startswith("["):
        parent[int(last[1:-1])] = "ok" + SURROGATE
    else:
        parent[last] = "ok" + SURROGATE
    return obj


def test_lone_surrogates_in_every_string_field_get_400(server, admin):
    version = admin.get("/get_weight_version").json()["weight_version"]
    cases = 0
    for path, body in BODIES.items():
        poisoned = [(p, _poison(body, p)) for p in _string_paths(body)]
        poisoned.append(("name", {**body, "field" + SURROGATE: 1}))
        if "sampling_params" in body:
            poisoned.append(("sampling_params.name",
                             {**body, "sampling_params": {**body["sampling_params"], SURROGATE: 1}}))
        for where, bad in poisoned:
            raw = json.dumps(bad)                      # ensure_ascii: the surrogate goes as \ud800
            assert "\\ud800" in raw
            r = admin.post(path, content=raw, headers={"content-type": "application/json"})
            assert r.status_code == 400, (path, where, r.status_code, r.text)
            err = r.json()["error"]
            assert "not valid Unicode" in err["message"], (path, where, err)
            if where not in ("name", "sampling_params.name"):
                assert err["param"] == where, (path, where, err)
            cases += 1
    assert cases >= 30
    # pairs are fine; a printable-less or oversized weight_version is refused before any update
    r = admin.post("/generate", json={"text": "\U0001F600 hi", "sampling_params": GREEDY})
    assert r.status_code == 200, r.text
    for bad in ("a\nb", "\x00", "x" * 257, ""):
        r = admin.post("/update_weights_from_disk", json={"model_path": DEFAULT_MODEL_PATH, "weight_version": bad})
        assert r.status_code == 400 and "weight_version" in r.json()["message"], r.text
    assert admin.get("/get_weight_version").json()["weight_version"] == version
    assert admin.get("/v1/loads").json()["paused"] is None
    for path in ("/model_info", "/server_info", "/get_weight_version", "/health"):
        assert admin.get(path).status_code == 200
    assert_idle_and_clean(admin)


# ---- non-finite logits -------------------------------------------------------------------------
def _metric(admin, name):
    for line in admin.get("/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.split()[-1])
    raise AssertionError(f"metric {name} missing")


def _push(admin, tensors, version):
    r = admin.post(f"/update_weights_from_tensor?weight_version={version}", content=save(tensors),
                   headers={"content-type": "application/octet-stream"})
    assert r.status_code == 200 and r.json()["success"], r.text


def test_overflowing_logits_abort_with_message_and_metric(server, admin, shape):
    head = load_file(f"{DEFAULT_MODEL_PATH}/model.safetensors")["lm_head.weight"].float()
    before = _metric(admin, "rollout_engine_nonfinite_logits_aborts_total")
    # finite weights (the largest is 3e38), logits that overflow float32
    _push(admin, {"lm_head.weight": (head.double() * (3e38 / head.abs().max().item())).float()}, "overflow")
    try:
        ps = prompts(7, [6, 9, 11])
        for stream in (False, True):
            for p in ps:
                body = {"input_ids": p, "sampling_params": GREEDY, "return_logprob": True,
                        "return_routed_experts": True, "stream": stream}
                r = admin.post("/generate", json=body)
                assert r.status_code == 200, r.text
                if stream:
                    events = [json.loads(line[6:]) for line in r.text.splitlines()
                              if line.startswith("data: {")]
                    meta = events[-1]["meta_info"]
                    lps = sum((e["meta_info"].get("output_token_logprobs") or [] for e in events), [])
                else:
                    meta = r.json()["meta_info"]
                    lps = meta["output_token_logprobs"]
                finish = meta["finish_reason"]
                assert finish["type"] == "abort" and finish["err_type"] == "NonFiniteLogits", finish
                assert "non-finite logits" in finish["message"]
                assert all(lp[0] is not None for lp in lps)
        assert _metric(admin, "rollout_engine_nonfinite_logits_aborts_total") == before + 6
        assert_idle_and_clean(admin)
    finally:
        _push(admin, {"lm_head.weight": head}, "restored")
    r = admin.post("/generate", json={"input_ids": ps[0], "sampling_params": GREEDY, "return_routed_experts": True})
    assert r.json()["meta_info"]["finish_reason"]["type"] == "length"
    check_routing({**r.json(), "_prompt": ps[0]}, shape)


# ---- keep-alive race ---------------------------------------------------------------------------
class _StallingStream(httpcore.AsyncNetworkStream):
    """A connection whose first write after it served a response can be held back (a client
    stall between taking a pooled connection and writing to it: GC, a busy event loop)."""

    def __init__(self, inner, backend):
        self.inner, self.backend, self.served = inner, backend, False

    async def read(self, max_bytes, timeout=None):
        data = await self.inner.read(max_bytes, timeout)
        self.served = True
        return data

    async def write(self, buffer, timeout=None):
        if self.served and self.backend.stall_s:
            stall, self.backend.stall_s = self.backend.stall_s, 0.0
            await asyncio.sleep(stall)
        await self.inner.write(buffer, timeout)

    async def aclose(self):
        await self.inner.aclose()

    async def start_tls(self, *a, **kw):
        return await self.inner.start_tls(*a, **kw)

    def get_extra_info(self, info):
        return self.inner.get_extra_info(info)


class _StallingBackend(httpcore.AsyncNetworkBackend):
    def __init__(self):
        self.inner = httpcore.AnyIOBackend()
        self.stall_s = 0.0

    async def connect_tcp(self, *a, **kw):
        return _StallingStream(await self.inner.connect_tcp(*a, **kw), self)

    async def sleep(self, seconds):
        await self.inner.sleep(seconds)


def _stalling_transport():
    backend = _StallingBackend()
    transport = httpx.AsyncHTTPTransport()
    # NOTE: the client's own pool expiry far above the server's, as with httpx's defaults vs a
    # short server keep-alive; the stall is what makes the race deterministic.
    transport._pool = httpcore.AsyncConnectionPool(network_backend=backend, keepalive_expiry=60.0)
    return transport, backend


async def _reuse_after_stall(url, idle_s, stall_s):
    """One request, idle_s on an idle pooled connection, then a request stalled stall_s."""
    transport, backend = _stalling_transport()
    async with httpx.AsyncClient(base_url=url, transport=transport, timeout=60) as c:
        assert (await c.get("/health")).status_code == 200
        await asyncio.sleep(idle_s)
        backend.stall_s = stall_s
        return await c.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": GREEDY})


@pytest.mark.slow
def test_keep_alive_default_outlasts_client_stall(server):
    """Default --timeout-keep-alive (75 s): a connection idle 4 s then stalled 2 s (past uvicorn's
    old 5 s default) is still open."""
    r = asyncio.run(_reuse_after_stall(server.url, 4.0, 2.0))
    assert r.status_code == 200 and r.json()["meta_info"]["finish_reason"]["type"] == "length"


def test_keep_alive_race_is_retried_by_the_client(tmp_path):
    with ServerProcess(["--timeout-keep-alive", "1"]) as srv:
        # the race itself, reproduced: a plain client fails before any response byte
        with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)):
            asyncio.run(_reuse_after_stall(srv.url, 0.2, 2.0))

        async def with_client():
            transport, backend = _stalling_transport()
            async with RolloutClient(srv.url, transport=transport, return_routed_experts=False) as client:
                first = await client.generate([5, 6, 7], GREEDY)
                await asyncio.sleep(0.2)
                backend.stall_s = 2.0
                second = await client.generate([5, 6, 7], GREEDY)
                return client, first, second

        client, first, second = asyncio.run(with_client())
        assert client.stale_retries == 1 and client.resubmitted == 0
        assert all(s.failures == 0 for s in client.servers)
        assert torch.equal(torch.as_tensor(second.response_ids), torch.as_tensor(first.response_ids))
        assert len(second.response_ids) == GREEDY["max_new_tokens"]
        with httpx.Client(base_url=srv.url) as c:
            wait_idle(c)
        assert srv.alive
