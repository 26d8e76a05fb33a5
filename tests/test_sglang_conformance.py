"""The request shapes slime, Miles, AReaL and SGLang's own tests send, sent to a real rollout-serve
on loopback and parsed the way each client parses the answer. Routing is checked against
transformers' router top-k; the shapes are carried over from the clients' sources (paths in the
comments)."""
import base64
import datetime
import json
import random
import threading

import httpx
import numpy as np
import pytest
import torch

from oracle import hf_router_topk, same_sets
from rollout.config import DEFAULT_MODEL_PATH
from server_proc import ServerProcess, free_port, sse_events, wait_idle

pytestmark = pytest.mark.timeout(300)
L, K = 4, 4  # the embedded tiny MoE: every layer MoE, top-4


def prompt(seed, n, vocab=576):
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def oracle(seq):
    return hf_router_topk(DEFAULT_MODEL_PATH, seq[:-1], K, L)


@pytest.fixture(scope="module")
def server():
    with ServerProcess(["--enable-return-routed-experts", "--dtype", "float32"]) as srv:
        yield srv
        assert srv.alive, srv.log()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


# ---- slime ---------------------------------------------------------------------------------------
def slime_sampling_params(top_p=0.9):
    # slime/rollout/sglang_rollout.py (GenerateState.__init__): every field explicit, custom_params when top_p < 1
    params = dict(temperature=0.0, top_p=top_p, top_k=-1, max_new_tokens=10, stop=None, stop_token_ids=None,
                  skip_special_tokens=False, no_stop_trim=True, spaces_between_special_tokens=False)
    if top_p != 1.0:
        params["custom_params"] = {"return_top_p_token_ids": True}
    return params


def prompt_without_eos(client, seed, n, params):
    """A prompt whose greedy continuation under params runs to max_new_tokens (slime sends no ignore_eos)."""
    for k in range(50):
        ids = prompt(seed * 100 + k, n)
        meta = client.post("/generate", json={"input_ids": ids, "sampling_params": params}).json()["meta_info"]
        if meta["finish_reason"]["type"] == "length":
            return ids
    raise AssertionError("every prompt hit EOS")


def test_slime_generate(client):
    ids = prompt_without_eos(client, 1, 13, slime_sampling_params())
    # slime/rollout/sglang_rollout.py (generate): payload
    payload = {"sampling_params": slime_sampling_params(), "return_logprob": True, "return_routed_experts": True,
               "input_ids": ids}
    r = client.post("/generate", json=payload)
    assert r.status_code == 200, r.text
    output = r.json()
    meta = output["meta_info"]
    response_tokens = [item[1] for item in meta["output_token_logprobs"]]
    assert response_tokens == output["output_ids"] and len(response_tokens) == 10
    tokens = ids + response_tokens
    # slime (Sample routed experts): np.frombuffer(b64decode(s), int32).reshape(len(tokens) - 1, L, K)
    routing = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype=np.int32).reshape(len(tokens) - 1, L, K)
    assert same_sets(torch.from_numpy(routing.copy()), oracle(tokens))
    for key in ("id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "weight_version",
                "e2e_latency", "total_retractions", "input_token_logprobs"):
        assert key in meta, key
    assert meta["e2e_latency"] > 0 and meta["input_token_logprobs"] == [[None, ids[-1], None]]


