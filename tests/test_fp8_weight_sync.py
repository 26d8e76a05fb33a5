"""FP8 rollouts from a full-precision trainer: a server started with `--quantization fp8`
quantizes the float weights it loads and every float weight update (disk, tensor bytes,
torch.distributed from a trainer process, bucket by bucket), so its greedy tokens, logprobs and
routing are transformers' on the quantize-dequantize of the weights pushed (blocks of 128, as the
engine's online scheme; the quantizer here is tests/fp8_checkpoint.py's, written apart from the
engine's). The logprobs of the float weights differ by far more than the tolerance, so a path
that skipped quantization fails. A refused update (NaN, wrong shape) keeps the old weights serving.
"""
import json
import os
import shutil
import subprocess
import sys

import httpx
import pytest
import torch
from safetensors.torch import load_file, save, save_file

from capture.codec import decode_routed_experts
from fp8_checkpoint import block_quantize, quantized
from oracle import moe_layer_ids
from rollout import Rollout
from rollout.config import DEFAULT_MODEL_PATH
from rollout.models.quant import fp8 as fp8_mod
from server_proc import ROOT, ServerProcess
from test_distributed_weights import Trainer
from test_fp8 import hf_on

pytestmark = pytest.mark.timeout(600)
ADMIN_KEY = "fp8-admin"
PROMPT = [11, 57, 23, 200, 9, 31, 77, 5, 180, 42]
N_NEW = 10
GREEDY = {"temperature": 0.0, "max_new_tokens": N_NEW, "ignore_eos": True}
TOL = 1e-4          # engine (fp32 compute on dequantized weights) vs transformers on the same weights
GAP = 1e-3          # the float weights' logprobs differ from the quantized ones' by more than this
NUM_LAYERS, TOP_K = 3, 2


