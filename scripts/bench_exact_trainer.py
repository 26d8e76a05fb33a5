#!/usr/bin/env python
"""Trainer step time, default vs exact mode, on the same rollouts of the deterministic engine.

Rollouts: the embedded model (configs/tiny-moe, float32) in deterministic inference through the
Python API, ``prompts_per_step x samples_per_prompt`` arithmetic prompts as in the GRPO loop.
Two ``PolicyTrainer``s from the same config (DeepSpeed, ZeRO from the config, router replay on as
in the loop, no compare_no_replay forward): ``default`` (transformers' ops) and ``exact``
(``trainer_bridge.exact_model``). Their steps are interleaved (A B, B A, ...) so machine load hits
both alike; median and min reported, and each mode's max |train - rollout logprob| on its first
step (at the rollout's weights: exact mode gives 0).

    python scripts/bench_exact_trainer.py [--reps 5] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from trainer_bridge.losses import grpo_advantages  # noqa: E402
from trainer_bridge.policy_trainer import PolicyTrainer  # noqa: E402
from trainer_bridge.sample import Sample  # noqa: E402
from trainer_bridge.step_report import exact_number  # noqa: E402
from trainer_bridge.task import ArithmeticTask, arithmetic_reward  # noqa: E402
from trainer_bridge.train_config import load_train_config  # noqa: E402

MODES = ("default", "exact")


def rollouts(cfg, tok) -> list[Sample]:
    from rollout import Rollout

    records = ArithmeticTask().examples(cfg.prompts_per_step, seed=123, split="train", unique=True)
    prompts = [tok(r["prompt"], add_special_tokens=False)["input_ids"] for r in records]
    n = cfg.samples_per_prompt
    with Rollout(cfg.model_path, dtype=cfg.server_dtype, enable_deterministic_inference=True,
                 enable_return_routed_experts=True) as engine:
        outs = engine.generate(input_ids=[p for p in prompts for _ in range(n)], return_logprob=True,
                               return_routed_experts=True,
                               sampling_params=[{"temperature": cfg.temperature, "max_new_tokens": cfg.max_new_tokens,
                                                 "sampling_seed": i} for i in range(len(prompts) * n)])
    samples = []
    for i, o in enumerate(outs):
        p, r = prompts[i // n], records[i // n]
        s = Sample(prompt_ids=p, response_ids=o.output_ids, rollout_logprobs=o.output_logprobs,
                   routed_experts=o.routed_experts, group_id=i // n, rid=f"b{i}")
        s.reward = arithmetic_reward(tok.decode(o.output_ids, skip_special_tokens=True), r)
        samples.append(s)
    return samples


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "configs" / "train" / "exact.yaml"))
    ap.add_argument("--reps", type=int, default=5, help="interleaved train steps per mode (after one warm-up)")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    from transformers import AutoTokenizer

    run_dir = tempfile.mkdtemp(prefix="bench-exact-")
    base = load_train_config(args.config, [f"run_dir={run_dir}", "compare_no_replay=false", "progress=false"])
    tok = AutoTokenizer.from_pretrained(base.model_path)
    samples = rollouts(base, tok)
    adv = grpo_advantages([s.reward for s in samples], [s.group_id for s in samples])
    tokens = sum(s.num_tokens for s in samples)
    print(f"rollouts: {len(samples)} samples, {tokens} tokens (deterministic engine, {base.server_dtype})", flush=True)
    trainers = {m: PolicyTrainer(load_train_config(args.config, [f"run_dir={run_dir}", "compare_no_replay=false",
                                                                 f"exact={str(m == 'exact').lower()}"]),
                                 eos_id=tok.eos_token_id) for m in MODES}
    first = {m: trainers[m].train_step(samples, adv) for m in MODES}            # warm-up, at the rollout's weights
    times: dict[str, list[float]] = {m: [] for m in MODES}
    for r in range(args.reps):
        for m in (MODES if r % 2 == 0 else MODES[::-1]):
            t0 = time.perf_counter()
            trainers[m].train_step(samples, adv)
            times[m].append(time.perf_counter() - t0)
    results = {"config": args.config, "samples_per_step": len(samples), "tokens_per_step": tokens,
               "zero_stage": base.zero_stage, "torch_threads": torch.get_num_threads(), "reps": args.reps}
    for m in MODES:
        results[m] = {"median_s": statistics.median(times[m]), "min_s": min(times[m]), "all_s": times[m],
                      "first_step_max_abs_dlp": first[m]["train_rollout_logprob_max_abs_diff"],
                      "first_step_mean_abs_dlp": first[m]["train_rollout_logprob_abs_diff"],
                      "first_step_routing_mismatch": first[m]["replay_replace_rate"]}
    for k in ("median_s", "min_s"):
        results[f"exact_vs_default_{k}"] = results["exact"][k] / results["default"][k]
    print(f"\n## Trainer step, default vs exact ({len(samples)} samples, {tokens} tokens, ZeRO-{base.zero_stage}, "
          f"{args.reps} interleaved reps)")
    print(f"{'mode':8s} {'median s':>9s} {'min s':>8s} {'x default':>10s} {'max |dlp| (1st step)':>22s} "
          f"{'live != rollout':>16s}")
    for m in MODES:
        r = results[m]
        ratio = f"{r['median_s'] / results['default']['median_s']:.2f}x"
        print(f"{m:8s} {r['median_s']:9.3f} {r['min_s']:8.3f} {ratio:>10s} "
              f"{exact_number(r['first_step_max_abs_dlp']):>22s} {exact_number(r['first_step_routing_mismatch']):>16s}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
