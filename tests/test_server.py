"""rollout-serve as a real process on loopback, driven by real HTTP clients (httpx, openai).

One server (embedded tiny MoE, routing on, user + admin API keys) serves the whole module; an
in-process Rollout on the same model is the Python-API reference, transformers the oracle.
"""
import asyncio
import json
import random
import threading
import time

import httpx
import pytest
import torch

from capture.codec import decode_routed_experts
from oracle import hf_router_topk, same_sets
from rollout import Rollout
from rollout.config import DEFAULT_MODEL_PATH
from server_proc import ServerProcess, sse_events, wait_idle

pytestmark = pytest.mark.timeout(300)
API_KEY, ADMIN_KEY = "user-key-123", "admin-key-456"
GREEDY = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}
LIMIT = 1 << 20


def prompts(seed, lengths, vocab=576):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def server():
    with ServerProcess(["--enable-return-routed-experts", "--enable-debug-endpoints", "--api-key", API_KEY,
                        "--admin-api-key", ADMIN_KEY, "--max-request-bytes", str(LIMIT), "--dtype", "float32"]) as srv:
        yield srv
        assert srv.alive, srv.log()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=60, headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        yield c


@pytest.fixture(scope="module")
def admin(server):
    with httpx.Client(base_url=server.url, timeout=60, headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as c:
        yield c


@pytest.fixture(scope="module")
def ref():
    with Rollout(DEFAULT_MODEL_PATH, dtype="float32", enable_return_routed_experts=True) as engine:
        yield engine


@pytest.fixture(scope="module")
def shape(client):
    info = client.get("/model_info").json()
    return info["num_hidden_layers"], info["num_experts_per_tok"]


def decode(meta, fmt, shape):
    if fmt == "compact":
        return decode_routed_experts(meta["routed_experts"], "compact")
    return decode_routed_experts(meta["routed_experts"], "int32", num_layers=shape[0], top_k=shape[1])


def check_oracle(seq, routing, start=0):
    ref = hf_router_topk(DEFAULT_MODEL_PATH, seq[:-1], routing.shape[2], routing.shape[1])[start:]
    assert same_sets(routing, ref), (routing.shape, ref.shape)


def assert_clean(admin):
    wait_idle(admin)
    assert admin.post("/flush_cache").status_code == 200
    state = admin.get("/debug/integrity").json()
    assert state["ok"] and state["kv_used"] == 0 and state["running"] == 0 and state["waiting"] == 0, state


# ---- /generate -----------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["int32", "compact"])
def test_generate_routing_matches_python_api_and_oracle(client, ref, shape, fmt):
    batch = prompts(1, [4, 17, 33])
    body = {"input_ids": batch, "sampling_params": GREEDY, "return_logprob": True, "return_routed_experts": True,
            "routed_experts_format": fmt}
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    outs = r.json()
    local = ref.generate(input_ids=batch, sampling_params=GREEDY, return_logprob=True, return_routed_experts=True)
    assert isinstance(outs, list) and len(outs) == 3
    for prompt, out, loc in zip(batch, outs, local):
        meta = out["meta_info"]
        assert out["output_ids"] == loc.output_ids and out["text"] == loc.text
        assert meta["prompt_tokens"] == len(prompt) and meta["completion_tokens"] == 12
        assert meta["finish_reason"] == {"type": "length", "length": 12}
        assert [t for _, t, _ in meta["output_token_logprobs"]] == out["output_ids"]
        assert torch.allclose(torch.tensor([lp for lp, _, _ in meta["output_token_logprobs"]]),
                              torch.tensor(loc.output_logprobs), atol=1e-5)
        routing = decode(meta, fmt, shape)
        assert routing.shape == (len(prompt) + 12 - 1, *shape) and meta["routed_experts_start_len"] == 0
        assert same_sets(routing, loc.routed_experts)
        check_oracle(prompt + out["output_ids"], routing)


def test_generate_text_single_batch_and_n(client, ref):
    single = client.post("/generate", json={"text": "The quick brown fox", "sampling_params": GREEDY})
    assert single.status_code == 200, single.text
    one = single.json()
    assert isinstance(one, dict) and one["meta_info"]["prompt_tokens"] == len(ref.tokenizer.encode("The quick brown fox"))
    assert "routed_experts" not in one["meta_info"] and "output_token_logprobs" not in one["meta_info"]
    texts = ["Hello there", "One two three four"]
    batch = client.post("/generate", json={"text": texts, "sampling_params": {**GREEDY, "n": 2},
                                           "rid": ["a-req", "b-req"]}).json()
    assert [o["meta_info"]["id"] for o in batch] == ["a-req_0", "a-req_1", "b-req_0", "b-req_1"]
    local = ref.generate(texts, {**GREEDY, "n": 2})
    assert [o["output_ids"] for o in batch] == [o.output_ids for o in local]
    n_single = client.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": {**GREEDY, "n": 3}}).json()
    assert isinstance(n_single, list) and len(n_single) == 3
    ids = client.post("/generate", json={"input_ids": ref.tokenizer.encode("The quick brown fox"),
                                         "sampling_params": GREEDY}).json()
    assert ids["output_ids"] == one["output_ids"]
    # per-prompt n: each output's prompt-side fields come from its own prompt
    mixed = client.post("/generate", json={"input_ids": [[5, 6, 7], [8, 9, 10, 11, 12]], "return_logprob": True,
                                           "logprob_start_len": 0,
                                           "sampling_params": [{**GREEDY, "n": 1}, {**GREEDY, "n": 3}]}).json()
    assert [[e[1] for e in o["meta_info"]["input_token_logprobs"]] for o in mixed] == [[5, 6, 7]] + [[8, 9, 10, 11, 12]] * 3


@pytest.mark.parametrize("fmt,interval", [("int32", None), ("compact", None), ("int32", 3)])
def test_stream_chunks_concatenate_to_final(client, shape, fmt, interval):
    batch = prompts(2, [9, 21])
    body = {"input_ids": batch, "sampling_params": {**GREEDY, "max_new_tokens": 10}, "return_logprob": True,
            "return_routed_experts": True, "routed_experts_format": fmt, "routed_experts_start_len": [3, 0]}
    full = client.post("/generate", json=body).json()
    stream_body = {**body, "stream": True, "incremental_streaming_output": True,
                   "sampling_params": {**body["sampling_params"], "stream_interval": interval}}
    with client.stream("POST", "/generate", json=stream_body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = list(sse_events(r))
    for i, (prompt, final) in enumerate(zip(batch, full)):
        chunks = [e for e in events if e["index"] == i]
        assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
        # stream_interval tokens per chunk (the last one carries the rest)
        assert [len(c["output_ids"]) for c in chunks[:-1]] == [interval or 1] * (len(chunks) - 1)
        last = chunks[-1]["meta_info"]
        assert last["finish_reason"] == final["meta_info"]["finish_reason"]
        assert last["completion_tokens"] == final["meta_info"]["completion_tokens"]
        assert sum((c["output_ids"] for c in chunks), []) == final["output_ids"]
        assert "".join(c["text"] for c in chunks) == final["text"]
        lps = sum((c["meta_info"]["output_token_logprobs"] for c in chunks), [])
        assert [t for _, t, _ in lps] == final["output_ids"]
        # NOTE: the second request hits the prefix cache, so its logits differ in the last bits
        assert torch.allclose(torch.tensor([lp for lp, _, _ in lps]),
                              torch.tensor([lp for lp, _, _ in final["meta_info"]["output_token_logprobs"]]),
                              atol=1e-5)
        pos, rows = [3, 0][i], []
        for c in chunks:
            assert c["meta_info"]["routed_experts_start"] == pos
            part = decode(c["meta_info"], fmt, shape)
            if fmt == "compact":
                from capture.codec import compact_header
                assert compact_header(c["meta_info"]["routed_experts"]).start == pos
            rows.append(part)
            pos += part.shape[0]
        assert same_sets(torch.cat(rows), decode(final["meta_info"], fmt, shape))
        assert pos == len(prompt) + 10 - 1


# ---- OpenAI --------------------------------------------------------------------------------------
def test_openai_completions(server, client, shape):
    from openai import OpenAI

    oa = OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
    assert [m.id for m in oa.models.list().data] == ["tiny-moe"]
    prompt = "Once upon a time"
    native = client.post("/generate", json={"text": prompt, "sampling_params": GREEDY, "return_logprob": True,
                                            "return_routed_experts": True}).json()
    res = oa.completions.create(model="tiny-moe", prompt=prompt, max_tokens=12, temperature=0, logprobs=2,
                                extra_body={"ignore_eos": True, "return_routed_experts": True})
    choice = res.choices[0]
    assert choice.text == native["text"] and choice.finish_reason == "length"
    assert res.usage.completion_tokens == 12 and res.usage.prompt_tokens == native["meta_info"]["prompt_tokens"]
    assert torch.allclose(torch.tensor(choice.logprobs.token_logprobs),
                          torch.tensor([lp for lp, _, _ in native["meta_info"]["output_token_logprobs"]]), atol=1e-6)
    assert 1 <= len(choice.logprobs.top_logprobs[0]) <= 2  # a dict by decoded token text: may collide
    ext = res.model_extra["sglext"]
    assert ext["routed_experts"] == native["meta_info"]["routed_experts"]
    stream = oa.completions.create(model="tiny-moe", prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                   extra_body={"ignore_eos": True, "return_routed_experts": True,
                                               "routed_experts_format": "compact",
                                               "incremental_streaming_output": True},
                                   stream_options={"include_usage": True})
    parts, rows, usage = [], [], None
    for ev in stream:
        if ev.usage is not None:
            usage = ev.usage
        for c in ev.choices:
            parts.append(c.text)
        if ev.model_extra.get("sglext"):
            rows.append(decode_routed_experts(ev.model_extra["sglext"]["routed_experts"], "compact"))
    assert "".join(parts) == native["text"] and usage.completion_tokens == 12
    assert torch.equal(torch.cat(rows), decode(native["meta_info"], "int32", shape))
    batch = oa.completions.create(model="tiny-moe", prompt=[[5, 6, 7], [8, 9]], max_tokens=3, temperature=0, n=2)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.usage.prompt_tokens == 3 + 2 and 4 <= batch.usage.completion_tokens <= 4 * 3   # a prompt counts once


def test_openai_chat(server, client, ref):
    from openai import OpenAI

    oa = OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello"}]
    ids = ref.tokenizer.apply_chat_template(messages)
    native = client.post("/generate", json={"input_ids": ids, "sampling_params": GREEDY}).json()
    res = oa.chat.completions.create(model="tiny-moe", messages=messages, max_tokens=12, temperature=0,
                                     logprobs=True, top_logprobs=3,
                                     extra_body={"ignore_eos": True, "return_routed_experts": True})
    assert res.choices[0].message.content == native["text"] and res.choices[0].message.role == "assistant"
    assert len(res.choices[0].logprobs.content) == 12 and len(res.choices[0].logprobs.content[0].top_logprobs) == 3
    assert res.usage.prompt_tokens == len(ids)
    ext = res.model_extra["sglext"]
    assert decode_routed_experts(ext["routed_experts"], "int32", num_layers=4, top_k=4).shape[0] == len(ids) + 11
    stream = oa.chat.completions.create(model="tiny-moe", messages=messages, max_tokens=12, temperature=0,
                                        stream=True, extra_body={"ignore_eos": True})
    text = "".join(ev.choices[0].delta.content or "" for ev in stream if ev.choices)
    assert text == native["text"]
    bad = client.post("/v1/chat/completions", json={"model": "x", "messages": "hi"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"
    bad = client.post("/v1/completions", json={"model": "x", "prompt": "hi", "max_tokens": -3})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"


# ---- abort, disconnect, pause, flush -------------------------------------------------------------
def engine_stat(admin, key):
    return admin.get("/server_info").json()["internal_states"][0][key]


def test_abort_mid_stream_returns_exact_partial(client, admin, shape, ref):
    prompt = prompts(3, [14])[0]
    body = {"input_ids": prompt, "sampling_params": {**GREEDY, "max_new_tokens": 1500}, "return_logprob": True,
            "return_routed_experts": True, "stream": True, "rid": "victim", "incremental_streaming_output": True}
    chunks = []
    with client.stream("POST", "/generate", json=body) as r:
        for ev in sse_events(r):
            chunks.append(ev)
            if len(chunks) == 5:
                assert client.post("/abort_request", json={"rid": "victim"}).json()["num_aborted"] == 1
    last = chunks[-1]["meta_info"]
    assert last["finish_reason"]["type"] == "abort"
    out_ids = sum((c["output_ids"] for c in chunks), [])
    assert 5 <= len(out_ids) == last["completion_tokens"] < 1500
    assert len(sum((c["meta_info"]["output_token_logprobs"] for c in chunks), [])) == len(out_ids)
    rows = torch.cat([decode(c["meta_info"], "int32", shape) for c in chunks])
    assert rows.shape[0] == len(prompt) + len(out_ids) - 1
    check_oracle(prompt + out_ids, rows)
    full = ref.generate(input_ids=[prompt], sampling_params={**GREEDY, "max_new_tokens": len(out_ids)})[0]
    assert full.output_ids == out_ids
    assert_clean(admin)


def test_client_disconnect_aborts(client, admin):
    before = engine_stat(admin, "aborted_requests")
    body = {"input_ids": prompts(4, [10])[0], "sampling_params": {**GREEDY, "max_new_tokens": 1900},
            "return_routed_experts": True}
    with client.stream("POST", "/generate", json={**body, "stream": True}) as r:
        for i, _ in enumerate(sse_events(r)):
            if i == 3:
                break
    with pytest.raises(httpx.ReadTimeout):
        client.post("/generate", json=body, timeout=0.5)
    deadline = time.monotonic() + 5
    while engine_stat(admin, "aborted_requests") < before + 2:
        assert time.monotonic() < deadline, "disconnected requests kept running"
        time.sleep(0.05)
    assert_clean(admin)


@pytest.mark.parametrize("mode", ["in_place", "retract", "abort"])
def test_pause_then_continue(client, admin, ref, shape, mode):
    try:
        _pause_then_continue(client, admin, ref, shape, mode)
    finally:   # NOTE: never leave the module's shared server paused (or busy) for the next tests
        admin.post("/continue_generation")
        admin.post("/abort_request", json={"abort_all": True})


def _pause_then_continue(client, admin, ref, shape, mode):
    prompt = prompts(5, [12])[0]
    n_new = 1500  # NOTE: long enough that the request is still running when the pause lands
    body = {"input_ids": prompt, "sampling_params": {**GREEDY, "max_new_tokens": n_new}, "return_logprob": True,
            "return_routed_experts": True, "stream": True, "incremental_streaming_output": True}
    chunks, started, other = [], threading.Event(), {}

    def read_stream():
        with client.stream("POST", "/generate", json=body) as r:
            for ev in sse_events(r):
                chunks.append(ev)
                if len(chunks) == 3:
                    started.set()

    reader = threading.Thread(target=read_stream)
    reader.start()
    assert started.wait(30)
    r = admin.post("/pause_generation", json={"mode": mode})
    assert r.status_code == 200 and r.json()["num_requests"] == 1, r.text
    load = client.get("/v1/loads").json()
    assert load["paused"] == mode
    expect = {"in_place": (1, 0), "retract": (0, 1), "abort": (0, 0)}[mode]
    assert (load["loads"][0]["num_running_reqs"], load["loads"][0]["num_waiting_reqs"]) == expect
    if mode == "abort":
        reader.join(30)  # the aborted stream ends with its partial output
    # NOTE: chunks the engine sent before the pause landed may still be on their way to the
    # reader; count once they have arrived (no new chunk for 0.3 s)
    seen = -1
    while seen != len(chunks):
        seen = len(chunks)
        time.sleep(0.3)
    late = threading.Thread(target=lambda: other.update(r=client.post(
        "/generate", json={"input_ids": [7, 8, 9], "sampling_params": {**GREEDY, "max_new_tokens": 4}})))
    late.start()
    time.sleep(0.4)
    assert len(chunks) == seen and "r" not in other  # nothing moves while paused
    busy = admin.post("/flush_cache")
    if mode != "in_place":  # retracted and queued requests hold no KV: the cache can go
        assert busy.status_code == 200, busy.text
    else:
        assert busy.status_code == 400 and "in flight" in busy.json()["error"]["message"]
    assert admin.post("/continue_generation").status_code == 200
    late.join(120)
    reader.join(300)   # NOTE: ~1500 tokens of one request; minutes on a loaded 2-core machine
    assert not reader.is_alive(), f"the stream has not finished: {len(chunks)} chunks so far"
    assert other["r"].status_code == 200 and other["r"].json()["meta_info"]["completion_tokens"] == 4
    final = chunks[-1]["meta_info"]
    out_ids = sum((c["output_ids"] for c in chunks), [])
    rows = torch.cat([decode(c["meta_info"], "int32", shape) for c in chunks])
    assert rows.shape[0] == len(prompt) + len(out_ids) - 1
    if mode == "abort":
        assert final["finish_reason"]["type"] == "abort" and len(out_ids) < n_new
    else:
        assert final["finish_reason"]["type"] == "length" and len(out_ids) == n_new
    local = ref.generate(input_ids=[prompt], sampling_params={**GREEDY, "max_new_tokens": len(out_ids)},
                         return_routed_experts=True)[0]
    assert local.output_ids == out_ids and same_sets(rows, local.routed_experts)
    assert_clean(admin)


def test_flush_cache_idle_and_get(client, admin):
    client.post("/generate", json={"input_ids": [5, 6, 7, 8], "sampling_params": GREEDY})
    wait_idle(client)
    assert admin.get("/flush_cache").status_code == 200
    assert admin.get("/debug/integrity").json()["kv_used"] == 0


# ---- security and bad input ----------------------------------------------------------------------
def test_auth(server, client, admin):
    anon = httpx.Client(base_url=server.url, timeout=30)
    wrong = httpx.Client(base_url=server.url, timeout=30, headers={"Authorization": "Bearer nope"})
    assert anon.get("/health").status_code == 200
    for c in (anon, wrong):
        for method, path in (("POST", "/generate"), ("GET", "/v1/models"), ("GET", "/metrics"),
                             ("GET", "/server_info"), ("POST", "/flush_cache"), ("POST", "/update_weights_from_disk")):
            r = c.request(method, path, json={})
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", (path, r.text)
    for path, body in (("/flush_cache", None), ("/pause_generation", {"mode": "in_place"}),
                       ("/continue_generation", {}), ("/update_weights_from_disk", {"model_path": DEFAULT_MODEL_PATH}),
                       ("/update_weights_from_tensor", {}), ("/init_weights_update_group", {}),
                       ("/abort_request", {"abort_all": True})):
        r = client.post(path, json=body)
        assert r.status_code == 403, (path, r.text)
    assert client.get("/v1/loads").json()["paused"] is None
    assert admin.get("/v1/models").status_code == 200  # the admin key is accepted everywhere
    assert admin.post("/abort_request", json={"abort_all": True}).status_code == 200
    info = admin.get("/server_info").json()
    assert API_KEY not in json.dumps(info) and ADMIN_KEY not in json.dumps(info)


def test_bad_requests_are_4xx_json(server, client):
    def err(r, status, param=None):
        assert r.status_code == status, r.text
        body = r.json()["error"]
        assert body["message"] and (param is None or body["param"] == param), body
    err(client.post("/generate", content=b"{not json", headers={"content-type": "application/json"}), 400)
    err(client.post("/generate", json=[1, 2]), 400)
    err(client.post("/generate", json={"input_ids": [1, 2], "sampling_params": {"temperature": "hot"}}), 400,
        "temperature")
    err(client.post("/generate", json={"input_ids": [1, 99999]}), 400, "input_ids")
    err(client.post("/generate", json={"text": 5}), 400, "text")
    err(client.post("/generate", json={"input_ids": [1, 2], "stream": True,
                                       "sampling_params": {"stream_interval": 0}}), 400, "stream_interval")
    err(client.post("/generate", json={"input_ids": [1, 2], "top_logprobs_num": -1}), 400, "top_logprobs_num")
    err(client.post("/generate", json={"input_ids": [1, 2], "routed_experts_format": "json"}), 400,
        "routed_experts_format")
    err(client.post("/generate", json={"input_ids": [1, 2], "routed_experts_start_len": 9,
                                       "return_routed_experts": True}), 400, "routed_experts_start_len")
    err(client.post("/generate", json={"input_ids": [1, 2], "logprob_start_len": -2}), 400, "logprob_start_len")
    err(client.post("/generate", json={"input_ids": [1, 2], "sampling_params": {"regex": "a+"}}), 400,
        "sampling_params.regex")
    err(client.post("/pause_generation", json={"mode": "sideways"}, headers={"Authorization": f"Bearer {ADMIN_KEY}"}),
        400, "mode")
    err(client.get("/no/such/endpoint"), 404)
    err(client.get("/generate"), 405)
    ok = client.post("/generate", json={"input_ids": [1, 2], "logprob_start_len": -1, "lora_path": None,
                                        "sampling_params": {"max_new_tokens": 2, "regex": None}})
    assert ok.status_code == 200, ok.text
    # body limits: declared and streamed (chunked, no Content-Length)
    err(client.post("/generate", content=b"x" * (LIMIT + 1)), 413)

    def chunks():
        for _ in range(LIMIT // 65536 + 2):
            yield b" " * 65536
    err(client.post("/generate", content=chunks()), 413)
    assert client.get("/health").status_code == 200


def test_state_endpoints(client, admin):
    assert client.get("/health_generate").json()["status"] == "ok"
    info = client.get("/model_info").json()
    assert info["num_experts"] == 16 and info["moe_layer_ids"] == [0, 1, 2, 3]
    assert client.get("/get_model_info").json() == info
    assert client.get("/get_server_info").json()["model_path"] == DEFAULT_MODEL_PATH
    assert client.get("/get_weight_version").json() == {"weight_version": "default"}
    text = client.get("/metrics").text
    for name in ("rollout_generation_tokens_total", "rollout_num_queue_reqs", "rollout_kv_usage",
                 "rollout_routed_experts_bytes_total", "rollout_capture_host_store_bytes",
                 'rollout_http_requests_total{path="/generate",status="200"}'):
        assert name in text, name


# ---- load ----------------------------------------------------------------------------------------
def test_64_concurrent_streaming_clients(server, admin, ref, shape):
    batch = prompts(9, [random.Random(i).randrange(4, 40) for i in range(64)])
    params = {**GREEDY, "max_new_tokens": 16}

    async def one(ac, prompt, fmt):
        body = {"input_ids": prompt, "sampling_params": params, "return_routed_experts": True, "stream": True,
                "routed_experts_format": fmt, "incremental_streaming_output": True}
        ids, rows, last = [], [], None
        async with ac.stream("POST", "/generate", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                ids += ev["output_ids"]
                rows.append(decode(ev["meta_info"], fmt, shape))
                last = ev["meta_info"]
        return ids, torch.cat(rows), last

    async def run_all():
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits,
                                     headers={"Authorization": f"Bearer {API_KEY}"}) as ac:
            return await asyncio.gather(*[one(ac, p, ("int32", "compact")[i % 2]) for i, p in enumerate(batch)])

    decodes = engine_stat(admin, "num_decode_forwards")
    t0 = time.monotonic()
    results = asyncio.run(run_all())
    elapsed = time.monotonic() - t0
    assert engine_stat(admin, "num_decode_forwards") - decodes < 64 * 16 / 4  # the clients were batched together
    for prompt, (ids, rows, last) in zip(batch, results):
        assert last["finish_reason"]["type"] == "length" and len(ids) == 16
        single = ref.generate(input_ids=[prompt], sampling_params=params, return_routed_experts=True)[0]
        assert ids == single.output_ids
        assert same_sets(rows, single.routed_experts)
    assert_clean(admin)
    assert elapsed < 60, elapsed


def test_dp2_server_routing_loads_and_updates():
    """--dp-size 2: requests spread over both ranks, routing still the oracle's, updates reach every rank."""
    from safetensors.torch import load_file, save

    batch = prompts(11, [6, 13, 22, 9])
    with ServerProcess(["--enable-return-routed-experts", "--enable-debug-endpoints", "--dp-size", "2",
                        "--dtype", "float32"]) as srv, httpx.Client(base_url=srv.url, timeout=120) as c:
        params = {**GREEDY, "logprob_mode": "raw"}
        out = c.post("/generate", json={"input_ids": batch, "sampling_params": params, "return_routed_experts": True,
                                        "routed_experts_format": "compact", "return_logprob": True})
        assert out.status_code == 200, out.text
        for prompt, o in zip(batch, out.json()):
            check_oracle(prompt + o["output_ids"], decode_routed_experts(o["meta_info"]["routed_experts"], "compact"))
        loads = c.get("/v1/loads").json()
        assert loads["dp_size"] == 2 and [ld["dp_rank"] for ld in loads["loads"]] == [0, 1]
        assert all(ld["num_used_tokens"] > 0 for ld in loads["loads"])  # both ranks served requests
        w = load_file(f"{DEFAULT_MODEL_PATH}/model.safetensors")
        scaled = save({"lm_head.weight": w["lm_head.weight"] * 1.5})
        r = c.post("/update_weights_from_tensor?weight_version=v2", content=scaled)
        assert r.status_code == 200, r.text
        after = c.post("/generate", json={"input_ids": batch, "sampling_params": params,
                                          "return_logprob": True}).json()
        assert {o["meta_info"]["weight_version"] for o in after} == {"v2"}
        for a, b in zip(out.json(), after):  # every rank computes with the scaled lm_head now
            assert a["output_ids"] == b["output_ids"]
            assert a["meta_info"]["output_token_logprobs"][0][0] != b["meta_info"]["output_token_logprobs"][0][0]
        assert all(o["meta_info"]["cached_tokens"] == 0 for o in after)
        assert c.post("/flush_cache").status_code == 200
        pinned = c.post("/generate", json={"input_ids": batch, "sampling_params": GREEDY, "data_parallel_rank": 1})
        assert pinned.status_code == 200, pinned.text
        assert [ld["num_used_tokens"] > 0 for ld in c.get("/v1/loads").json()["loads"]] == [False, True]
        bad = c.post("/generate", json={"input_ids": batch, "routed_dp_rank": 2})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "routed_dp_rank"
        assert c.post("/flush_cache").status_code == 200
        state = c.get("/debug/integrity").json()
        assert state["kv_used"] == 0 and state["kv_total"] == 2 * loads["loads"][0]["max_total_num_tokens"]


def test_server_args_cli():
    from rollout.server.args import ServerArgs

    a = ServerArgs.from_cli(["--port", "0", "--chunked-prefill-size", "-1", "--disable-prefix-caching",
                             "--decode-graph-batch-sizes", "1", "4", "--allowed-weight-dirs", "/tmp/x/../y",
                             "--api-key", "k1"])
    cfg = a.engine
    assert a.host == "127.0.0.1" and cfg.chunked_prefill_size is None and not cfg.enable_prefix_caching
    assert cfg.decode_graph_batch_sizes == (1, 4) and cfg.model_path == DEFAULT_MODEL_PATH
    assert a.weight_dirs == (DEFAULT_MODEL_PATH, "/tmp/y") and a.redacted()["api_key"] == "<set>"
    # /server_info lists the engine settings flat, under their flag names, as before ServerArgs held an EngineConfig
    flat = a.redacted()
    assert set(flat) == {
        "model_path", "tokenizer_path", "dtype", "device", "dp_size", "cpu_threads", "cpu_reserve",
        "cpu_affinity", "enable_return_routed_experts", "enable_deterministic_inference",
        "max_running_requests", "chunked_prefill_size", "max_total_tokens", "kv_cache_bytes", "context_length",
        "disable_prefix_caching", "decode_graph_batch_sizes", "cuda_graph_max_bs", "disable_cuda_graph_padding",
        "disable_cuda_graph", "prefill_graph_token_sizes", "seed", "weight_version",
        "stream_interval", "max_capture_buffer_rows", "enable_profile_graph_capture", "profile_graph_capture_dir",
        "moe_backend", "attention_backend", "host", "port", "served_model_name", "api_key", "admin_api_key",
        "allowed_weight_dirs", "max_request_bytes", "log_level", "enable_debug_endpoints", "timeout_keep_alive",
        "timeout_read", "max_connections", "shutdown_drain_s",
        "incremental_streaming_output", "allow_pickled_weight_tensors", "default_return_routed_experts",
        "allow_auto_truncate", "weight_update_bucket_bytes", "mem_fraction_static", "quantization", "decode_log_interval",
        "nnodes", "node_rank", "dist_init_addr", "dist_timeout", "speculative_algorithm",
        "speculative_num_draft_tokens", "speculative_num_steps", "speculative_eagle_topk",
        "speculative_draft_model_path", "speculative_ngram_min_match_window_size",
        "speculative_ngram_max_match_window_size", "enable_torch_compile", "torch_compile_max_bs", "enable_overlap_schedule",
            "schedule_policy"}
    assert flat["disable_prefix_caching"] is True and flat["chunked_prefill_size"] is None
    assert flat["decode_graph_batch_sizes"] == (1, 4) and flat["model_path"] == DEFAULT_MODEL_PATH
    for argv in (["--port", "70000"], ["--dp-size", "0"], ["--max-request-bytes", "10"], ["--api-key", ""]):
        with pytest.raises(SystemExit):
            ServerArgs.from_cli(argv)