def qdq_state(path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors with every linear / expert weight quantized to FP8 in blocks of
    128 and dequantized back (fp32): what an online-FP8 engine holds after loading them."""
    out = {}
    for name, t in load_file(os.path.join(path, "model.safetensors")).items():
        if quantized(name, t):
            q, s = block_quantize(t.float(), fp8_mod.ONLINE_BLOCK)
            b0, b1 = fp8_mod.ONLINE_BLOCK
            t = q.float() * s.repeat_interleave(b0, 0)[:t.shape[0]].repeat_interleave(b1, 1)[:, :t.shape[1]]
        out[name] = t
    return out


@torch.no_grad()
def reference(model, prompt: list[int]) -> dict:
    """transformers' greedy tokens, their logprobs and the router top-k rows on `model`."""
    gen = model.generate(torch.tensor([prompt]), max_new_tokens=N_NEW, min_new_tokens=N_NEW, do_sample=False,
                         eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    seq = torch.tensor([prompt + gen])
    out = model(seq, output_router_logits=True)
    lp = torch.log_softmax(out.logits[0].float(), -1)
    pos = torch.arange(len(prompt) - 1, seq.shape[1] - 1)
    rows = torch.full((seq.shape[1] - 1, NUM_LAYERS, TOP_K), -1, dtype=torch.int32)
    for layer, lg in zip(moe_layer_ids(model.config), out.router_logits):
        probs = torch.softmax(lg.reshape(seq.shape[1], -1)[:-1].float(), dim=-1)
        rows[:, layer] = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :TOP_K].to(torch.int32)
    return {"ids": gen, "logprobs": lp[pos, torch.tensor(gen)], "rows": rows}


@torch.no_grad()
def float_logprobs(model, prompt: list[int], ids: list[int]) -> torch.Tensor:
    lp = torch.log_softmax(model(torch.tensor([prompt + ids])).logits[0].float(), -1)
    return lp[torch.arange(len(prompt) - 1, len(prompt) + len(ids) - 1), torch.tensor(ids)]


@pytest.fixture(scope="module")
def dirs(tiny_checkpoint, tmp_path_factory):
    from tiny_models import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("fp8-weights")
    allowed = root / "allowed"
    allowed.mkdir()
    a = shutil.copytree(tiny_checkpoint("qwen2_moe"), allowed / "a")
    b = shutil.copytree(tiny_checkpoint("qwen2_moe", seed=1), allowed / "b")
    make_tiny_checkpoint("qwen2_moe", allowed / "wrong_shape", moe_intermediate_size=16)
    nan = shutil.copytree(b, allowed / "nan")
    weights = load_file(nan / "model.safetensors")
    key = "model.layers.1.self_attn.o_proj.weight"
    weights[key] = weights[key].clone()
    weights[key][3, 5] = float("nan")
    save_file(weights, nan / "model.safetensors", metadata={"format": "pt"})
    return {"root": root, "allowed": allowed, "a": a, "b": b}


@pytest.fixture(scope="module")
def expected(dirs, tmp_path_factory):
    """Per checkpoint: transformers' reference on its quantize-dequantize; the float weights give
    logprobs more than GAP away (so the checks below can fail)."""
    from transformers import AutoModelForCausalLM

    out = {}
    for k in ("a", "b"):
        model = hf_on(qdq_state(dirs[k]), str(dirs[k]), tmp_path_factory.mktemp(f"qdq-{k}"))
        out[k] = reference(model, PROMPT)
        full = AutoModelForCausalLM.from_pretrained(dirs[k], dtype=torch.float32).eval()
        gap = (float_logprobs(full, PROMPT, out[k]["ids"]) - out[k]["logprobs"]).abs().max()
        assert gap > GAP, f"{k}: FP8 barely changes this model's logprobs ({gap:.2e}); the test could not fail"
    return out


def assert_serves(out_ids, logprobs, rows, want):
    assert out_ids == want["ids"]
    got = torch.tensor(logprobs, dtype=torch.float32)
    assert torch.allclose(got, want["logprobs"], atol=TOL, rtol=0), (got - want["logprobs"]).abs().max()
    if rows is not None:
        assert torch.equal(torch.sort(torch.as_tensor(rows)[:, 1:], -1).values,
                           torch.sort(want["rows"][:, 1:], -1).values)


# ---- a real rollout-serve: disk, tensor bytes, a trainer process over torch.distributed ---------
@pytest.fixture(scope="module")
def server(dirs):
    with ServerProcess(["--model-path", str(dirs["a"]), "--tokenizer-path", DEFAULT_MODEL_PATH, "--dtype", "float32",
                        "--quantization", "fp8", "--allowed-weight-dirs", str(dirs["allowed"]),
                        "--admin-api-key", ADMIN_KEY, "--enable-return-routed-experts"]) as srv:
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


def check_serving(client, expected, which, version):
    r = client.post("/generate", json={"input_ids": PROMPT, "sampling_params": GREEDY, "return_logprob": True,
                                       "return_routed_experts": True})
    assert r.status_code == 200, r.text
    out = r.json()
    meta = out["meta_info"]
    assert meta["weight_version"] == version
    rows = decode_routed_experts(meta["routed_experts"], "int32", num_layers=NUM_LAYERS, top_k=TOP_K)
    assert_serves(out["output_ids"], [e[0] for e in meta["output_token_logprobs"]], rows, expected[which])


def update_disk(admin, path, version):
    return admin.post("/update_weights_from_disk", json={"model_path": str(path), "weight_version": version})


def test_server_quantizes_on_load_and_every_update_path(server, client, admin, dirs, expected, tmp_path):
    check_serving(client, expected, "a", "default")
    assert update_disk(admin, dirs["b"], "disk-b").status_code == 200
    check_serving(client, expected, "b", "disk-b")

    a_bytes = save(load_file(dirs["a"] / "model.safetensors"))
    r = admin.post("/update_weights_from_tensor?weight_version=tensor-a", content=a_bytes,
                   headers={"content-type": "application/octet-stream"})
    assert r.status_code == 200, r.text
    check_serving(client, expected, "a", "tensor-a")

    out = tmp_path / "trainer.json"
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'tests'}")
    subprocess.run([sys.executable, str(ROOT / "tests" / "server_proc.py"), "trainer", server.url, ADMIN_KEY,
                    str(dirs["b"] / "model.safetensors"), str(out)], env=env, check=True, timeout=300)
    res = json.loads(out.read_text())
    assert res["update"][0] == 200 and res["update"][1]["weight_version"] == "v-dist", res
    assert res["wrong_shape"][0] == 400 and "wrong shape" in res["wrong_shape"][1]["message"], res
    check_serving(client, expected, "b", "v-dist")     # the refused distributed update changed nothing


def test_refused_updates_keep_the_old_weights_serving(client, admin, dirs, expected):
    assert update_disk(admin, dirs["a"], "disk-a").status_code == 200
    check_serving(client, expected, "a", "disk-a")
    for path, words in ((dirs["allowed"] / "nan", "NaN"), (dirs["allowed"] / "wrong_shape", "wrong shape")):
        r = update_disk(admin, path, "bad")
        assert r.status_code == 400 and words in r.json()["message"], r.text
        check_serving(client, expected, "a", "disk-a")
    good = load_file(dirs["b"] / "model.safetensors")
    key = "model.layers.2.mlp.experts.3.up_proj.weight"
    for words, body in (("NaN", {**good, key: torch.full_like(good[key], float("nan"))}),
                        ("NaN", {**good, key: torch.full_like(good[key], float("inf"))}),
                        ("wrong shape", {**good, key: torch.zeros(3, 3)})):
        r = admin.post("/update_weights_from_tensor?weight_version=bad", content=save(body))
        assert r.status_code == 400 and words in r.json()["message"], r.text
        check_serving(client, expected, "a", "disk-a")


