"""Training-step time (forward + backward) with router replay vs without, on a tiny Qwen3-MoE.

    python scripts/bench_replay.py [--reps 20] [--json out.json] [--checkpointing]

A random Qwen3-MoE (default 4 layers, 16 experts, top-4) runs one packed micro-batch of samples
(``pack_samples``); "replay" times the step inside ``RouterReplay(mode="replay")`` (building the
context, validating the routing, hooks) with the model's own recorded routing, so both modes run
the same experts. Repetitions are interleaved (off, replay, off, replay, ...) after warm-up so
drift hits both modes alike; the table shows medians and the replay/off ratio.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer_bridge import RouterReplay, Sample, pack_samples  # noqa: E402


def build_model(args):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=args.hidden // 4,
                         intermediate_size=2 * args.hidden, moe_intermediate_size=args.moe_intermediate,
                         num_experts=args.experts, num_experts_per_tok=args.top_k, norm_topk_prob=True,
                         max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg).float()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1) if p.ndim > 1 else None
    if args.checkpointing:
        model.activation_checkpointing_enable()
    return model.train()


def make_batch(model, args):
    g = torch.Generator().manual_seed(1)
    samples = []
    for i in range(args.samples):
        p = int(torch.randint(args.min_prompt, args.max_prompt + 1, (), generator=g))
        r = int(torch.randint(args.min_response, args.max_response + 1, (), generator=g))
        toks = torch.randint(3, args.vocab, (p + r,), generator=g)
        with RouterReplay(model, mode="record") as rr, torch.no_grad():
            model(toks[None, :-1], use_cache=False)
        samples.append(Sample(prompt_ids=toks[:p], response_ids=toks[p:], rollout_logprobs=torch.full((r,), -1.0),
                              routed_experts=rr.routed_experts(), rid=f"s{i}"))
    (batch,) = pack_samples(samples, pad_to_multiple=64)
    return batch


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def train_step(model, batch, replay: bool, device: str = "cpu") -> float:
    model.zero_grad(set_to_none=True)
    _sync(device)
    t0 = time.perf_counter()
    if replay:
        with RouterReplay(model, mode="replay", routed_experts=batch.routed_experts):
            logits = model(**batch.model_inputs()).logits
            loss = torch.nn.functional.cross_entropy(logits[0], batch.target_ids[0], reduction="none")
            (loss * batch.loss_mask[0]).sum().backward()
    else:
        logits = model(**batch.model_inputs()).logits
        loss = torch.nn.functional.cross_entropy(logits[0], batch.target_ids[0], reduction="none")
        (loss * batch.loss_mask[0]).sum().backward()
    _sync(device)
    return time.perf_counter() - t0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--moe-intermediate", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--min-prompt", type=int, default=16)
    ap.add_argument("--max-prompt", type=int, default=64)
    ap.add_argument("--min-response", type=int, default=16)
    ap.add_argument("--max-response", type=int, default=96)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    ap.add_argument("--checkpointing", action="store_true", help="activation checkpointing on")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    model = build_model(args)
    batch = make_batch(model, args)
    model.to(args.device)
    batch = batch.to(args.device)
    for _ in range(args.warmup):
        train_step(model, batch, False, args.device)
        train_step(model, batch, True, args.device)
    times = {"off": [], "replay": []}
    for i in range(args.reps):
        order = ("off", "replay") if i % 2 == 0 else ("replay", "off")
        for mode in order:
            times[mode].append(train_step(model, batch, mode == "replay", args.device))
    med = {m: statistics.median(v) for m, v in times.items()}
    ratio = med["replay"] / med["off"]
    # each rep runs both modes back to back: the per-pair ratio cancels slow drift / contention
    paired = statistics.median(r / o for r, o in zip(times["replay"], times["off"]))
    result = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "tokens": batch.num_tokens, "real_tokens": batch.num_tokens - batch.num_padding,
        "threads": torch.get_num_threads(), "device": args.device,
        "median_s": med, "mean_s": {m: statistics.fmean(v) for m, v in times.items()},
        "min_s": {m: min(v) for m, v in times.items()}, "times_s": times, "ratio_replay_over_off": ratio,
        "paired_median_ratio": paired,
    }
    print(f"tiny Qwen3-MoE: {args.layers} layers, {args.experts} experts, top-{args.top_k}, hidden {args.hidden}; "
          f"{args.samples} samples packed into [1, {batch.num_tokens}]; {args.reps} interleaved reps, "
          f"{args.device}, {torch.get_num_threads()} threads"
          + (", activation checkpointing" if args.checkpointing else ""))
    print("| mode   | median ms | mean ms | min ms |")
    print("|--------|-----------|---------|--------|")
    for m in ("off", "replay"):
        print(f"| {m:<6} | {med[m] * 1e3:9.1f} | {result['mean_s'][m] * 1e3:7.1f} | {result['min_s'][m] * 1e3:6.1f} |")
    print(f"replay / off (median): {ratio:.3f}  ({(ratio - 1) * 100:+.1f}%); "
          f"median of paired ratios: {paired:.3f}  ({(paired - 1) * 100:+.1f}%)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
