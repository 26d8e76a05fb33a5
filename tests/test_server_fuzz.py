"""Hypothesis-generated requests to every endpoint of a real rollout-serve: never a 5xx, every
error a JSON body, the server healthy and the KV pool fully free afterwards."""
import json
import os

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save

from rollout.config import DEFAULT_MODEL_PATH
from server_proc import ServerProcess, wait_idle

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def server():
    # NOTE: a short context bounds what a generated request can cost (64 tokens each at most).
    with ServerProcess(["--enable-return-routed-experts", "--enable-debug-endpoints", "--context-length", "64",
                        "--max-total-tokens", "4096", "--max-request-bytes", str(1 << 20), "--max-running-requests",
                        "32"]) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


# ---- strategies ------------------------------------------------------------------------------------
big = st.one_of(st.integers(-2**70, -1), st.integers(2**31, 2**70))
weird = st.one_of(st.none(), st.booleans(), big, st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=6),
                  st.lists(st.integers(-2, 5), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(0, 3),
                                                                            max_size=2))


def maybe(valid):
    return st.one_of(valid, valid, weird)


tok = st.integers(-2, 600)
ids = st.lists(tok, max_size=12)
text = st.text(max_size=30)
good_ids = st.lists(st.integers(3, 575), min_size=1, max_size=12)
good_text = st.text(min_size=1, max_size=30)
good_sampling = st.fixed_dictionaries({"max_new_tokens": st.integers(0, 12)}, optional={
    "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "top_k": st.integers(-1, 50),
    "min_p": st.floats(0, 1), "min_new_tokens": st.integers(0, 0), "stop": st.lists(st.text(min_size=1, max_size=3),
                                                                                      max_size=2),
    "stop_token_ids": st.lists(st.integers(0, 575), max_size=3), "ignore_eos": st.booleans(), "n": st.integers(1, 3),
    "sampling_seed": st.integers(0, 2**40), "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.1, 2), "logprob_mode": st.sampled_from(["raw", "scaled", "processed"]),
    "skip_special_tokens": st.booleans()})
good_generate = st.fixed_dictionaries({
    "sampling_params": good_sampling,
    **{"prompt": st.one_of(st.fixed_dictionaries({"text": st.one_of(good_text, st.lists(good_text, min_size=1,
                                                                                        max_size=3))}),
                           st.fixed_dictionaries({"input_ids": st.one_of(good_ids,
                                                                         st.lists(good_ids, min_size=1, max_size=3))}))},
}, optional={
    "return_logprob": st.booleans(), "top_logprobs_num": st.integers(0, 5), "return_routed_experts": st.booleans(),
    "routed_experts_format": st.sampled_from(["int32", "compact"]), "stream": st.booleans(),
    "return_text_in_logprobs": st.booleans(), "routed_experts_start_len": st.integers(0, 1),
    "logprob_start_len": st.just(-1), "rid": st.text(min_size=1, max_size=6)}).map(
    lambda d: {**{k: v for k, v in d.items() if k != "prompt"}, **d["prompt"]})


@st.composite
def mutated(draw, valid, keys):
    """A valid body with (half of the time) one field replaced by a wrong value."""
    body = dict(draw(valid))
    if draw(st.booleans()):
        key = draw(st.sampled_from(keys))
        if key.startswith("sampling_params.") and isinstance(body.get("sampling_params"), dict):
            body["sampling_params"] = {**body["sampling_params"], key.split(".", 1)[1]: draw(weird)}
        else:
            body[key] = draw(weird)
    return body


SP_KEYS = ["sampling_params." + k for k in ("max_new_tokens", "temperature", "top_p", "top_k", "n", "stop",
                                            "stop_token_ids", "sampling_seed", "logprob_mode", "regex", "bogus")]
valid_ish_generate = mutated(good_generate, ["text", "input_ids", "sampling_params", "rid", "return_logprob",
                                             "top_logprobs_num", "return_routed_experts", "routed_experts_start_len",
                                             "routed_experts_format", "stream", "logprob_start_len", "lora_path",
                                             "unknown_field"] + SP_KEYS)
