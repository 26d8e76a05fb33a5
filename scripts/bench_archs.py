"""Tiny-model throughput of the engine's architectures, side by side in one run.

    python scripts/bench_archs.py [--repeats 3] [--prompts 8] [--n 4] [--threads 1] [--json PATH]

Builds a random checkpoint of matched size for every served architecture with transformers
(hidden 128, 4 layers, 16 routed experts of width 64, top-4, vocab and tokenizer of the embedded
model): Qwen3-MoE (GQA), DeepSeek-V3 (MLA, grouped sigmoid routing, a dense first layer, a shared
expert), GLM-4.5 (GQA with partial rotary, the same routing), Qwen2-MoE (a gated shared expert),
Mixtral, OLMoE (MHA, full-width q/k norm), gpt-oss (sinks, a 128-token window on alternate
layers, biased clamped-SwiGLU experts, YaRN) and MiniMax-M2 (partial rotary, sigmoid routing).
`--archs` picks some of them (Qwen3-MoE, the baseline, always runs first). Each measured run is a fresh process (capture on, fp32,
sampled, ignore_eos); the architectures are interleaved; the table shows the median and the best
output tokens/s (on a shared machine the best run is the least disturbed one). --threads sets
torch's (and OpenMP's) threads per run: 1 degrades gracefully when other jobs share the cores,
where 2 spinning OpenMP threads on an oversubscribed machine vary by 50x from run to run.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

_COMMON = dict(vocab_size=576, hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=2048, bos_token_id=0, eos_token_id=0, pad_token_id=0,
               tie_word_embeddings=False, num_experts_per_tok=4, moe_intermediate_size=64, intermediate_size=256)
ARCHS = {
    "Qwen3-MoE": ("Qwen3MoeConfig", dict(head_dim=32, num_experts=16, norm_topk_prob=True)),
    "DeepSeek-V3": ("DeepseekV3Config", dict(n_routed_experts=16, n_group=4, topk_group=2, n_shared_experts=1,
                                             first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=64,
                                             qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
                                             num_key_value_heads=4)),
    "GLM-4.5": ("Glm4MoeConfig", dict(head_dim=32, n_routed_experts=16, n_group=4, topk_group=2, n_shared_experts=1,
                                      first_k_dense_replace=1, partial_rotary_factor=0.5, use_qk_norm=True,
                                      attention_bias=True)),
    "Qwen2-MoE": ("Qwen2MoeConfig", dict(num_experts=16, shared_expert_intermediate_size=64, norm_topk_prob=False)),
    "Mixtral": ("MixtralConfig", dict(num_local_experts=16, intermediate_size=64)),
    "OLMoE": ("OlmoeConfig", dict(num_experts=16, intermediate_size=64)),
    "gpt-oss": ("GptOssConfig", dict(head_dim=32, num_local_experts=16, intermediate_size=64, sliding_window=128,
                                     rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                                      "beta_slow": 1.0, "truncate": False,
                                                      "original_max_position_embeddings": 512,
                                                      "rope_theta": 150000.0})),
    "MiniMax-M2": ("MiniMaxM2Config", dict(head_dim=32, num_local_experts=16, intermediate_size=64, rotary_dim=16)),
}


def build(name: str, path: str) -> None:
    import transformers

    cls, extra = ARCHS[name]
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**{**_COMMON, **extra}),
                                                          dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen) if "norm" in pname
                    else 0.1 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(path, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(os.path.join(ROOT, "configs", "tiny-moe", f), os.path.join(path, f))


def worker(path: str, num_prompts: int, n: int) -> tuple[float, int]:
    from rollout import Rollout

    rng = random.Random(0)
    prompts = [[rng.randrange(3, 576) for _ in range(rng.randint(32, 128))] for _ in range(num_prompts)]
    ids = [p for p in prompts for _ in range(n)]
    sps = [{"temperature": 1.0, "max_new_tokens": rng.randint(32, 64), "ignore_eos": True, "sampling_seed": i}
           for i in range(len(ids))]
    with Rollout(path, dtype="float32", enable_return_routed_experts=True) as engine:
        engine.generate(input_ids=ids[:2], sampling_params=sps[:2])                 # warm-up
        assert engine.flush_cache()
        t0 = time.perf_counter()
        outs = engine.generate(input_ids=ids, sampling_params=sps, return_routed_experts=True)
        dt = time.perf_counter() - t0
    assert all(o.routed_experts.shape[0] == len(p) + len(o.output_ids) - 1 for o, p in zip(outs, ids))
    return dt, sum(len(o.output_ids) for o in outs)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--archs", nargs="+", choices=list(ARCHS), default=list(ARCHS))
    args = ap.parse_args(argv)
    names = ["Qwen3-MoE"] + [a for a in args.archs if a != "Qwen3-MoE"]
    if min(args.repeats, args.prompts, args.n, args.threads) < 1:
        ap.error("--repeats, --prompts, --n and --threads must be >= 1")
    from rollout.models import model_info
    from rollout.batch.kv_pool import KVPool

    tmp = tempfile.mkdtemp(prefix="bench_archs_")
    try:
        paths = {name: os.path.join(tmp, name) for name in names}
        for name, path in paths.items():
            build(name, path)
        runs: dict[str, list[float]] = {name: [] for name in names}
        code = ("import json, sys, torch; torch.set_num_threads(int(sys.argv[5])); sys.path.insert(0, sys.argv[1]); "
                "import bench_archs as b; print(json.dumps(b.worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))))")
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
        for _ in range(args.repeats):
            for name, path in paths.items():
                out = subprocess.run([sys.executable, "-c", code, os.path.dirname(os.path.abspath(__file__)), path,
                                      str(args.prompts), str(args.n), str(args.threads)], check=True,
                                     capture_output=True, text=True, env=env)
                dt, tokens = json.loads(out.stdout.strip().splitlines()[-1])
                runs[name].append(tokens / dt)
        rows = []
        for name, path in paths.items():
            info = model_info(path)
            kv = KVPool.bytes_per_slot(num_layers=info.num_hidden_layers, num_kv_heads=info.num_kv_heads,
                                       head_dim=info.head_dim, dtype=torch.float32, latent_dim=info.kv_latent_dim)
            rows.append({"arch": name, "tok_per_s": statistics.median(runs[name]), "best_tok_per_s": max(runs[name]),
                         "runs": runs[name],
                         "kv_bytes_per_token_fp32": kv, "moe_layers": len(info.moe_layer_ids)})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    base, best = rows[0]["tok_per_s"], rows[0]["best_tok_per_s"]
    print("| architecture | MoE layers | KV bytes/token (fp32) | output tok/s median (vs Qwen3-MoE) | best (vs Qwen3-MoE) |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['arch']} | {r['moe_layers']} | {r['kv_bytes_per_token_fp32']} | {r['tok_per_s']:.0f} "
              f"({r['tok_per_s'] / base:.2f}x) | {r['best_tok_per_s']:.0f} ({r['best_tok_per_s'] / best:.2f}x) |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "args": vars(args), "results": rows}, f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
