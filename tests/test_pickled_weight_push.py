"""Pickled weight pushes as SGLang-based trainers send them, from a trainer process of its own
(tests/colocated_trainer.py) that stays alive while the server loads its shared tensors: torch's
ForkingPickler under both CPU sharing strategies, SGLang's LocalSerializedTensor request (verl's
path, inside a begin/end weight-update session) and slime's flattened bucket. After each push the
greedy output must be transformers' for the pushed checkpoint, and /get_weights_by_name must
return the pushed values; crafted pickles stay refused."""
import base64
import json
import os
import pickle
import secrets
import subprocess
import sys
import tempfile

import httpx
import pytest
import torch
from safetensors.torch import load_file

from oracle import hf_greedy
from rollout.config import DEFAULT_MODEL_PATH
from server_proc import ROOT, ServerProcess

pytestmark = pytest.mark.timeout(600)
ADMIN_KEY = "pickle-admin"
PROMPT = [11, 57, 23, 200, 9, 31, 77, 5, 180, 42]
GREEDY = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
AUTHKEY = secrets.token_hex(32)


@pytest.fixture(scope="module")
def ckpts(tiny_checkpoint):
    return {"a": tiny_checkpoint("qwen2_moe"), "b": tiny_checkpoint("qwen2_moe", seed=1)}


@pytest.fixture(scope="module")
def server(ckpts):
    with ServerProcess(["--model-path", str(ckpts["a"]), "--tokenizer-path", DEFAULT_MODEL_PATH, "--dtype", "float32",
                        "--allow-pickled-weight-tensors", "--admin-api-key", ADMIN_KEY],
                       env={"ROLLOUT_MP_AUTHKEY": AUTHKEY}) as srv:
        yield srv
        assert srv.alive, srv.log()


@pytest.fixture(scope="module")
def admin(server):
    with httpx.Client(base_url=server.url, timeout=120, headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as c:
        yield c


def push_from_trainer(url, weights_file, strategy, form, authkey=AUTHKEY):
    env = dict(os.environ, ROLLOUT_MP_AUTHKEY=authkey, PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'tests'}")
    with tempfile.TemporaryDirectory() as tmp:
        out, log = os.path.join(tmp, "out.json"), os.path.join(tmp, "log.txt")
        with open(log, "w") as log_file:
            code = subprocess.call([sys.executable, str(ROOT / "tests" / "colocated_trainer.py"), url, ADMIN_KEY,
                                    str(weights_file), strategy, form, out], env=env, stdout=log_file,
                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, timeout=300)
        with open(log) as f:
            assert code == 0, f.read()[-3000:]
        with open(out) as f:
            return json.load(f)


def greedy(client):
    out = client.post("/generate", json={"input_ids": PROMPT, "sampling_params": GREEDY}).json()
    return out["output_ids"], out["meta_info"]["weight_version"]


@pytest.mark.parametrize("strategy,form,ckpt", [("file_descriptor", "pairs", "b"), ("file_system", "pairs", "a"),
                                                ("file_descriptor", "sglang", "b"), ("file_system", "sglang", "a"),
                                                ("file_system", "bucket", "b")])
def test_push_from_a_trainer_process(server, admin, ckpts, strategy, form, ckpt):
    expected = {k: hf_greedy(ckpts[k], PROMPT, GREEDY["max_new_tokens"]) for k in ("a", "b")}
    assert expected["a"] != expected["b"]
    weights_file = ckpts[ckpt] / "model.safetensors"
    out = push_from_trainer(server.url, weights_file, strategy, form)
    status, body = out["/update_weights_from_tensor"]
    assert status == 200 and body["success"], body
    if form == "sglang":
        assert out["/begin_weight_update"] == [200, {"success": True, "message": "weight update session opened"}]
        assert out["/end_weight_update"][0] == 200 and out["/end_weight_update"][1]["success"]
    ids, version = greedy(admin)
    assert ids == expected[ckpt] and version == f"{form}-{strategy}"
    pushed = load_file(weights_file)
    for name in ("model.norm.weight", "lm_head.weight", "model.layers.1.mlp.experts.3.down_proj.weight"):
        r = admin.request("GET", "/get_weights_by_name", json={"name": name, "truncate_size": 5})
        assert r.status_code == 200, r.text
        assert torch.equal(torch.tensor(r.json()), pushed[name][:5].float()), name


def test_fd_push_without_the_trainers_authkey_is_a_clear_400(server, admin, ckpts):
    before = greedy(admin)
    out = push_from_trainer(server.url, ckpts["a"] / "model.safetensors", "file_descriptor", "pairs",
                            authkey=secrets.token_hex(32))
    status, body = out["/update_weights_from_tensor"]
    assert status == 400 and not body["success"] and "ROLLOUT_MP_AUTHKEY" in body["message"], body
    assert greedy(admin) == before


class _Calls:
    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


@pytest.mark.parametrize("evil", [_Calls(os.system, "true"), _Calls(eval, "1+1"), [("x", _Calls(eval, "1"))]],
                         ids=["os.system", "builtins.eval", "nested eval"])
def test_crafted_pickles_stay_refused(admin, evil):
    payload = base64.b64encode(pickle.dumps(evil)).decode()
    r = admin.post("/update_weights_from_tensor", json={"serialized_named_tensors": [payload], "load_format": "direct"})
    assert r.status_code == 400 and "is not on the allow-list" in r.json()["message"], r.text
    assert admin.get("/health").status_code == 200


def test_pickled_push_needs_the_admin_key(server):
    payload = base64.b64encode(pickle.dumps([])).decode()
    r = httpx.post(f"{server.url}/update_weights_from_tensor", json={"serialized_named_tensors": [payload]})
    assert r.status_code == 401


def test_weight_update_session(admin):
    assert admin.post("/begin_weight_update").json() == {"success": True, "message": "weight update session opened"}
    again = admin.post("/begin_weight_update", json={})
    assert again.status_code == 200 and "already open" in again.json()["message"]
    assert admin.post("/end_weight_update").json()["success"]
    r = admin.post("/end_weight_update")
    assert r.status_code == 200 and "no weight update session" in r.json()["message"]
    assert httpx.post(f"{admin.base_url}/begin_weight_update").status_code == 401


def test_get_weights_by_name_errors(admin):
    r = admin.request("GET", "/get_weights_by_name", json={"name": "model.no_such.weight"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "name", r.text
    r = admin.post("/get_weights_by_name", json={"name": "lm_head.weight", "truncate_size": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_size", r.text
    rows = admin.post("/get_weights_by_name", json={"name": "lm_head.weight"}).json()
    assert len(rows) == 100 and len(rows[0]) == 64   # SGLang's default truncate_size: the first 100 rows


def test_get_load(admin):
    loads = admin.get("/get_load").json()
    assert isinstance(loads, list) and len(loads) == 1
    assert set(loads[0]) == {"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens", "num_pending_tokens", "ts_tic"}
    assert loads[0]["dp_rank"] == 0 and loads[0]["num_reqs"] == 0