@pytest.mark.parametrize("dtype", ["int32", "uint8"])
def test_slime_streaming_is_cumulative(client, dtype):
    ids = prompt_without_eos(client, 2, 9, slime_sampling_params(1.0))
    # slime/rollout/sglang_streaming_rollout.py (generate_streaming): payload; each chunk REPLACES the lists
    payload = {"sampling_params": slime_sampling_params(1.0), "return_logprob": True, "stream": True,
               "return_routed_experts": True, "routed_experts_dtype": dtype, "input_ids": ids}
    call_tokens, call_text, last_meta, chunks = [], "", {}, 0
    with client.stream("POST", "/generate", json=payload) as r:
        assert r.status_code == 200
        for chunk in sse_events(r):
            meta = chunk.get("meta_info") or {}
            last_meta = meta
            call_text = chunk.get("text", call_text)
            if "output_token_logprobs" in meta:
                call_tokens = [item[1] for item in meta["output_token_logprobs"]]
            assert chunk["output_ids"] == call_tokens  # cumulative, as SGLang by default
            chunks += 1
    assert chunks == 10 and last_meta["finish_reason"]["type"] == "length"
    whole = client.post("/generate", json={**payload, "stream": False, "routed_experts_dtype": None}).json()
    assert call_tokens == whole["output_ids"] and call_text == whole["text"]
    np_dtype = {"int32": np.int32, "uint8": np.uint8}[dtype]
    routing = np.frombuffer(base64.b64decode(last_meta["routed_experts"]), dtype=np_dtype)
    routing = torch.from_numpy(routing.astype(np.int32)).reshape(len(ids) + len(call_tokens) - 1, L, K)
    assert same_sets(routing, oracle(ids + call_tokens))


def test_slime_server_info(client):
    # slime external-engine start-up: GET /server_info, reads enable_memory_saver (bool)
    info = client.get("/server_info").json()
    assert isinstance(info["enable_memory_saver"], bool)
    for key in ("tp_size", "dp_size", "enable_dp_attention", "enable_return_routed_experts", "model_path",
                "internal_states", "version", "max_total_num_tokens"):
        assert key in info, key
    assert client.get("/get_server_info").json()["model_path"] == info["model_path"]
    model = client.get("/get_model_info").json()
    assert model["is_generation"] is True and model["num_experts_per_tok"] == K and "model_type" in model


# ---- Miles ---------------------------------------------------------------------------------------
def test_miles_retract_flush_continue(client):
    ids = prompt(3, 11)
    # Miles: return_indexer_topk: false top-level on every request
    body = {"input_ids": ids, "sampling_params": {"temperature": 0.0, "max_new_tokens": 150, "ignore_eos": True},
            "return_logprob": True, "return_routed_experts": True, "return_indexer_topk": False, "stream": True}
    chunks, started = [], threading.Event()

    def read():
        with client.stream("POST", "/generate", json=body) as r:
            for ev in sse_events(r):
                chunks.append(ev)
                started.set()

    reader = threading.Thread(target=read)
    reader.start()
    assert started.wait(60)
    # Miles: pause with retract, then loop on /flush_cache until 200
    assert client.post("/pause_generation", json={"mode": "retract"}).json()["status"] == "ok"
    for _ in range(50):
        if client.post("/flush_cache").status_code == 200:
            break
    else:
        raise AssertionError("flush_cache never succeeded after a retract pause")
    r = client.post("/update_weight_version", json={"new_version": "miles-2", "abort_all_requests": False})
    assert r.status_code == 200 and r.json()["success"], r.text
    assert client.post("/continue_generation", json={}).json()["status"] == "ok"
    reader.join(600)
    assert not reader.is_alive()
    final = chunks[-1]
    out = final["output_ids"]
    assert final["meta_info"]["finish_reason"]["type"] == "length" and len(out) == 150
    assert final["meta_info"]["weight_version"] == "miles-2"
    assert final["meta_info"]["total_retractions"] == 1
    routing = np.frombuffer(base64.b64decode(final["meta_info"]["routed_experts"]), np.int32)
    assert same_sets(torch.from_numpy(routing.copy()).reshape(len(ids) + len(out) - 1, L, K), oracle(ids + out))
    client.post("/update_weight_version", json={"new_version": "default"})


