"""Distributed weight updates received by the engine processes themselves, in buckets.

A real gloo group: this test process is the trainer (rank 0, trainer_bridge's group construction)
and every engine process of a `Rollout` joins it. Checkpoints A (served at start) and B are tiny
Qwen2-MoE models with different random weights; after an update the greedy outputs must be
transformers' for B.
"""
import datetime
import os
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from oracle import hf_greedy
from server_proc import ROOT, ServerProcess
from rollout import Rollout
from rollout.config import DEFAULT_MODEL_PATH, EngineConfig
from rollout.core.weight_bucket import ALIGN, WeightBucket, finite
from rollout.core.weight_receiver import buckets
from rollout.frontend.engine_client import WeightsInconsistentError
from trainer_bridge.weight_sync import init_custom_process_group

pytestmark = pytest.mark.timeout(300)
PROMPT = [11, 57, 23, 200, 9, 31, 77, 5, 180, 42]
N_NEW = 8
GREEDY = {"temperature": 0.0, "max_new_tokens": N_NEW, "ignore_eos": True}
BUCKET = 4096   # smaller than most of the tiny model's tensors, larger than its norms


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Trainer:
    """Rank 0 of a weight-update group that the rollout's engine processes join."""

    def __init__(self, rollout: Rollout, name: str):
        world = 1 + rollout.config.dp_size
        port = free_port()
        joined = {}
        t = threading.Thread(target=lambda: joined.update(r=rollout.init_weights_update_group(
            master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=world, group_name=name,
            backend="gloo", timeout_s=60.0)))
        t.start()
        self.pg = init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", world, 0, name,
                                            datetime.timedelta(seconds=60))
        t.join()
        self.ranks = [r["rank"] for r in joined["r"]]
        self.rollout = rollout

    def push(self, tensors: dict, *, version: str, shapes=None, load_format=None):
        """Posts the metadata and broadcasts in names order; returns the result or the exception."""
        names = list(tensors)
        shapes = shapes or [list(tensors[n].shape) for n in names]
        dtypes = [str(tensors[n].dtype).removeprefix("torch.") for n in names]
        box = {}

        def call():
            try:
                box["r"] = self.rollout.update_weights_from_distributed(
                    names, dtypes, shapes, load_format=load_format, weight_version=version)
            except Exception as exc:  # noqa: BLE001 (handed to the test)
                box["r"] = exc
        t = threading.Thread(target=call)
        t.start()
        if load_format == "flattened_bucket":
            flat = torch.cat([tensors[n].contiguous().view(-1).view(torch.uint8) for n in names])
            dist.broadcast(flat, src=0, group=self.pg)
        else:
            for n in names:
                dist.broadcast(tensors[n].contiguous(), src=0, group=self.pg)
        t.join()
        return box["r"]

    def close(self):
        self.rollout.destroy_weights_update_group()
        dist.destroy_process_group(self.pg)


@pytest.fixture(scope="module")
def ckpts(tiny_checkpoint):
    a, b = tiny_checkpoint("qwen2_moe"), tiny_checkpoint("qwen2_moe", seed=1)
    return {"a": a, "b": b, "want_a": hf_greedy(a, PROMPT, N_NEW), "want_b": hf_greedy(b, PROMPT, N_NEW),
            "b_tensors": load_file(f"{b}/model.safetensors")}


def greedy(rollout, **kw):
    return rollout.generate(input_ids=[PROMPT], sampling_params=GREEDY, **kw)[0]


def test_buckets_split_in_order_and_a_large_tensor_goes_alone():
    assert [list(r) for r in buckets([10, 10, 10, 50, 5, 5], 25)] == [[0, 1], [2], [3], [4, 5]]
    assert [list(r) for r in buckets([100], 1)] == [[0]]
    assert [list(r) for r in buckets([1, 2, 3], 2**30)] == [[0, 1, 2]]


