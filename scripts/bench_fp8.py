"""FP8 rollouts against BF16 on CPU, side by side in one run: model bytes, tok/s, and how many
routing rows differ between the forwards of the same tokens.

    python scripts/bench_fp8.py [--model-path configs/tiny-moe] [--prompts 8] [--n 4] [--repeats 5]
                                [--cpu-threads 1] [--json PATH]

Three engines of the same checkpoint run at once (each its own engine process): BF16, BF16 with
`quantization="fp8"` (the weights held in float8_e4m3fn with block scales, dequantized into bf16
per forward: W8A16) and FP32 (a full-precision trainer's numbers).
- bytes: each engine's own report (`loads()`: `expert_weight_bytes`, `weight_bytes`).
- tok/s: bench_throughput's workload (sampled, ignore_eos, capture on), the BF16 and FP8 engines
  alternating whole batches, `--repeats` times each; median and best.
- routing: the BF16 engine's sampled sequences (prompt + output) scored as prompts by every
  engine (one greedy token, routing returned); the share of (token, MoE layer) rows whose top-k
  set differs between two engines (what a trainer without router replay would route otherwise).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_throughput import workload  # noqa: E402
from rollout import Rollout  # noqa: E402
from rollout.config import DEFAULT_MODEL_PATH  # noqa: E402
from trainer_bridge.metrics import routing_mismatch_rate  # noqa: E402

ENGINES = {"bf16": dict(dtype="bfloat16"), "fp8": dict(dtype="bfloat16", quantization="fp8"),
           "fp32": dict(dtype="float32")}


def requests(prompts, max_news):
    ids, sps = [], []
    for prompt, news in zip(prompts, max_news):
        for k, m in enumerate(news):
            ids.append(prompt)
            sps.append({"temperature": 1.0, "max_new_tokens": m, "ignore_eos": True, "sampling_seed": 1000 + k})
    return ids, sps


def timed(engine: Rollout, ids, sps) -> tuple[float, list]:
    assert engine.flush_cache()
    t0 = time.perf_counter()
    outs = engine.generate(input_ids=ids, sampling_params=sps, return_routed_experts=True)
    return time.perf_counter() - t0, outs


def routing_rows(engine: Rollout, seqs: list[list[int]]) -> list[torch.Tensor]:
    """[len(seq) - 1, L, K] routing of each sequence's tokens but the last, scored as a prompt."""
    assert engine.flush_cache()
    outs = engine.generate(input_ids=seqs, sampling_params={"temperature": 0.0, "max_new_tokens": 1},
                           return_routed_experts=True)
    return [torch.as_tensor(o.routed_experts)[:len(s) - 1] for o, s in zip(outs, seqs)]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", default=DEFAULT_MODEL_PATH)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--cpu-threads", type=int, default=1)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    from transformers import AutoConfig

    prompts, max_news = workload(args.prompts, args.n, AutoConfig.from_pretrained(args.model_path).vocab_size)
    ids, sps = requests(prompts, max_news)
    engines = {name: Rollout(args.model_path, enable_return_routed_experts=True, cpu_threads=args.cpu_threads,
                             **kw) for name, kw in ENGINES.items()}
    try:
        loads = {name: e.loads()[0] for name, e in engines.items()}
        rates: dict[str, list[float]] = {"bf16": [], "fp8": []}
        timed(engines["bf16"], ids[:2], sps[:2])           # warm-up, untimed
        timed(engines["fp8"], ids[:2], sps[:2])
        seqs = None
        for rep in range(args.repeats):
            for name in (("bf16", "fp8") if rep % 2 == 0 else ("fp8", "bf16")):
                dt, outs = timed(engines[name], ids, sps)
                tokens = sum(len(o.output_ids) for o in outs)
                rates[name].append(tokens / dt)
                if name == "bf16" and seqs is None:
                    seqs = [p + o.output_ids for p, o in zip(ids, outs)]
            print(f"repeat {rep + 1}: " + ", ".join(f"{k} {v[-1]:.0f} tok/s" for k, v in rates.items()), flush=True)
        rows = {name: torch.cat(routing_rows(e, seqs)) for name, e in engines.items()}
    finally:
        for e in engines.values():
            e.shutdown()
    pairs = [("fp8", "bf16"), ("bf16", "fp32"), ("fp8", "fp32")]
    differ = {f"{a} vs {b}": routing_mismatch_rate(rows[a], rows[b]) for a, b in pairs}
    result = {
        "model_path": args.model_path, "workload": {"prompts": args.prompts, "n": args.n,
                                                    "requests": len(ids), "output_tokens": sum(s["max_new_tokens"] for s in sps)},
        "bytes": {name: {"expert_weight_bytes": ld["expert_weight_bytes"], "weight_bytes": ld["weight_bytes"]}
                  for name, ld in loads.items()},
        "tok_s": {name: {"runs": r, "median": statistics.median(r), "best": max(r)} for name, r in rates.items()},
        "routing_rows": int(rows["bf16"].shape[0] * rows["bf16"].shape[1]),
        "routing_rows_differ": differ,
        "cpu_threads": args.cpu_threads, "load_avg": os.getloadavg(),
    }
    b, f = result["bytes"]["bf16"], result["bytes"]["fp8"]
    rb, rf = result["tok_s"]["bf16"], result["tok_s"]["fp8"]
    print()
    print("| measure | BF16 | FP8 (W8A16) | FP8 / BF16 |")
    print("|---|---|---|---|")
    print(f"| expert weight bytes | {b['expert_weight_bytes']:,} | {f['expert_weight_bytes']:,} | "
          f"{f['expert_weight_bytes'] / b['expert_weight_bytes']:.3f} |")
    print(f"| all parameter bytes | {b['weight_bytes']:,} | {f['weight_bytes']:,} | "
          f"{f['weight_bytes'] / b['weight_bytes']:.3f} |")
    print(f"| tok/s median of {args.repeats} | {rb['median']:.0f} | {rf['median']:.0f} | "
          f"{rf['median'] / rb['median']:.3f} |")
    print(f"| tok/s best | {rb['best']:.0f} | {rf['best']:.0f} | {rf['best'] / rb['best']:.3f} |")
    print()
    print(f"routing rows (token x MoE layer) whose top-k set differs, over {result['routing_rows']:,} rows:")
    for k, v in differ.items():
        print(f"  {k}: {v:.4f}")
    print(f"load average {result['load_avg'][0]:.1f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
