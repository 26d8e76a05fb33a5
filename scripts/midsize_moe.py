"""Mid-size Qwen3-MoE checkpoints for the scaling and roofline benchmarks, built locally (random
weights, seeded; the embedded model's tokenizer), and decode timing of the engine and of
transformers on them, each run in a fresh process.

    build(shape) -> Path      # cached under runs/bench/midsize-<shape>/ (rebuilt when absent)
    SHAPES["scaling"]         # ~110M parameters: 8 layers, 32 experts, top-4, hidden 512
    SHAPES["roofline"]        # ~1 GB float32: 8 layers, 32 experts, top-4, hidden 768
    SHAPES["deepseek"]        # DeepSeek-V3's layout (MLA, grouped sigmoid routing) at the scaling size

A run generates `new` tokens for `batch` requests of `prompt` random tokens (ignore_eos,
temperature 1, fixed seeds): the engine through ``Rollout.generate``, transformers through
``generate`` on one batch (all prompts the same length: no padding). ``decode_step_s`` takes two
runs of different lengths and divides the difference: the time of one decode step at that batch
and context, with prefill, startup and the first step's costs cancelled out.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER_FROM = ROOT / "configs" / "tiny-moe"

SHAPES = {
    "scaling": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                    num_experts=32, num_experts_per_tok=4, moe_intermediate_size=256),
    "roofline": dict(hidden_size=768, num_hidden_layers=8, num_attention_heads=12, num_key_value_heads=4,
                     head_dim=64, num_experts=32, num_experts_per_tok=4, moe_intermediate_size=384),
    "deepseek": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8,
                     n_routed_experts=32, num_experts_per_tok=4, moe_intermediate_size=256, n_group=4, topk_group=2,
                     n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=256, kv_lora_rank=128,
                     qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32, num_nextn_predict_layers=0),
}


def build(shape: str, out_root: Path = ROOT / "runs" / "bench", seed: int = 0) -> Path:
    """The checkpoint of `shape` (one of SHAPES), built once and reused."""
    if shape not in SHAPES:
        raise ValueError(f"shape: must be one of {sorted(SHAPES)}, got {shape!r}")
    out = out_root / f"midsize-{shape}"
    if (out / "model.safetensors").exists():
        return out
    import torch
    from transformers import AutoModelForCausalLM, DeepseekV3Config, Qwen3MoeConfig

    base = json.loads((TOKENIZER_FROM / "config.json").read_text())
    config_class = DeepseekV3Config if shape == "deepseek" else Qwen3MoeConfig
    cfg = config_class(vocab_size=base["vocab_size"], bos_token_id=0, eos_token_id=0, pad_token_id=0,
                       dtype="float32", intermediate_size=4 * SHAPES[shape]["hidden_size"],
                       max_position_embeddings=8192, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                       rms_norm_eps=1e-6, initializer_range=0.02, tie_word_embeddings=False, norm_topk_prob=True,
                       **SHAPES[shape])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER_FROM / name, tmp / name)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def parameter_bytes(path: Path) -> dict:
    """Bytes of the checkpoint's parameters: experts (per expert, per layer), and everything else."""
    cfg = json.loads((path / "config.json").read_text())
    h, m = cfg["hidden_size"], cfg["moe_intermediate_size"]
    e = cfg.get("num_experts", cfg.get("num_local_experts"))
    per_expert = 3 * h * m * 4
    from safetensors import safe_open

    total = 0
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        for k in f.keys():
            t = f.get_slice(k)
            n = 1
            for d in t.get_shape():
                n *= d
            total += n * 4
    experts = per_expert * e * cfg["num_hidden_layers"]
    return {"total": total, "per_expert": per_expert, "experts": experts, "dense": total - experts, "config": cfg}


def _prompts(batch: int, prompt: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(prompt)] for _ in range(batch)]


def run(kind: str, path: str, batch: int, prompt: int, new: int, threads: int) -> float:
    """Seconds for one generate call of `batch` x `prompt` tokens -> `new` tokens each, after a
    warm-up call; kind "engine" or "hf". Runs in this process (see in_fresh_process)."""
    import torch

    torch.set_num_threads(threads)
    cfg = json.loads((Path(path) / "config.json").read_text())
    prompts = _prompts(batch, prompt, cfg["vocab_size"])
    if kind == "hf":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        ids = torch.tensor(prompts)

        def go(n: int) -> float:
            t0 = time.perf_counter()
            with torch.no_grad():
                out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                     temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=n, min_new_tokens=n,
                                     pad_token_id=0)
            assert out.shape == (batch, prompt + n)
            return time.perf_counter() - t0

        go(2)
        return go(new)
    if kind != "engine":
        raise ValueError(f"kind: must be 'engine' or 'hf', got {kind!r}")
    sys.path.insert(0, str(ROOT))
    from rollout import Rollout

    with Rollout(path, cpu_threads=threads, context_length=prompt + new + 16,
                 max_running_requests=max(batch, 8)) as engine:
        def go(n: int) -> float:
            sps = [{"temperature": 1.0, "max_new_tokens": n, "ignore_eos": True, "sampling_seed": 7 + i}
                   for i in range(batch)]
            assert engine.flush_cache()
            t0 = time.perf_counter()
            outs = engine.generate(input_ids=prompts, sampling_params=sps)
            assert all(len(o.output_ids) == n for o in outs)
            return time.perf_counter() - t0

        go(2)
        return go(new)


def in_fresh_process(kind: str, path: str, batch: int, prompt: int, new: int, threads: int) -> float:
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import midsize_moe as m; "
            "print(json.dumps(m.run(sys.argv[2], sys.argv[3], *map(int, sys.argv[4:8]))))")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    out = subprocess.run([sys.executable, "-c", code, str(ROOT / "scripts"), kind, str(path), str(batch), str(prompt),
                          str(new), str(threads)], check=True, capture_output=True, text=True, cwd=ROOT, env=env)
    return float(json.loads(out.stdout.strip().splitlines()[-1]))


def decode_step_s(kind: str, path: str, batch: int, prompt: int, threads: int, short: int = 8,
                  long: int = 40) -> float:
    """One decode step's seconds at `batch` requests with about `prompt` tokens of context: the
    difference of a `long`- and a `short`-token run over the difference in steps."""
    t_long = in_fresh_process(kind, path, batch, prompt, long, threads)
    t_short = in_fresh_process(kind, path, batch, prompt, short, threads)
    return (t_long - t_short) / (long - short)   # NOTE: not clamped: noise larger than the steps shows