def test_one_buffer_holds_every_bucket_at_aligned_offsets_and_finite_finds_nan_and_inf():
    nbytes = [10, 10, 10, 50, 6, 6]
    groups = list(buckets(nbytes, 25))
    bucket = WeightBucket(groups, nbytes, torch.device("cpu"))
    # the largest bucket, each tensor rounded up to ALIGN: [10, 10] -> 2 * ALIGN (> [50] -> ALIGN)
    assert bucket.size == 2 * ALIGN and all(o % ALIGN == 0 for o in bucket.offsets)
    a, b = bucket.views(groups[0], [torch.float16] * 6, [[5]] * 6)
    a.fill_(1), b.fill_(2)
    assert a.data_ptr() != b.data_ptr() and a.tolist() == [1] * 5 and b.tolist() == [2] * 5
    packed = WeightBucket([range(6)], nbytes, torch.device("cpu"), packed=True)
    assert packed.size == sum(nbytes) and packed.flat(range(6)).numel() == sum(nbytes)
    bucket.release()
    assert bucket.size == 0
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        for bad in (float("nan"), float("inf"), float("-inf")):
            x = torch.randn(3, 1000).to(dtype)
            x[2, 999] = bad
            assert finite([torch.ones(4, dtype=dtype), x, torch.empty(0, dtype=dtype)]) == [True, False, True]


def test_bucket_size_is_validated():
    for bad in (0, -1, 2**41, 1.5, True, "512"):
        with pytest.raises(ValueError, match=r"weight_update_bucket_bytes must be an integer in \[1, "):
            EngineConfig(model_path=DEFAULT_MODEL_PATH, weight_update_bucket_bytes=bad)
    assert EngineConfig(model_path=DEFAULT_MODEL_PATH).weight_update_bucket_bytes == 512 * 2**20


def test_bucketed_update_into_the_engine_matches_transformers(ckpts):
    b = ckpts["b_tensors"]
    with Rollout(str(ckpts["a"]), tokenizer_path=DEFAULT_MODEL_PATH, dtype="float32", weight_update_bucket_bytes=BUCKET) as r:
        assert greedy(r).output_ids == ckpts["want_a"]
        trainer = Trainer(r, "bucketed")
        assert trainer.ranks == [1]
        # a bad shape (the last tensor) is refused before any parameter changes
        names = sorted(b)
        shapes = [list(b[n].shape) for n in names]
        shapes[-1] = [shapes[-1][0] + 1, *shapes[-1][1:]]
        bad = dict(b)
        bad[names[-1]] = torch.zeros(shapes[-1])
        res = trainer.push({n: bad[n] for n in names}, version="v-bad", shapes=shapes)
        assert isinstance(res, ValueError) and "wrong shape" in str(res) and "old weights keep serving" in str(res)
        out = greedy(r)
        assert out.output_ids == ckpts["want_a"] and out.weight_version == "default"
        assert r.weights_inconsistent == ""
        before = r.stats().get("weight_update_buckets", 0)
        assert trainer.push({n: b[n] for n in names}, version="v-b") == len(names)
        nbytes = [b[n].numel() * b[n].element_size() for n in names]
        assert max(nbytes) > BUCKET   # some tensors are larger than a bucket: they went alone
        assert r.stats()["weight_update_buckets"] - before == len(list(buckets(nbytes, BUCKET)))
        out = greedy(r)
        assert out.output_ids == ckpts["want_b"] and out.weight_version == "v-b" and out.cached_tokens == 0
        # SGLang's flattened bucket (one broadcast of the tensors' bytes): back to A
        a = load_file(f"{ckpts['a']}/model.safetensors")
        res = trainer.push({n: a[n] for n in sorted(a)}, version="v-a", load_format="flattened_bucket")
        assert res == len(a), res
        assert greedy(r).output_ids == ckpts["want_a"]
        # NaN in the first tensor: refused before anything changed; in the last one (earlier
        # buckets already copied): the weights are half-updated and no request runs
        for where, half in ((0, False), (-1, True)):
            bad = {n: b[n].clone() for n in names}
            bad[names[where]].view(-1)[0] = float("nan")
            res = trainer.push(bad, version="v-nan")
            assert isinstance(res, ValueError) and "NaN" in str(res), res
            assert bool(r.weights_inconsistent) == half and ("half-updated" in str(res)) == half, res
        with pytest.raises(WeightsInconsistentError, match="half-updated"):
            greedy(r)
        assert trainer.push({n: a[n] for n in sorted(a)}, version="v-a2") == len(a)
        assert r.weights_inconsistent == ""
        out = greedy(r)
        assert out.output_ids == ckpts["want_a"] and out.weight_version == "v-a2"
        trainer.close()
        r.check_integrity()


