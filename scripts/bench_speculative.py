#!/usr/bin/env python
"""Speculative decoding against decoding without it, side by side in one run, on a mid-size
Qwen3-MoE (``midsize_moe.SHAPES["scaling"]``: ~110M parameters, 8 layers, 32 experts, top-4,
float32, random weights built locally once).

    python scripts/bench_speculative.py [--batches 1 8 64] [--new 64] [--draft-tokens 4]
        [--repeats 3] [--threads 2] [--targets qwen3-moe nextn-random nextn-echo] [--json PATH]

Engines (all started once, each timed call interleaved with the others', medians over --repeats):
  plain             no speculation
  ngram             NGRAM: drafts looked up in the request's prompt and output
  standalone-self   STANDALONE with the target itself as draft: at temperature 0 every draft is kept
                    (the mechanism's ceiling, not a speed figure: the draft costs what the target does)
  standalone-small  STANDALONE with the target's first 2 of 8 layers (its embeddings and head) as draft

With --targets nextn-random nextn-echo, two more targets of DeepSeek-V3's layout at the same size (``SHAPES["deepseek"]``,
MLA and grouped sigmoid routing, 8 layers), each with one MTP layer built locally
(tests/tiny_models.py: with_mtp_layer), each against its own plain engine:
  nextn-random      NEXTN with a random MTP layer: drafts almost never hold, the cost of drafting
  nextn-echo        NEXTN on a target whose layers add little to the embeddings (their outputs damped)
                    with an MTP layer that echoes its input token's embedding: greedy drafts hold,
                    the speed a one-layer draft gives when it guesses right (an artificial target)

Workloads, at each batch size:
  repeat   greedy requests whose prompts end inside the model's own greedy continuation of a random
           start, so the answer repeats spans of the prompt (the shape of code edits and quoted
           math: copying what is already there); acceptance high
  sampled  temperature-1 requests on random prompts: acceptance near 0, the cost of drafting for nothing

Per cell: output tok/s, the ratio to plain, the mean accepted length (output tokens per verify
step, SGLang's spec_accept_length over all requests) and whether every output equals plain's (it
must: speculation never changes an output).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import midsize_moe  # noqa: E402

DRAFT_LAYERS = 2
START, LEAD = 24, 192         # repeat workload: a random start, then this much of its greedy continuation


def small_draft(target: Path, layers: int = DRAFT_LAYERS) -> Path:
    """The target's first `layers` decoder layers with its embeddings, final norm and head (cached)."""
    out = target.parent / f"{target.name}-draft{layers}"
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32)
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    model.save_pretrained(out, safe_serialization=True)
    return out