sampling = st.fixed_dictionaries({"max_new_tokens": maybe(st.integers(0, 12))}, optional={
    "temperature": maybe(st.floats(0, 2)), "top_p": maybe(st.floats(0, 1)), "top_k": maybe(st.integers(-2, 50)),
    "min_p": maybe(st.floats(0, 1)), "min_new_tokens": maybe(st.integers(0, 4)),
    "stop": maybe(st.one_of(text, st.lists(st.text(max_size=3), max_size=3))),
    "stop_token_ids": maybe(st.lists(tok, max_size=3)), "ignore_eos": maybe(st.booleans()),
    "n": maybe(st.integers(0, 3)), "sampling_seed": maybe(st.integers(-1, 2**64)),
    "frequency_penalty": maybe(st.floats(-3, 3)), "repetition_penalty": maybe(st.floats(0, 2)),
    "logprob_mode": maybe(st.sampled_from(["raw", "scaled", "processed", "x"])),
    "skip_special_tokens": maybe(st.booleans()), "regex": st.one_of(st.none(), st.text(max_size=3)), "bogus": weird})
generate = st.fixed_dictionaries({}, optional={
    "text": maybe(st.one_of(text, st.lists(text, max_size=3))),
    "input_ids": maybe(st.one_of(ids, st.lists(ids, max_size=3))),
    "sampling_params": st.one_of(sampling, sampling, st.lists(sampling, max_size=3), weird),
    "rid": maybe(st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=3))),
    "return_logprob": maybe(st.booleans()), "logprob_start_len": maybe(st.integers(-2, 20)),
    "top_logprobs_num": maybe(st.integers(-1, 70)), "return_routed_experts": maybe(st.booleans()),
    "routed_experts_start_len": maybe(st.integers(-1, 15)), "return_text_in_logprobs": maybe(st.booleans()),
    "routed_experts_format": maybe(st.sampled_from(["int32", "compact", "json"])), "stream": maybe(st.booleans()),
    "lora_path": st.one_of(st.none(), st.text(max_size=3)), "unknown_field": weird})
good_openai = {"temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "n": st.integers(1, 2),
               "stop": st.text(min_size=1, max_size=3), "stream": st.booleans(), "seed": st.integers(0, 100),
               "return_routed_experts": st.booleans(), "routed_experts_format": st.sampled_from(["int32", "compact"]),
               "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}), "ignore_eos": st.booleans(),
               "model": st.just("tiny-moe")}
good_completions = st.fixed_dictionaries({"max_tokens": st.integers(0, 12), "prompt": st.one_of(
    good_text, st.lists(good_text, min_size=1, max_size=2), good_ids, st.lists(good_ids, min_size=1, max_size=2))},
    optional={**good_openai, "logprobs": st.integers(0, 5)})
good_message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": text})
good_chat = st.fixed_dictionaries({"max_tokens": st.integers(0, 12),
                                   "messages": st.lists(good_message, min_size=1, max_size=3)},
                                  optional={**good_openai, "logprobs": st.booleans()})
OPENAI_KEYS = ["max_tokens", "temperature", "top_p", "n", "stop", "stream", "seed", "return_routed_experts",
               "routed_experts_format", "stream_options", "echo", "logit_bias", "top_k", "logprobs", "top_logprobs"]
openai_common = {
    "model": maybe(st.just("tiny-moe")), "temperature": maybe(st.floats(0, 3)),
    "top_p": maybe(st.floats(0, 1)), "n": maybe(st.integers(0, 3)), "stop": maybe(text), "stream": maybe(st.booleans()),
    "seed": maybe(st.integers(-1, 100)), "presence_penalty": maybe(st.floats(-3, 3)),
    "return_routed_experts": maybe(st.booleans()), "routed_experts_format": maybe(st.sampled_from(["int32", "compact"])),
    "stream_options": maybe(st.fixed_dictionaries({"include_usage": maybe(st.booleans())})),
    "echo": maybe(st.booleans()), "logit_bias": maybe(st.dictionaries(st.text(max_size=2), st.integers(), max_size=1)),
    "ignore_eos": maybe(st.booleans()), "top_k": maybe(st.integers(-2, 5))}
