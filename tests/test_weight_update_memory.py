"""Peak memory of an engine process during a distributed weight update: at most the bucket (and a
small margin) beyond the model, measured by the kernel (VmHWM, reset through /proc/PID/clear_refs
just before the update).

A Qwen3-MoE-shaped checkpoint of ~275 MiB (random bf16, built locally by the benchmark's own
builder, scripts/bench_weight_update_memory.py), served by a real engine process; this test process
is the trainer (rank 0 of a gloo group) and pushes the whole model twice with a 32 MiB bucket. Its
largest tensors are 32 MiB, so no tensor exceeds the bucket. Before the receiver shared one
buffer across buckets and checked finiteness by a reduction, the first update's engine peak here
was 150 MiB (isfinite's temporaries of whole tensors, the heap grown by scratch tensors); now
35 MiB, then 32 MiB.
"""
import os
import sys
from pathlib import Path

import pytest
import torch

from rollout import Rollout
from rollout.config import DEFAULT_MODEL_PATH
from test_distributed_weights import Trainer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from bench_weight_update_memory import build_checkpoint, status_kb  # noqa: E402

MiB = 2**20
BUCKET = 32 * MiB
MARGIN = 12 * MiB   # the update's own small objects and the heap's rounding; far below a bucket

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600),
              pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc")]


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3moe-275m")
    tensors = build_checkpoint(path, layers=4, seed=0, vocab=16000, experts=32)
    return path, tensors


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_engine_peak_during_a_distributed_update_is_one_bucket(moe_checkpoint, quantization):
    """fp8: the engine holds the weights in FP8 and quantizes each pushed bf16 tensor as it copies
    it in, a slab of rows at a time (quant/fp8.py quantize_into): the bound holds the same."""
    path, tensors = moe_checkpoint
    largest = max(t.numel() * t.element_size() for t in tensors.values())
    assert largest <= BUCKET   # so the bound below is the bucket, not a tensor larger than it
    with Rollout(str(path), tokenizer_path=DEFAULT_MODEL_PATH, dtype="bfloat16", max_total_tokens=256,
                 context_length=256, weight_update_bucket_bytes=BUCKET, cpu_threads=1,
                 quantization=quantization) as r:
        (pid,) = r.engine_pids()
        trainer = Trainer(r, "memory")
        extra = []
        for k in range(2):
            before = status_kb(pid, "VmRSS") * 1024
            Path(f"/proc/{pid}/clear_refs").write_text("5")   # NOTE: VmHWM := the current RSS
            assert trainer.push(tensors, version=f"v{k}") == len(tensors)
            extra.append(status_kb(pid, "VmHWM") * 1024 - before)
        trainer.close()
        out = r.generate(input_ids=[[5, 6, 7]], sampling_params={"temperature": 0, "max_new_tokens": 2})[0]
        assert out.weight_version == "v1"
    assert all(e <= BUCKET + MARGIN for e in extra), [f"{e / MiB:.1f} MiB" for e in extra]