# ---- AReaL ---------------------------------------------------------------------------------------
def test_areal_generate(client):
    ids = prompt(4, 10)
    # areal/engine/sglang_remote.py (agenerate): payload
    payload = {"input_ids": ids, "image_data": None,
               "sampling_params": {"top_p": 1.0, "top_k": -1, "max_new_tokens": 8, "temperature": 0.0,
                                   "stop_token_ids": [], "ignore_eos": True, "skip_special_tokens": True,
                                   "frequency_penalty": 0.0},
               "return_logprob": True, "stream": False, "return_routed_experts": True}
    result = client.post("/generate", json=payload).json()
    meta = result["meta_info"]
    assert meta["finish_reason"]["type"] == "length"
    output_tokens = [x[1] for x in meta["output_token_logprobs"]]
    # AReaL reshapes the routing to (prompt + completion - 1, -1)
    flat = np.frombuffer(base64.b64decode(meta["routed_experts"]), np.int32)
    routing = flat.reshape(meta["prompt_tokens"] + meta["completion_tokens"] - 1, -1)
    assert routing.shape[1] == L * K
    assert same_sets(torch.from_numpy(routing.copy()).reshape(-1, L, K), oracle(ids + output_tokens))
    bad = client.post("/generate", json={**payload, "image_data": ["data:image/png;base64,AAAA"]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "image_data"


def test_areal_weight_sync_shapes(client):
    # areal/engine/sglang_remote.py (update_weights): POST /pause_generation with no body
    r = client.post("/pause_generation")
    assert r.status_code == 200 and r.json()["status"] == "ok"
    # update_weights_from_disk: dict(model_path=..., abort_all_request=True) (sic: an unknown field, ignored)
    r = client.post("/update_weights_from_disk", json={"model_path": DEFAULT_MODEL_PATH, "abort_all_request": True})
    assert r.status_code == 200 and r.json()["success"] and r.json()["num_paused_requests"] == 0, r.text
    assert client.post("/continue_generation").status_code == 200
    # ainit_weights_update_group: master_port as a STRING
    import torch.distributed as dist

    from trainer_bridge.weight_sync import init_custom_process_group

    port = free_port()
    answer = {}
    t = threading.Thread(target=lambda: answer.update(r=client.post("/init_weights_update_group", json={
        "master_address": "127.0.0.1", "master_port": str(port), "rank_offset": 1, "world_size": 2,
        "group_name": "areal-test", "backend": "gloo"})))
    t.start()
    pg = init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", 2, 0, "areal-test",
                                   datetime.timedelta(seconds=60))
    t.join(60)
    assert answer["r"].status_code == 200 and answer["r"].json()["success"], answer["r"].text
    assert client.post("/destroy_weights_update_group", json={"group_name": "areal-test"}).status_code == 200
    dist.destroy_process_group(pg)
    bad = client.post("/init_weights_update_group", json={"master_address": "127.0.0.1", "master_port": "x1",
                                                          "rank_offset": 1, "world_size": 2})
    assert bad.status_code == 400 and "master_port" in bad.json()["message"]


# ---- SGLang's own test_return_routed_experts.py -------------------------------------------------
def test_sglang_routed_experts_test_payloads(client):
    ids = prompt(5, 12)
    # test/srt/test_return_routed_experts.py: a stray top-level max_new_tokens (ignored, counted)
    r = client.post("/generate", json={"input_ids": ids, "max_new_tokens": 5, "return_routed_experts": True,
                                       "sampling_params": {"temperature": 0, "max_new_tokens": 6,
                                                           "ignore_eos": True}})
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 6
    native = r.json()
    # the OpenAI path reads response["sglext"]["routed_experts"]
    res = client.post("/v1/completions", json={"model": "tiny-moe", "prompt": ids, "max_tokens": 6,
                                               "temperature": 0, "ignore_eos": True, "return_routed_experts": True,
                                               "return_token_ids": True}).json()
    assert res["sglext"]["routed_experts"] == native["meta_info"]["routed_experts"]
    assert res["choices"][0]["token_ids"] == native["output_ids"] and res["choices"][0]["prompt_token_ids"] == ids
    metrics = client.get("/metrics").text
    assert 'rollout_ignored_fields_total{endpoint="/generate",field="max_new_tokens"}' in metrics
    # n > 1: each choice also carries its own routing
    res = client.post("/v1/completions", json={"model": "tiny-moe", "prompt": ids, "max_tokens": 3, "n": 2,
                                               "temperature": 1.0, "seed": 3, "return_routed_experts": True}).json()
    assert [c["sglext"]["routed_experts"] for c in res["choices"]][0] == res["sglext"]["routed_experts"]
    models = client.get("/v1/models").json()["data"][0]
    assert models["object"] == "model" and models["max_model_len"] > 0


# ---- GenerateReqInput fields -----------------------------------------------------------------------
def test_cache_salt_isolates_prefix_cache(client):
    wait_idle(client)
    assert client.post("/flush_cache").status_code == 200
    ids = prompt(6, 40)
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 2}, "return_routed_experts": True}

    def cached(**extra):
        return client.post("/generate", json={**body, **extra}).json()["meta_info"]

    first = cached(cache_salt="alice")
    assert first["cached_tokens"] == 0
    assert cached(cache_salt="alice")["cached_tokens"] > 0        # same salt: shared
    assert cached(cache_salt="bob")["cached_tokens"] == 0         # other salt: never shared
    assert cached()["cached_tokens"] == 0                          # no salt: its own space
    assert cached(extra_key="lora-a", cache_salt="alice")["cached_tokens"] == 0
    hit = cached(cache_salt="bob")
    assert hit["cached_tokens"] > 0 and hit["routed_experts"] == first["routed_experts"]