completions = st.fixed_dictionaries({"max_tokens": maybe(st.integers(0, 12))}, optional={
    **openai_common, "prompt": maybe(st.one_of(text, st.lists(text, max_size=3), ids, st.lists(ids, max_size=2))),
    "logprobs": maybe(st.integers(0, 6))})
message = st.fixed_dictionaries({"role": maybe(st.sampled_from(["system", "user", "assistant"])),
                                 "content": maybe(st.one_of(text, st.lists(st.fixed_dictionaries(
                                     {"type": maybe(st.just("text")), "text": maybe(text)}), max_size=2)))})
chat = st.fixed_dictionaries({"max_tokens": maybe(st.integers(0, 12))}, optional={
    **openai_common, "messages": maybe(st.lists(message, max_size=3)), "logprobs": maybe(st.booleans()),
    "top_logprobs": maybe(st.integers(0, 5)), "tool_choice": maybe(st.sampled_from(["none", "auto", "required"]))})
model_dirs = st.sampled_from([DEFAULT_MODEL_PATH, DEFAULT_MODEL_PATH + "/../tiny-moe", "/etc", "/", "../../",
                              DEFAULT_MODEL_PATH + "/missing", "", "\x00"])


def _same_weight_bytes():
    weights = load_file(os.path.join(DEFAULT_MODEL_PATH, "model.safetensors"))
    return save({"lm_head.weight": weights["lm_head.weight"]})


SAME_WEIGHTS = _same_weight_bytes()
control = st.one_of(
    st.tuples(st.just("/abort_request"), st.fixed_dictionaries({}, optional={
        "rid": maybe(st.text(max_size=4)), "abort_all": maybe(st.booleans()), "x": weird})),
    st.tuples(st.just("/pause_generation"), st.fixed_dictionaries({}, optional={
        "mode": maybe(st.sampled_from(["abort", "retract", "in_place", "other"]))})),
    st.tuples(st.just("/continue_generation"), st.one_of(st.just({}), st.dictionaries(st.text(max_size=3), weird))),
    st.tuples(st.just("/flush_cache"), st.just({})),
    st.tuples(st.just("/update_weights_from_disk"), st.fixed_dictionaries({"model_path": maybe(model_dirs)}, optional={
        "weight_version": maybe(st.text(max_size=5)), "abort_all_requests": maybe(st.booleans()),
        "flush_cache": maybe(st.booleans())})),
    st.tuples(st.just("/update_weights_from_tensor"), st.fixed_dictionaries({}, optional={
        "serialized_named_tensors": maybe(st.one_of(st.text(max_size=20), st.lists(st.text(max_size=8), max_size=2))),
        "weight_version": maybe(st.text(max_size=5)), "load_format": maybe(st.sampled_from(["safetensors", "pickle"]))})),
    # NOTE: world_size is always invalid here, so the server never tries to reach any address.
    st.tuples(st.just("/init_weights_update_group"), st.fixed_dictionaries({
        "world_size": st.one_of(st.none(), st.integers(-3, 1), st.text(max_size=2), st.booleans())}, optional={
        "master_address": maybe(st.sampled_from(["127.0.0.1", "localhost"])), "master_port": maybe(st.integers(0, 70000)),
        "rank_offset": maybe(st.integers(-1, 3)), "group_name": maybe(text), "backend": maybe(st.sampled_from(
            ["gloo", "nccl", "mpi"]))})),
    st.tuples(st.just("/update_weights_from_distributed"), st.fixed_dictionaries({}, optional={
        "names": maybe(st.lists(st.sampled_from(["lm_head.weight", "model.norm.weight", "x"]), max_size=3)),
        "dtypes": maybe(st.lists(st.sampled_from(["float32", "bfloat16", "int8", "x"]), max_size=3)),
        "shapes": maybe(st.lists(st.lists(st.integers(-1, 4), max_size=3), max_size=3)),
        "weight_version": maybe(text)})),
    st.tuples(st.just("/destroy_weights_update_group"), st.fixed_dictionaries({}, optional={"group_name": maybe(text)})),
)
json_values = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=5)),
                           lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                   st.dictionaries(st.text(max_size=4), inner, max_size=4)),
                           max_leaves=12)