@pytest.mark.slow
def test_dp2_every_engine_process_receives(ckpts):
    b = ckpts["b_tensors"]
    with Rollout(str(ckpts["a"]), tokenizer_path=DEFAULT_MODEL_PATH, dtype="float32", dp_size=2, weight_update_bucket_bytes=BUCKET,
                 cpu_threads=1) as r:
        trainer = Trainer(r, "dp2")
        assert trainer.ranks == [1, 2]
        assert trainer.push(dict(sorted(b.items())), version="v-b") == len(b)
        for rank in (0, 1):
            out = greedy(r, routed_dp_rank=rank)
            assert out.output_ids == ckpts["want_b"] and out.weight_version == "v-b", rank
        trainer.close()
        r.check_integrity()



@pytest.mark.slow
def test_trainer_sync_numbers_every_engine_process_of_every_server(ckpts):
    """DistributedSync to a dp 1 and a dp 2 server: ranks 1 | 2, 3 of a world of 4, all updated."""
    import asyncio

    from trainer_bridge.client import RolloutClient
    from trainer_bridge.weight_sync import make_weight_sync

    common = ["--model-path", str(ckpts["a"]), "--tokenizer-path", DEFAULT_MODEL_PATH, "--dtype", "float32",
              "--weight-update-bucket-bytes", str(BUCKET), "--cpu-threads", "1"]
    with ServerProcess(common) as one, ServerProcess([*common, "--dp-size", "2"]) as two:
        async def go():
            async with RolloutClient([one.url, two.url]) as c:
                sync = make_weight_sync("distributed", c)
                try:
                    await sync.push(dict(sorted(ckpts["b_tensors"].items())), "v-b")
                finally:
                    await sync.close()
        asyncio.run(go())
        for url, ranks in ((one.url, (None,)), (two.url, (0, 1))):
            for rank in ranks:
                out = httpx.post(url + "/generate", json={"input_ids": PROMPT, "sampling_params": GREEDY,
                                                          "routed_dp_rank": rank}, timeout=120).json()
                assert out["output_ids"] == ckpts["want_b"] and out["meta_info"]["weight_version"] == "v-b", (url, rank)