def mtp_targets(base: Path) -> dict[str, Path]:
    """The DeepSeek-V3-shaped target with a random MTP layer, and the damped one with the echo layer (cached)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from tiny_models import damped_checkpoint, with_mtp_layer  # noqa: PLC0415

    out = {"nextn-random": base.parent / f"{base.name}-mtp", "nextn-echo": base.parent / f"{base.name}-damped-mtp-echo"}
    if not (out["nextn-random"] / "mtp.safetensors").exists():
        with_mtp_layer(base, out["nextn-random"])
    if not (out["nextn-echo"] / "mtp.safetensors").exists():
        damped = base.parent / f"{base.name}-damped"
        if not damped.exists():
            damped_checkpoint(base, damped, 0.002)
        with_mtp_layer(damped, out["nextn-echo"], echo=True)
    return out


def engines(path: Path, draft_tokens: int, threads: int, kinds: tuple[str, ...]) -> dict:
    from rollout import Rollout

    common = dict(dtype="float32", cpu_threads=threads, max_running_requests=64, chunked_prefill_size=2048)
    spec = dict(speculative_num_draft_tokens=draft_tokens)
    every = {"plain": {},
             "ngram": dict(speculative_algorithm="NGRAM", **spec),
             "standalone-self": dict(speculative_algorithm="STANDALONE", speculative_draft_model_path=str(path), **spec),
             "standalone-small": lambda: dict(speculative_algorithm="STANDALONE",
                                              speculative_draft_model_path=str(small_draft(path)), **spec),
             "nextn": dict(speculative_algorithm="NEXTN", **spec)}
    return {name: Rollout(str(path), **common, **(every[name]() if callable(every[name]) else every[name]))
            for name in kinds}


def workload(plain, kind: str, batch: int, new: int, vocab: int, seed: int = 0) -> tuple[list, list]:
    rng = random.Random(seed)
    starts = [[rng.randrange(3, vocab) for _ in range(START)] for _ in range(batch)]
    if kind == "sampled":
        return starts, [{"temperature": 1.0, "max_new_tokens": new, "ignore_eos": True, "sampling_seed": i}
                        for i in range(batch)]
    greedy = {"temperature": 0.0, "ignore_eos": True}
    lead = plain.generate(input_ids=starts, sampling_params=dict(greedy, max_new_tokens=LEAD))
    return [s + o.output_ids for s, o in zip(starts, lead)], [dict(greedy, max_new_tokens=new)] * batch


def timed(engine, prompts, params) -> tuple[float, list]:
    t0 = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    return time.perf_counter() - t0, outs


def measure(target: str, running: dict, args, vocab: int) -> list[dict]:
    """Every workload and batch on one target's engines (running["plain"] the baseline)."""
    rows = []
    for kind in args.workloads:
        for batch in args.batches:
            prompts, params = workload(running["plain"], kind, batch, args.new, vocab)
            times: dict[str, list[float]] = {name: [] for name in running}
            outs: dict[str, list] = {}
            for name, engine in running.items():   # warm-up (and the outputs compared)
                outs[name] = timed(engine, prompts, params)[1]
            for _ in range(args.repeats):
                for name, engine in running.items():
                    times[name].append(timed(engine, prompts, params)[0])
            tokens = sum(len(o.output_ids) for o in outs["plain"])
            base = statistics.median(times["plain"])
            for name in running:
                t = statistics.median(times[name])
                verify = sum(o.spec_verify_ct for o in outs[name])
                row = {"target": target, "workload": kind, "batch": batch, "engine": name, "tok_s": tokens / t,
                       "vs_plain": base / t,
                       "accept_length": sum(len(o.output_ids) for o in outs[name]) / verify if verify else None,
                       "same_as_plain": [o.output_ids for o in outs[name]] == [o.output_ids for o in outs["plain"]]}
                rows.append(row)
                acc = f"{row['accept_length']:.2f}" if row["accept_length"] is not None else "-"
                print(f"{target:12s} {kind:8s} batch {batch:3d}  {name:17s} {row['tok_s']:8.1f} tok/s  "
                      f"{row['vs_plain']:5.2f}x  accept {acc:>5s}  same {row['same_as_plain']}", flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--new", type=int, default=64, help="output tokens per request")
    ap.add_argument("--draft-tokens", type=int, default=4, help="--speculative-num-draft-tokens")
    ap.add_argument("--workloads", nargs="+", default=["repeat", "sampled"], choices=["repeat", "sampled"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--targets", nargs="+", default=["qwen3-moe"], choices=["qwen3-moe", "nextn-random", "nextn-echo"],
                    help="qwen3-moe: NGRAM and STANDALONE; nextn-*: NEXTN on DeepSeek-V3-shaped targets")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if min(args.batches) < 1 or args.new < 2 or args.repeats < 1 or args.draft_tokens < 2:
        raise SystemExit("--batches >= 1, --new >= 2, --repeats >= 1, --draft-tokens >= 2")
    path = midsize_moe.build("scaling")
    print(f"checkpoint {path}; --speculative-num-draft-tokens {args.draft_tokens}; {args.threads} threads; "
          f"{args.new} new tokens per request; medians of {args.repeats}")
    targets = [("qwen3-moe", path, ("plain", "ngram", "standalone-self", "standalone-small"))]
    if any(t.startswith("nextn") for t in args.targets):
        targets += [(name, p, ("plain", "nextn")) for name, p in mtp_targets(midsize_moe.build("deepseek")).items()]
    targets = [t for t in targets if t[0] in args.targets]
    rows = []
    for target, tpath, kinds in targets:
        vocab = json.loads((tpath / "config.json").read_text())["vocab_size"]
        running = engines(tpath, args.draft_tokens, args.threads, kinds)
        try:
            rows += measure(target, running, args, vocab)
        finally:
            for engine in running.values():
                engine.shutdown()
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    return 0 if all(r["same_as_plain"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