def test_stop_regex_and_per_prompt_lists(client):
    a, b = prompt(7, 8), prompt(8, 6)
    greedy = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    base = client.post("/generate", json={"input_ids": a, "sampling_params": greedy}).json()
    target = base["text"][3:6]
    assert target
    import re
    r = client.post("/generate", json={"input_ids": a, "sampling_params": {**greedy, "stop_regex": re.escape(target),
                                                                            "stop": None}}).json()
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": target}
    assert base["text"].startswith(r["text"]) and target not in r["text"]
    bad = client.post("/generate", json={"input_ids": a, "sampling_params": {"stop_regex": "(unclosed"}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "stop_regex"
    # per-prompt lists and one string rid for a batch (rid_i)
    r = client.post("/generate", json={"input_ids": [a, b], "rid": "batch", "sampling_params": greedy,
                                       "return_logprob": [True, False], "top_logprobs_num": [2, 0],
                                       "return_routed_experts": [False, True]}).json()
    assert [o["meta_info"]["id"] for o in r] == ["batch_0", "batch_1"]
    assert len(r[0]["meta_info"]["output_top_logprobs"][0]) == 2 and "routed_experts" not in r[0]["meta_info"]
    assert "output_token_logprobs" not in r[1]["meta_info"] and "routed_experts" in r[1]["meta_info"]
    bad = client.post("/generate", json={"input_ids": [a, b], "return_logprob": [True]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "return_logprob"


def test_abort_request_shapes(client):
    assert client.post("/abort_request", json={}).json() == {"success": True, "num_aborted": 0}
    assert client.post("/abort_request", json={"rid": ""}).json()["num_aborted"] == 0
    assert client.post("/abort_request", json={"abort_all": True}).status_code == 200


def test_pickled_tensors_need_the_flag(client):
    payload = base64.b64encode(b"\x80\x04N.").decode()  # a pickle (of None)
    r = client.post("/update_weights_from_tensor", json={"serialized_named_tensors": [payload],
                                                          "load_format": "flattened_bucket", "flush_cache": True})
    assert r.status_code == 400 and "--allow-pickled-weight-tensors" in r.json()["message"]
    assert json.loads(r.text)["success"] is False


# ---- trainer_bridge against an SGLang-shaped server -------------------------------------------------
SGLANG_MODEL_INFO = ("model_path", "tokenizer_path", "is_generation", "preferred_sampling_params", "weight_version",
                     "has_image_understanding", "has_audio_understanding", "model_type", "architectures")


class SGLangLike(httpx.AsyncBaseTransport):
    """Forwards to the real server what SGLang would see and answers what SGLang would answer: a
    /model_info without our routing-shape fields, and /generate bodies without our extensions
    (SGLang ignores routed_experts_format and incremental_streaming_output: int32, cumulative)."""

    def __init__(self):
        self.inner = httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request):
        if request.url.path == "/generate":
            body = json.loads(request.content)
            body.pop("routed_experts_format", None)
            body.pop("incremental_streaming_output", None)
            request = httpx.Request(request.method, request.url, json=body,
                                    headers={k: v for k, v in request.headers.items() if k != "content-length"})
        response = await self.inner.handle_async_request(request)
        if request.url.path == "/model_info":
            await response.aread()
            info = {k: v for k, v in response.json().items() if k in SGLANG_MODEL_INFO}
            return httpx.Response(200, json=info)
        return response


@pytest.mark.parametrize("stream", [False, True])
def test_trainer_bridge_client_against_sglang_shapes(server, stream):
    import asyncio

    from trainer_bridge.client import RolloutClient

    params = {"temperature": 1.0, "max_new_tokens": 6}

    async def go(transport, model_config):
        async with RolloutClient(server.url, stream=stream, transport=transport, model_config=model_config) as c:
            return c.info, await c.generate_groups([prompt(9, 10), prompt(10, 7)], 2, params, seed=5,
                                                   rid_prefix=f"{stream}-{transport is not None}-")
    info, like = asyncio.run(go(SGLangLike(), None))   # the model_path /model_info reports is readable here
    assert (info.num_layers, info.top_k, info.num_experts) == (L, K, 16)
    _, ours = asyncio.run(go(None, None))
    for a, b in zip(like, ours):
        assert a.response_ids.tolist() == b.response_ids.tolist()
        assert torch.equal(a.routed_experts, b.routed_experts)
        assert torch.allclose(a.rollout_logprobs, b.rollout_logprobs, atol=1e-5)


# ---- prompt logprobs (AReaL teacher scoring, slime on-policy distillation) ---------------------------
def test_prompt_logprobs_match_transformers_with_and_without_cache(client):
    from oracle import hf_model

    seq = prompt(11, 30)
    with torch.no_grad():
        logits = hf_model(DEFAULT_MODEL_PATH)(torch.tensor([seq])).logits[0].float()
    ref = torch.log_softmax(logits, dim=-1)[torch.arange(len(seq) - 1), torch.tensor(seq[1:])]   # [len - 1]
    target = 12
    # areal teacher scoring: logprob_start_len = len - target - 1, max_new_tokens 1, reads input_token_logprobs
    body = {"input_ids": seq, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}, "return_logprob": True,
            "logprob_start_len": len(seq) - target - 1, "top_logprobs_num": 2}
    wait_idle(client)
    assert client.post("/flush_cache").status_code == 200
    warm = client.post("/generate", json={**body, "logprob_start_len": -1}).json()   # caches the whole prompt
    assert warm["meta_info"]["input_token_logprobs"] == [[None, seq[-1], None]]
    for _ in range(2):   # the second one also finds the prompt cached
        meta = client.post("/generate", json=body).json()["meta_info"]
        itl = meta["input_token_logprobs"]
        assert meta["prompt_tokens"] == body["logprob_start_len"] + len(itl)   # SGLang's invariant
        assert meta["cached_tokens"] == body["logprob_start_len"]   # the hit, shortened to where logits are needed
        assert itl[0][0] is None and [t for _, t, _ in itl] == seq[-target - 1:]
        got = torch.tensor([lp for lp, _, _ in itl[1:]])
        assert torch.allclose(got, ref[-target:], atol=1e-4), (got - ref[-target:]).abs().max()
        top = meta["input_top_logprobs"]
        assert top[0] is None and len(top) == len(itl) and all(len(row) == 2 for row in top[1:])
        assert all(row[0][0] >= lp for row, (lp, _, _) in zip(top[1:], itl[1:]))
    # slime on-policy distillation: logprob_start_len 0, reads input_token_logprobs[1:]
    meta = client.post("/generate", json={**body, "logprob_start_len": 0, "top_logprobs_num": 0}).json()["meta_info"]
    got = torch.tensor([item[0] for item in meta["input_token_logprobs"][1:]])
    assert torch.allclose(got, ref, atol=1e-4) and "input_top_logprobs" not in meta


# ---- colocated offload: release / resume memory occupation ----------------------------------------
def test_release_and_resume_memory_occupation(server, client):
    import psutil

    ids = prompt(12, 9)
    greedy = {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True}
    before = client.post("/generate", json={"input_ids": ids, "sampling_params": greedy,
                                            "return_routed_experts": True}).json()
    wait_idle(client)
    # NOTE: the KV pool and the weights live in the engine process (the server's child)
    (proc,) = [p for p in psutil.Process(server._server.proc.pid).children()
               if "rollout.core.engine_proc" in p.cmdline()]
    mem0 = proc.memory_info()
    r = client.post("/release_memory_occupation", json={"tags": ["kv_cache", "weights"]})
    assert r.status_code == 200 and r.json()["released"] == ["weights", "kv_cache"], r.text
    # the KV pool (512 MiB by default, resident only where slots were used) and the weights'
    # storage went back to the OS: unmapped from the process
    mem = proc.memory_info()
    assert mem.vms < mem0.vms - 256 * 2**20, (mem0, mem)
    refused = client.post("/generate", json={"input_ids": ids, "sampling_params": greedy})
    assert refused.status_code == 400 and "resume_memory_occupation" in refused.json()["error"]["message"]
    r = client.post("/update_weights_from_disk", json={"model_path": DEFAULT_MODEL_PATH})
    assert r.status_code == 400 and "released" in r.json()["message"]
    assert client.post("/resume_memory_occupation", json={"tags": ["weights"]}).json()["released"] == ["kv_cache"]
    assert client.post("/resume_memory_occupation", json={}).json()["released"] == []
    after = client.post("/generate", json={"input_ids": ids, "sampling_params": greedy,
                                           "return_routed_experts": True}).json()
    assert after["output_ids"] == before["output_ids"]     # nothing lost: same weights, working KV
    assert after["meta_info"]["routed_experts"] == before["meta_info"]["routed_experts"]
    assert after["meta_info"]["cached_tokens"] == 0        # the cache went with the KV pool
    bad = client.post("/release_memory_occupation", json={"tags": ["gpu"]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tags"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_release_memory_frees_gpu_memory():
    from rollout import Rollout

    # NOTE: the engine lives in its own process: this process's allocator sees none of its memory;
    # the device's free memory (what nvidia-smi reads) does
    with Rollout(DEFAULT_MODEL_PATH, device="cuda", dtype="float32", kv_cache_bytes=256 << 20) as engine:
        ids = prompt(13, 8)
        params = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
        before = engine.generate(input_ids=[ids], sampling_params=params)[0].output_ids
        free = torch.cuda.mem_get_info()[0]
        assert engine.release_memory_occupation(["kv_cache", "weights"]) == ["weights", "kv_cache"]
        assert torch.cuda.mem_get_info()[0] > free + (200 << 20), (free, torch.cuda.mem_get_info()[0])
        assert engine.resume_memory_occupation(None) == ["weights", "kv_cache"]
        assert engine.generate(input_ids=[ids], sampling_params=params)[0].output_ids == before