POST_PATHS = ["/generate", "/v1/completions", "/v1/chat/completions", "/abort_request", "/pause_generation",
              "/continue_generation", "/flush_cache", "/update_weights_from_disk", "/update_weights_from_tensor",
              "/init_weights_update_group", "/update_weights_from_distributed", "/destroy_weights_update_group"]
GET_PATHS = ["/health", "/health_generate", "/server_info", "/get_server_info", "/model_info", "/v1/models",
             "/v1/loads", "/metrics", "/get_weight_version", "/flush_cache", "/debug/integrity"]

cases = st.one_of(
    st.tuples(st.just("POST"), st.just("/generate"), st.just("json"), valid_ish_generate),
    st.tuples(st.just("POST"), st.just("/generate"), st.just("json"), valid_ish_generate),
    st.tuples(st.just("POST"), st.just("/generate"), st.just("json"), generate),
    st.tuples(st.just("POST"), st.just("/v1/completions"), st.just("json"),
              mutated(good_completions, OPENAI_KEYS + ["prompt"])),
    st.tuples(st.just("POST"), st.just("/v1/chat/completions"), st.just("json"),
              mutated(good_chat, OPENAI_KEYS + ["messages", "tool_choice"])),
    st.tuples(st.just("POST"), st.just("/v1/completions"), st.just("json"), completions),
    st.tuples(st.just("POST"), st.just("/v1/chat/completions"), st.just("json"), chat),
    control.map(lambda pb: ("POST", pb[0], "json", pb[1])),
    st.tuples(st.just("POST"), st.sampled_from(POST_PATHS), st.just("json"), json_values),
    st.tuples(st.just("POST"), st.sampled_from(POST_PATHS), st.just("raw"), st.binary(max_size=64)),
    st.tuples(st.just("POST"), st.just("/update_weights_from_tensor"), st.just("raw"),
              st.one_of(st.just(SAME_WEIGHTS), st.binary(max_size=64))),
    st.tuples(st.sampled_from(["GET", "DELETE", "PUT"]), st.one_of(st.sampled_from(GET_PATHS + POST_PATHS),
                                                                   st.from_regex(r"/[a-z_/]{0,16}", fullmatch=True)),
              st.just("raw"), st.just(b"")),
)


@settings(max_examples=300, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
@given(case=cases)
def test_fuzz_never_5xx(client, case):
    method, path, kind, payload = case
    if kind == "json":
        content = json.dumps(payload, allow_nan=True).encode()
        headers = {"content-type": "application/json"}
    else:
        content, headers = payload, {"content-type": "application/octet-stream"}
    r = client.request(method, path, content=content, headers=headers)
    assert r.status_code < 500, (case, r.status_code, r.text[:500])
    if r.status_code >= 400:
        body = r.json()
        assert ("error" in body and body["error"]["message"]) or body.get("success") is False, body
    if path == "/pause_generation" and r.status_code == 200:
        assert client.post("/continue_generation").status_code == 200


def test_healthy_and_clean_after_fuzz(server, client):
    # runs after the fuzz test (file order): nothing leaked, nothing stuck
    assert server.alive
    client.post("/continue_generation")
    assert client.get("/health").status_code == 200
    assert client.get("/health_generate").json()["status"] == "ok"
    wait_idle(client)
    assert client.post("/flush_cache").status_code == 200
    state = client.get("/debug/integrity").json()
    assert state["ok"] and state["kv_used"] == 0 and state["running"] == 0 and state["waiting"] == 0, state
    r = client.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 3},
                                       "return_routed_experts": True})
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 3
