"""--enable-torch-compile against the same engine without it: decode tokens/s at batch 1 and 8
and the startup time (which holds the compile), side by side in one run (prints a table; --json
writes the numbers).

Both engines live in this process (inproc client) and are measured in turns, `--rounds` times;
a decode step's time is the difference of a `--long`- and a `--short`-token run over the
difference in steps (prefill and the first steps cancel out), the median over the rounds. The
compiled engine compiles decode buckets 1 and 8 (decode_graph_batch_sizes=(1, 8),
torch_compile_max_bs=8); the other runs the same buckets as static-shape runners without
compile. Every run's tokens are compared between the two (greedy).

    python scripts/bench_compile.py [--model PATH | --shape scaling] [--threads 2] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from rollout import Rollout  # noqa: E402
from rollout.config import DEFAULT_MODEL_PATH  # noqa: E402

BATCHES = (1, 8)


def prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    import random

    rng = random.Random(batch * 1000 + length)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(batch)]


def timed_generate(engine: Rollout, ids: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
    params = {"temperature": 0.0, "max_new_tokens": new, "ignore_eos": True}
    start = time.perf_counter()
    outs = engine.generate(input_ids=ids, sampling_params=[params] * len(ids))
    return time.perf_counter() - start, [o.output_ids for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the embedded tiny MoE)")
    ap.add_argument("--shape", default=None, help="a scripts/midsize_moe.py shape (built locally), e.g. scaling")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens per request")
    ap.add_argument("--short", type=int, default=8)
    ap.add_argument("--long", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None, help="write the numbers here")
    args = ap.parse_args()
    path = args.model or DEFAULT_MODEL_PATH
    if args.shape:
        import midsize_moe  # noqa: PLC0415

        path = str(midsize_moe.build(args.shape))
    kw = dict(tokenizer_path=DEFAULT_MODEL_PATH, dtype="float32", client="inproc", cpu_threads=args.threads,
              decode_graph_batch_sizes=BATCHES, max_total_tokens=max(BATCHES) * (args.prompt + args.long + 8) + 64)
    engines, startup = {}, {}
    for mode in ("eager", "compiled"):
        start = time.perf_counter()
        engines[mode] = Rollout(path, enable_torch_compile=mode == "compiled", torch_compile_max_bs=max(BATCHES), **kw)
        startup[mode] = time.perf_counter() - start
    vocab = engines["eager"].debug(lambda core: core.info.vocab_size)
    report = engines["compiled"].debug(lambda core: core.runner.report())
    steps: dict[str, dict[int, list[float]]] = {m: {b: [] for b in BATCHES} for m in engines}
    same = True
    for _ in range(args.rounds):
        for batch in BATCHES:
            ids = prompts(batch, args.prompt, vocab)
            tokens = {}
            for mode, engine in engines.items():
                t_long, tokens[mode] = timed_generate(engine, ids, args.long)
                t_short, _ = timed_generate(engine, ids, args.short)
                steps[mode][batch].append((t_long - t_short) / (args.long - args.short))
            same = same and tokens["eager"] == tokens["compiled"]
    for engine in engines.values():
        engine.shutdown()
    step = {m: {b: statistics.median(v) for b, v in per.items()} for m, per in steps.items()}
    result = {
        "model": path, "threads": args.threads, "prompt": args.prompt, "rounds": args.rounds,
        "startup_s": {m: round(v, 2) for m, v in startup.items()},
        "compile_s_per_bucket": report["decode_graph"].get("compile_seconds", {}),
        "graphs_per_bucket": report["decode_graph"].get("compiled_graphs", {}),
        "decode_tok_s": {m: {str(b): round(b / s, 1) for b, s in per.items()} for m, per in step.items()},
        "decode_step_ms": {m: {str(b): round(1e3 * s, 3) for b, s in per.items()} for m, per in step.items()},
        "speedup": {str(b): round(step["eager"][b] / step["compiled"][b], 3) for b in BATCHES},
        "greedy_tokens_equal": same,
    }
    print(f"model {path}  threads {args.threads}  prompt {args.prompt}  rounds {args.rounds}")
    print(f"{'':24}{'eager':>12}{'compiled':>12}{'ratio':>8}")
    for b in BATCHES:
        e, c = result["decode_tok_s"]["eager"][str(b)], result["decode_tok_s"]["compiled"][str(b)]
        print(f"{f'decode tok/s, batch {b}':24}{e:>12.1f}{c:>12.1f}{result['speedup'][str(b)]:>7.2f}x")
    print(f"{'startup s':24}{startup['eager']:>12.2f}{startup['compiled']:>12.2f}")
    print(f"compile s per bucket {result['compile_s_per_bucket']}  graphs per bucket {result['graphs_per_bucket']}  "
          f"greedy tokens equal: {same}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
