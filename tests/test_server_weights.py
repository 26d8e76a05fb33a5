"""Weight updates through a real rollout-serve process: disk, tensor bytes and torch.distributed.

Checkpoints A (served at start) and B are tiny Qwen2-MoE models (layer 0 dense) with different
random weights; after each update the outputs and routing must be transformers' for the new
weights, and every rejected update must leave A serving unchanged.
"""
import base64
import io
import json
import os
import shutil
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch
from safetensors.torch import load_file, save, save_file

from capture.codec import decode_routed_experts
from oracle import hf_greedy, hf_router_topk, same_sets
from rollout.config import DEFAULT_MODEL_PATH
from server_proc import ROOT, ServerProcess, sse_events, wait_idle
from tiny_models import make_tiny_checkpoint

pytestmark = pytest.mark.timeout(300)
ADMIN_KEY = "weights-admin"
PROMPT = [11, 57, 23, 200, 9, 31, 77, 5, 180, 42]
N_NEW = 10
GREEDY = {"temperature": 0.0, "max_new_tokens": N_NEW, "ignore_eos": True}


@pytest.fixture(scope="module")
def dirs(tiny_checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("weights")
    allowed, outside = root / "allowed", root / "outside"
    allowed.mkdir()
    outside.mkdir()
    a = shutil.copytree(tiny_checkpoint("qwen2_moe"), allowed / "a")
    b = shutil.copytree(tiny_checkpoint("qwen2_moe", seed=1), allowed / "b")
    shutil.copytree(b, outside / "b")
    os.symlink(outside / "b", allowed / "link")
    corrupt = shutil.copytree(a, allowed / "corrupt")
    data = (corrupt / "model.safetensors").read_bytes()
    (corrupt / "model.safetensors").write_bytes(data[: len(data) // 2])
    make_tiny_checkpoint("qwen2_moe", allowed / "wrong_shape", moe_intermediate_size=16)
    partial = shutil.copytree(a, allowed / "partial")
    weights = load_file(partial / "model.safetensors")
    weights.pop("lm_head.weight")
    save_file(weights, partial / "model.safetensors", metadata={"format": "pt"})
    return {"root": root, "allowed": allowed, "a": a, "b": b, "outside": outside}


@pytest.fixture(scope="module")
def server(dirs):
    with ServerProcess(["--model-path", str(dirs["a"]), "--tokenizer-path", DEFAULT_MODEL_PATH, "--dtype", "float32",
                        "--allowed-weight-dirs", str(dirs["allowed"]), "--admin-api-key", ADMIN_KEY,
                        "--enable-return-routed-experts", "--enable-debug-endpoints"]) as srv:
        yield srv
        assert srv.alive, srv.log()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def admin(server):
    with httpx.Client(base_url=server.url, timeout=120, headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as c:
        yield c


@pytest.fixture(scope="module")
def expected(dirs):
    return {k: hf_greedy(dirs[k], PROMPT, N_NEW) for k in ("a", "b")}


def gen(client, prompt=PROMPT):
    r = client.post("/generate", json={"input_ids": prompt, "sampling_params": GREEDY, "return_routed_experts": True})
    assert r.status_code == 200, r.text
    return r.json()


def check_serving(client, dirs, expected, which, version=None):
    out = gen(client)
    assert out["output_ids"] == expected[which], f"not serving {which}"
    if version is not None:
        assert out["meta_info"]["weight_version"] == version
        assert client.get("/get_weight_version").json()["weight_version"] == version
    rows = decode_routed_experts(out["meta_info"]["routed_experts"], "int32", num_layers=3, top_k=2)
    seq = PROMPT + out["output_ids"]
    assert same_sets(rows, hf_router_topk(dirs[which], seq[:-1], 2, 3))
    assert (rows[:, 0] == -1).all()  # the dense layer
    return out


def update_disk(admin, path, version, **kw):
    return admin.post("/update_weights_from_disk", json={"model_path": str(path), "weight_version": version, **kw})


def tensor_bytes(path, names=None, transform=None):
    weights = load_file(os.path.join(path, "model.safetensors"))
    if names is not None:
        weights = {k: weights[k] for k in names}
    if transform is not None:
        weights = {k: transform(v) for k, v in weights.items()}
    return save(weights)


def test_disk_update_changes_outputs_and_version(client, admin, dirs, expected):
    first = check_serving(client, dirs, expected, "a", "default")
    assert gen(client)["meta_info"]["cached_tokens"] > 0
    r = update_disk(admin, dirs["b"], "v-b")
    assert r.status_code == 200 and r.json()["success"] and r.json()["weight_version"] == "v-b", r.text
    out = check_serving(client, dirs, expected, "b", "v-b")
    assert out["meta_info"]["cached_tokens"] == 0  # the update flushed the prefix cache
    assert first["output_ids"] != out["output_ids"]
    assert update_disk(admin, dirs["a"], "v-a").status_code == 200
    check_serving(client, dirs, expected, "a", "v-a")


def test_disk_update_rejections_keep_old_weights(server, client, admin, dirs, expected):
    assert update_disk(admin, dirs["a"], "v-a").status_code == 200
    cases = [
        (dirs["outside"] / "b", 403, "outside"),
        (dirs["allowed"] / "link", 403, "outside"),
        (str(dirs["allowed"]) + "/../outside/b", 403, "outside"),
        ("/etc", 403, "outside"),
        (dirs["allowed"] / "nope", 400, "not a directory"),
        (dirs["allowed"] / "corrupt", 400, "cannot read"),
        (dirs["allowed"] / "wrong_shape", 400, "wrong shape"),
        (dirs["allowed"] / "partial", 400, "missing"),
    ]
    for path, status, words in cases:
        r = update_disk(admin, path, "v-bad")
        assert r.status_code == status and not r.json()["success"] and words in r.json()["message"], (path, r.text)
        check_serving(client, dirs, expected, "a", "v-a")
    r = admin.post("/update_weights_from_disk", json={"model_path": 5})
    assert r.status_code == 400
    anon = httpx.post(server.url + "/update_weights_from_disk", json={"model_path": str(dirs["b"])})
    assert anon.status_code == 401
    check_serving(client, dirs, expected, "a", "v-a")


def test_tensor_update_paths(client, admin, dirs, expected):
    r = admin.post("/update_weights_from_tensor?weight_version=v-tb", content=tensor_bytes(dirs["b"]),
                   headers={"content-type": "application/octet-stream"})
    assert r.status_code == 200 and r.json()["num_tensors"] > 10, r.text
    check_serving(client, dirs, expected, "b", "v-tb")
    body = {"serialized_named_tensors": base64.b64encode(tensor_bytes(dirs["a"])).decode(), "weight_version": "v-ta"}
    r = admin.post("/update_weights_from_tensor", json=body)
    assert r.status_code == 200, r.text
    check_serving(client, dirs, expected, "a", "v-ta")
    # a partial update (one tensor) changes outputs; then put it back
    r = admin.post("/update_weights_from_tensor?weight_version=v-part",
                   content=tensor_bytes(dirs["b"], ["lm_head.weight"]))
    assert r.status_code == 200 and r.json()["num_tensors"] == 1, r.text
    assert gen(client)["output_ids"] != expected["a"]
    assert admin.post("/update_weights_from_tensor?weight_version=v-ta",
                      content=tensor_bytes(dirs["a"], ["lm_head.weight"])).status_code == 200
    check_serving(client, dirs, expected, "a", "v-ta")

    good = load_file(os.path.join(dirs["b"], "model.safetensors"))
    bad_bodies = {
        "wrong shape": save({**good, "lm_head.weight": torch.zeros(3, 3)}),
        "unexpected": save({"model.layers.0.no_such.weight": torch.zeros(2)}),
        "NaN": save({**good, "lm_head.weight": torch.full_like(good["lm_head.weight"], float("nan"))}),
        "floating point": save({"lm_head.weight": torch.zeros_like(good["lm_head.weight"], dtype=torch.int32)}),
        "not valid safetensors": b"\x00\x01garbage" * 10,
    }
    buf = io.BytesIO()
    torch.save(good, buf)
    bad_bodies["not valid safetensors "] = buf.getvalue()  # a pickle: never loaded
    for words, data in bad_bodies.items():
        r = admin.post("/update_weights_from_tensor?weight_version=v-bad", content=data)
        assert r.status_code == 400 and words.strip() in r.json()["message"], (words, r.text)
        check_serving(client, dirs, expected, "a", "v-ta")
    for body in ({"serialized_named_tensors": "!!notbase64"}, {"serialized_named_tensors": 5},
                 {"serialized_named_tensors": base64.b64encode(tensor_bytes(dirs["b"])).decode(),
                  "load_format": "pickle"}):
        assert admin.post("/update_weights_from_tensor", json=body).status_code == 400
    assert admin.post("/update_weights_from_tensor?bogus=1", content=tensor_bytes(dirs["b"])).status_code == 400
    check_serving(client, dirs, expected, "a", "v-ta")


def test_distributed_update_from_trainer_process(server, client, admin, dirs, expected, tmp_path):
    out = tmp_path / "trainer.json"
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'tests'}")
    subprocess.run([sys.executable, str(ROOT / "tests" / "server_proc.py"), "trainer", server.url, ADMIN_KEY,
                    str(dirs["b"] / "model.safetensors"), str(out)], env=env, check=True, timeout=180)
    res = json.loads(out.read_text())
    assert res["init"][0] == 200 and res["init"][1]["success"], res
    assert res["update"][0] == 200 and res["update"][1]["weight_version"] == "v-dist", res
    assert res["wrong_shape"][0] == 400 and "wrong shape" in res["wrong_shape"][1]["message"], res
    assert res["destroy"][0] == 200, res
    check_serving(client, dirs, expected, "b", "v-dist")
    r = admin.post("/update_weights_from_distributed", json={"names": ["lm_head.weight"], "dtypes": ["float32"],
                                                             "shapes": [[256, 64]]})
    assert r.status_code == 400 and "no weights update group" in r.json()["message"]
    assert admin.post("/destroy_weights_update_group", json={}).status_code == 400
    assert update_disk(admin, dirs["a"], "v-a").status_code == 200


def _stream(client, n_new, box, started):
    body = {"input_ids": PROMPT, "sampling_params": {**GREEDY, "max_new_tokens": n_new}, "stream": True,
            "return_routed_experts": True}
    with client.stream("POST", "/generate", json=body) as r:
        for ev in sse_events(r):
            box.append(ev)
            if len(box) == 3:
                started.set()
    box.append(time.monotonic())


def test_update_in_flight_semantics(client, admin, dirs, expected):
    assert update_disk(admin, dirs["a"], "v-a").status_code == 200
    # 1. no abort: the update waits for the running request, which finishes on the old weights
    box, started = [], threading.Event()
    t = threading.Thread(target=_stream, args=(client, 400, box, started))
    t.start()
    assert started.wait(30)
    r = update_disk(admin, dirs["b"], "v-b")
    t.join(60)
    assert r.status_code == 200, r.text
    final = box[-2]["meta_info"]
    # finished whole, and on the old weights (an output's weight_version is read when it finishes)
    assert final["finish_reason"]["type"] == "length" and final["weight_version"] == "v-a"
    assert final["completion_tokens"] == 400 and final["weight_versions"] == [["v-a", 0]]
    check_serving(client, dirs, expected, "b", "v-b")
    # 2. abort_all_requests: the running request ends as aborted, with its partial output
    box, started = [], threading.Event()
    t = threading.Thread(target=_stream, args=(client, 480, box, started))
    t.start()
    assert started.wait(30)
    r = update_disk(admin, dirs["a"], "v-a", abort_all_requests=True)
    t.join(60)
    assert r.status_code == 200, r.text
    final = box[-2]["meta_info"]
    assert final["finish_reason"]["type"] == "abort" and final["completion_tokens"] < 480
    check_serving(client, dirs, expected, "a", "v-a")
    # 3. pause(retract) -> update -> continue: the request resumes on the new weights
    box, started = [], threading.Event()
    # NOTE: 480 new tokens (the test model's context is 512): still running when the pause lands
    t = threading.Thread(target=_stream, args=(client, 480, box, started))
    t.start()
    assert started.wait(30)
    assert admin.post("/pause_generation", json={"mode": "retract"}).status_code == 200
    t0 = time.monotonic()
    assert update_disk(admin, dirs["b"], "v-mid").status_code == 200
    assert time.monotonic() - t0 < 10
    assert admin.post("/continue_generation").status_code == 200
    t.join(60)
    final = box[-2]["meta_info"]
    assert final["finish_reason"]["type"] == "length" and final["weight_version"] == "v-mid"
    assert final["completion_tokens"] == 480
    # which tokens each version sampled: the old one from 0, the new one from where the pause cut in
    (old, first), (new, cut) = final["weight_versions"]
    assert (old, first, new) == ("v-a", 0, "v-mid") and 0 < cut < 480, final["weight_versions"]
    # 4. pause(in_place) -> update: the running request is retracted (its KV came from the old
    #    weights), then resumes on the new ones after continue
    box, started = [], threading.Event()
    t = threading.Thread(target=_stream, args=(client, 480, box, started))
    t.start()
    assert started.wait(30)
    assert admin.post("/pause_generation", json={"mode": "in_place"}).json()["num_requests"] == 1
    assert update_disk(admin, dirs["a"], "v-a2").status_code == 200
    load = admin.get("/v1/loads").json()["loads"][0]
    assert (load["num_running_reqs"], load["num_waiting_reqs"]) == (0, 1)
    assert admin.post("/continue_generation").status_code == 200
    t.join(60)
    final = box[-2]["meta_info"]
    assert final["finish_reason"]["type"] == "length" and final["weight_version"] == "v-a2"
    assert [v for v, _ in final["weight_versions"]] == ["v-mid", "v-a2"] and final["weight_versions"][1][1] > 0
    wait_idle(admin)
    assert admin.post("/flush_cache").status_code == 200
    state = admin.get("/debug/integrity").json()
    assert state["kv_used"] == 0, state
    assert update_disk(admin, dirs["a"], "v-a").status_code == 200
