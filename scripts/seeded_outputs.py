"""Seeded outputs of fixed workloads, written so that two checkouts can be compared bit for bit
(scripts/bench_against.py --outputs runs this file with each checkout's code first on the path).

Workloads, each one call (so every request reaches the engine in the same step, whatever the
machine's speed), capture on, float32 and the tiny-moe checkpoint of the checkout:
- "python": `Rollout.generate`, GRPO-shaped (prompts x n samples at temperature 1, each sample its
  own seed), logprobs with top-3 alternatives, prompt logprobs from position 4, routing rows;
- "python_chunked": the same with chunked_prefill_size 64, max_running_requests 6 and a KV pool
  only 24 slots over the longest request's (chunked prefills, queueing and retractions);
- "server": the first workload as one batched /generate on a real rollout-serve of the checkout
  (the JSON answers, less their e2e_latency);
- "archs": the first workload on a tiny random checkpoint of every architecture in ARCHS (built by
  tests/tiny_models.py of this script's checkout, so both trees load the same weights), in the
  default mode and with deterministic inference.
Every float is written as its exact hex, every routing tensor as its shape and sha256.

  python scripts/seeded_outputs.py --out outputs.json [--workloads python server] [--engine-kw JSON]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

WORKLOADS = ("python", "python_chunked", "server", "archs")
ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v3", "glm4_moe")
TIMING_KEYS = {"e2e_latency"}


def workload(vocab: int, prompts: int = 6, samples: int = 3, seed: int = 7):
    rng = random.Random(seed)
    ids = [[rng.randrange(3, vocab) for _ in range(rng.randint(12, 90))] for _ in range(prompts)]
    params = [{"temperature": 1.0, "max_new_tokens": rng.randint(8, 40), "ignore_eos": True, "n": samples,
               "sampling_seed": 100 + i} for i in range(prompts)]
    return ids, params


def rids(prompts: int) -> list[str]:
    return [f"seeded-{i}" for i in range(prompts)]


def exact(value: Any) -> Any:
    """value with floats as exact hex strings and tensors as (dtype, shape, sha256)."""
    if isinstance(value, float):
        return value.hex()
    if isinstance(value, dict):
        return {k: exact(v) for k, v in value.items() if k not in TIMING_KEYS}
    if isinstance(value, (list, tuple)):
        return [exact(v) for v in value]
    if hasattr(value, "numpy") and hasattr(value, "shape"):
        arr = value.detach().cpu().contiguous().numpy()
        return {"dtype": str(arr.dtype), "shape": list(arr.shape), "sha256": hashlib.sha256(arr.tobytes()).hexdigest()}
    return value


def python_outputs(model_path: str, **engine_kw) -> list:
    from transformers import AutoConfig

    from rollout import Rollout

    ids, params = workload(AutoConfig.from_pretrained(model_path).vocab_size)
    with Rollout(model_path, dtype="float32", enable_return_routed_experts=True, **engine_kw) as engine:
        outs = engine.generate(input_ids=ids, sampling_params=params, return_logprob=True, top_logprobs_num=3,
                               return_routed_experts=True, logprob_start_len=4, rid=rids(len(ids)))
    fields = ("rid", "prompt_ids", "output_ids", "text", "finish_reason", "finish_info", "output_logprobs",
              "output_top_logprobs", "input_logprobs", "input_top_logprobs", "cached_tokens", "weight_version",
              "routed_experts", "routed_experts_start_len", "num_retractions")
    return [{f: exact(getattr(o, f, None)) for f in fields} for o in outs]


def arch_outputs(archs: tuple[str, ...] = ARCHS) -> dict:
    """The "python" workload on a tiny checkpoint of each architecture, default and deterministic."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from tiny_models import make_tiny_checkpoint  # noqa: PLC0415  (this checkout's builder)

    from rollout.config import DEFAULT_MODEL_PATH  # noqa: PLC0415

    out = {}
    with tempfile.TemporaryDirectory(prefix="seeded-archs-") as tmp:
        for arch in archs:
            path = str(make_tiny_checkpoint(arch, Path(tmp) / arch))
            for deterministic in (False, True):
                out[f"{arch}{':deterministic' if deterministic else ''}"] = python_outputs(
                    path, tokenizer_path=DEFAULT_MODEL_PATH, enable_deterministic_inference=deterministic)
    return out


def server_outputs(model_path: str) -> list:
    import httpx
    from transformers import AutoConfig

    from trainer_bridge.launch import LocalServers

    ids, params = workload(AutoConfig.from_pretrained(model_path).vocab_size)
    flags = ["--log-level", "warning", "--dtype", "float32", "--enable-return-routed-experts", "--model-path", model_path]
    with tempfile.TemporaryDirectory(prefix="seeded-outputs-") as tmp, \
            LocalServers(1, flags, log_dir=tmp, env={"OMP_NUM_THREADS": "2"}, supervise=False) as servers:
        body = {"input_ids": ids, "sampling_params": params, "rid": rids(len(ids)), "return_logprob": True,
                "top_logprobs_num": 3, "logprob_start_len": 4, "return_routed_experts": True}
        with httpx.Client(base_url=servers.urls[0], timeout=600) as c:
            r = c.post("/generate", json=body)
            r.raise_for_status()
            return exact(r.json())


def collect(model_path: str, workloads: list[str], engine_kw: dict) -> dict:
    out = {}
    for name in workloads:
        if name == "python":
            out[name] = python_outputs(model_path, **engine_kw)
        elif name == "python_chunked":
            from transformers import AutoConfig

            ids, params = workload(AutoConfig.from_pretrained(model_path).vocab_size)
            longest = max(len(p) + sp["max_new_tokens"] for p, sp in zip(ids, params))
            out[name] = python_outputs(model_path, chunked_prefill_size=64, max_running_requests=6,
                                       max_total_tokens=longest + 24, **engine_kw)
        elif name == "archs":
            out[name] = arch_outputs()
        else:
            out[name] = server_outputs(model_path)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    ap.add_argument("--model-path", default=None, help="default: configs/tiny-moe of the checkout imported")
    ap.add_argument("--engine-kw", default="{}", metavar="JSON",
                    help='engine settings of the two Python workloads, e.g. \'{"enable_overlap_schedule": true}\'')
    args = ap.parse_args(argv)
    import rollout

    root = Path(rollout.__file__).resolve().parent.parent
    model_path = args.model_path or str(root / "configs" / "tiny-moe")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    Path(args.out).write_text(json.dumps({"tree": str(root), "outputs": collect(model_path, args.workloads,
                                                                                json.loads(args.engine_kw))}))


if __name__ == "__main__":
    sys.exit(main())