def _dying_trainer(port: str, weights_file: str) -> None:
    """Joins as rank 0, broadcasts the first half of the tensors (sorted names), then dies."""
    tensors = load_file(weights_file)
    names = sorted(tensors)
    pg = init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", 2, 0, "dying",
                                   datetime.timedelta(seconds=60))
    for n in names[: len(names) // 2]:
        dist.broadcast(tensors[n].contiguous(), src=0, group=pg)
    time.sleep(3.0)   # NOTE: lets the engine copy the buckets it got before the connection drops
    os._exit(3)


def test_trainer_dying_mid_broadcast_leaves_no_half_updated_weights_served(ckpts, tmp_path):
    b = ckpts["b_tensors"]
    names = sorted(b)
    meta = {"names": names, "dtypes": [str(b[n].dtype).removeprefix("torch.") for n in names],
            "shapes": [list(b[n].shape) for n in names]}
    body = {"input_ids": PROMPT, "sampling_params": GREEDY}
    with ServerProcess(["--model-path", str(ckpts["a"]), "--tokenizer-path", DEFAULT_MODEL_PATH, "--dtype", "float32",
                        "--weight-update-bucket-bytes", str(BUCKET), "--allowed-weight-dirs", str(ckpts["a"])]) as srv, \
            httpx.Client(base_url=srv.url, timeout=120) as http:
        port = free_port()
        env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'tests'}")
        trainer = subprocess.Popen([sys.executable, __file__, "dying", str(port), f"{ckpts['b']}/model.safetensors"],
                                   env=env)
        r = http.post("/init_weights_update_group", json={"master_address": "127.0.0.1", "master_port": port,
                                                          "rank_offset": 1, "world_size": 2, "group_name": "dying",
                                                          "backend": "gloo", "timeout_s": 60})
        assert r.status_code == 200, r.text
        r = http.post("/update_weights_from_distributed", json={**meta, "weight_version": "v-half"})
        assert trainer.wait(timeout=60) == 3
        assert r.status_code == 400 and not r.json()["success"], r.text
        assert "receiving tensors failed" in r.json()["message"] and "half-updated" in r.json()["message"], r.text
        # nothing runs on the mixed weights: generation is refused with 503, the server stays up
        r = http.post("/generate", json=body)
        assert r.status_code == 503 and "half-updated" in r.json()["error"]["message"], r.text
        assert http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}).status_code == 503
        assert http.get("/health").status_code == 200
        assert http.get("/health_generate").status_code == 503
        assert http.get("/get_weight_version").json()["weight_version"] == "default"
        # the broken group is gone; a new one and a full update make the weights whole again
        assert http.post("/destroy_weights_update_group", json={}).status_code == 400
        port = free_port()
        box = {}
        t = threading.Thread(target=lambda: box.update(r=http.post("/init_weights_update_group", json={
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": "again", "backend": "gloo"})))
        t.start()
        pg = init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", 2, 0, "again", datetime.timedelta(seconds=60))
        t.join()
        assert box["r"].status_code == 200, box["r"].text
        t = threading.Thread(target=lambda: box.update(r=http.post("/update_weights_from_distributed",
                                                                   json={**meta, "weight_version": "v-b"})))
        t.start()
        for n in names:
            dist.broadcast(b[n].contiguous(), src=0, group=pg)
        t.join()
        assert box["r"].status_code == 200 and box["r"].json()["weight_version"] == "v-b", box["r"].text
        out = http.post("/generate", json=body).json()
        assert out["output_ids"] == ckpts["want_b"] and out["meta_info"]["weight_version"] == "v-b"
        assert http.get("/health_generate").status_code == 200
        assert http.post("/destroy_weights_update_group", json={"group_name": "again"}).status_code == 200
        dist.destroy_process_group(pg)
        assert srv.alive, srv.log()


def _pushing_trainer(port: str, weights_file: str) -> None:
    """Joins as rank 0 and broadcasts every tensor (sorted names) from the CPU."""
    tensors = load_file(weights_file)
    pg = init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", 2, 0, "pushing",
                                   datetime.timedelta(seconds=60))
    for n in sorted(tensors):
        dist.broadcast(tensors[n].contiguous(), src=0, group=pg)
    dist.destroy_process_group(pg)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_bucketed_receive_into_a_cuda_engine_matches_transformers_within_one_bucket(ckpts):
    """The engine on CUDA, in this process (client="inproc", so this process's allocator is the
    engine's); the trainer a subprocess on gloo from the CPU (one GPU: NCCL refuses two ranks on
    it). The receiver's buffer is then on the CPU and each bucket is copied into the device
    parameters: the device must not grow by more than a bucket (the largest tensor, when that is
    larger) during the update, and nothing of the update stays on it afterwards."""
    b = ckpts["b_tensors"]
    names = sorted(b)
    largest = max(b[n].numel() * b[n].element_size() for n in names)
    meta = dict(names=names, dtypes=[str(b[n].dtype).removeprefix("torch.") for n in names],
                shapes=[list(b[n].shape) for n in names])
    with Rollout(str(ckpts["a"]), tokenizer_path=DEFAULT_MODEL_PATH, dtype="float32", device="cuda",
                 client="inproc", weight_update_bucket_bytes=BUCKET, kv_cache_bytes=64 << 20) as r:
        assert greedy(r).output_ids == hf_greedy_on(ckpts["a"], "cuda")
        port = free_port()
        env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'tests'}")
        trainer = subprocess.Popen([sys.executable, __file__, "pushing", str(port), f"{ckpts['b']}/model.safetensors"],
                                   env=env)
        try:
            r.init_weights_update_group(master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=2,
                                        group_name="pushing", backend="gloo", timeout_s=60.0)
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            assert r.update_weights_from_distributed(**meta, load_format=None, weight_version="v-b") == len(names)
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
            left = torch.cuda.memory_allocated() - base
            assert trainer.wait(timeout=60) == 0
        finally:
            trainer.kill()
        assert peak <= max(BUCKET, largest) + (2 << 20), (peak, BUCKET, largest)
        assert left <= (2 << 20), left   # nothing of the update stays on the device
        out = greedy(r)
        assert out.output_ids == hf_greedy_on(ckpts["b"], "cuda") and out.weight_version == "v-b"
        r.destroy_weights_update_group()


def hf_greedy_on(path, device: str) -> list[int]:
    """transformers' greedy continuation of PROMPT on `device` (fp32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).to(device).eval()
    out = model.generate(torch.tensor([PROMPT], device=device), max_new_tokens=N_NEW, min_new_tokens=N_NEW,
                         do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(PROMPT):].tolist()


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "dying":
    _dying_trainer(*sys.argv[2:4])
if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "pushing":
    _pushing_trainer(*sys.argv[2:4])