# ---- the Python API: bucketed distributed receive, a bucket with NaN refused -------------------
def test_bucketed_distributed_updates_quantize_and_a_nan_bucket_is_refused(dirs, expected):
    a, b = str(dirs["a"]), str(dirs["b"])
    tensors = load_file(dirs["b"] / "model.safetensors")
    first = next(iter(tensors))
    with Rollout(a, tokenizer_path=DEFAULT_MODEL_PATH, dtype="float32", quantization="fp8",
                 weight_update_bucket_bytes=4096, cpu_threads=1) as r:
        def check(which, version):
            out = r.generate(input_ids=[PROMPT], sampling_params=GREEDY, return_logprob=True)[0]
            assert out.weight_version == version
            assert_serves(out.output_ids, out.output_logprobs, None, expected[which])

        check("a", None) if r.weight_version is None else None
        trainer = Trainer(r, "fp8-sync")
        bad = {first: torch.full_like(tensors[first], float("nan")), **{k: v for k, v in tensors.items() if k != first}}
        res = trainer.push(bad, version="nan")
        assert isinstance(res, ValueError) and "NaN" in str(res) and "old weights keep serving" in str(res), res
        assert not r.weights_inconsistent
        check("a", r.weight_version)
        assert trainer.push(tensors, version="dist-b") == len(tensors)
        check("b", "dist-b")
        res = trainer.push({**tensors, first: tensors[first][:3]}, version="bad")
        assert isinstance(res, ValueError) and "wrong shape" in str(res), res
        check("b", "dist-b")
        trainer.close()
    del b


# ---- quantizing in slabs: the same bits as one call, the bound of a weight update --------------
@pytest.mark.parametrize("scheme", [fp8_mod.Fp8Scheme(granularity="block", block=(16, 32)),
                                    fp8_mod.Fp8Scheme(granularity="channel"),
                                    fp8_mod.Fp8Scheme(granularity="tensor")], ids=["block", "channel", "tensor"])
def test_quantize_into_slabs_equals_one_call(scheme, monkeypatch):
    monkeypatch.setattr(fp8_mod, "SLAB_ELEMENTS", 16 * 32 * 2)    # several tiles, the last ones partial
    w = (torch.randn(203, 77, generator=torch.Generator().manual_seed(0)) * 0.3).to(torch.bfloat16)
    want_q, want_s = fp8_mod.quantize(w, scheme)
    q = torch.empty_like(want_q)
    s = torch.full_like(want_s, -1.0)
    fp8_mod.quantize_into(w.t().contiguous().t(), q, s, scheme)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s, want_s)
    w[150, 3] = float("nan")
    before = q.clone()
    with pytest.raises(ValueError, match="NaN"):
        fp8_mod.quantize_into(w, q, s, scheme)
    assert torch.equal(q.view(torch.uint8), before.view(torch.uint8))    # nothing written


# ---- an FP8 checkpoint served: FP8 checkpoints from disk, float tensors quantized to its scheme --
def test_fp8_checkpoint_server_takes_fp8_checkpoints_and_float_tensors(tiny_checkpoint, tmp_path):
    """The front end's model skeleton holds FP8 where the engine does, so a disk update with an
    FP8 checkpoint (its `weight_scale_inv`) is accepted, and float tensors for FP8 weights are
    staged in float and quantized by the engine to the served checkpoint's block scheme (16 x 16
    here): both serve transformers' greedy on the dequantized FP8 checkpoint of B."""
    from fp8_checkpoint import dequantized_state, make_fp8_checkpoint
    from rollout.server.weight_updater import WeightUpdater

    a_float, b_float = tiny_checkpoint("qwen3_moe"), tiny_checkpoint("qwen3_moe", seed=3)
    a = make_fp8_checkpoint(a_float, tmp_path / "a8", block=(16, 16))
    b = make_fp8_checkpoint(b_float, tmp_path / "b8", block=(16, 16))
    want = {k: reference(hf_on(dequantized_state(p), str(like), tmp_path / f"ref-{k}"), PROMPT)
            for k, p, like in (("a", a, a_float), ("b", b, b_float))}
    with Rollout(str(a), tokenizer_path=DEFAULT_MODEL_PATH, dtype="float32", cpu_threads=1) as r:
        updater = WeightUpdater(r, (str(tmp_path),))

        def check(which, version):
            out = r.generate(input_ids=[PROMPT], sampling_params=GREEDY, return_logprob=True)[0]
            assert out.weight_version == version
            assert_serves(out.output_ids, out.output_logprobs, None, want[which])

        assert updater.update_from_disk(str(b), weight_version="disk-b8")["success"]
        check("b", "disk-b8")
        assert updater.update_from_disk(str(a), weight_version="disk-a8")["success"]
        check("a", "disk-a8")
        assert updater.update_from_safetensors(save(load_file(b_float / "model.safetensors")),
                                               weight_version="float-b")["success"]
        check("b", "float-b")
