#!/usr/bin/env python
"""How the engine's cost grows with the work, against transformers, on a mid-size Qwen3-MoE
(``midsize_moe.SHAPES["scaling"]``: ~110M parameters, 8 layers, 32 experts, top-4, float32,
random weights built locally once).

    python scripts/bench_scaling.py [--batches 1 8 32 128] [--prompts 64 512 2048 4096] [--new 32]
        [--repeats 1] [--threads 2] [--json PATH]

Part 1, per cell (batch B, prompt P): B requests of P random tokens, `--new` output tokens each
(ignore_eos, temperature 1), one ``generate`` call: the engine (``Rollout.generate``) and
transformers (``generate`` over one batch; equal lengths, so no padding), each in a fresh process
after a warm-up call, the two interleaved; output tok/s, medians over --repeats, and their ratio.
A run the kernel kills (SIGKILL: out of memory) shows as "killed", and the cell has no ratio.

Part 2: one MoE layer (``FusedExperts``, the engine's experts, hidden 512, expert intermediate 256,
top-4) on 1 token (a batch-1 decode step) with 32 to 256 experts held: its time should follow the 4
experts routed to, not the number held.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import midsize_moe  # noqa: E402


def moe_batch1(experts_held: list[int], threads: int, repeats: int = 50) -> list[dict]:
    import torch

    from rollout.models.moe.experts import FusedExperts

    torch.set_num_threads(threads)
    hidden, inter, top_k = 512, 256, 4
    rows = []
    gen = torch.Generator().manual_seed(0)
    for e in experts_held:
        mod = FusedExperts(hidden, inter, e)
        with torch.no_grad():
            mod.w13.copy_(torch.randn(mod.w13.shape, generator=gen) * hidden ** -0.5)
            mod.w2.copy_(torch.randn(mod.w2.shape, generator=gen) * inter ** -0.5)
        x = torch.randn(1, hidden, generator=gen)
        ids = torch.randperm(e, generator=gen)[:top_k][None, :]
        w = torch.full((1, top_k), 1.0 / top_k)
        with torch.inference_mode():
            for _ in range(5):
                mod(x, w, ids)
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                mod(x, w, ids)
                times.append(time.perf_counter() - t0)
        rows.append({"experts": e, "top_k": top_k, "ms": 1e3 * statistics.median(times),
                     "held_mb": (mod.w13.numel() + mod.w2.numel()) * 4 / 2**20})
    return rows


def killed_or_seconds(kind: str, path: str, batch: int, prompt: int, new: int, threads: int) -> float | None:
    """midsize_moe.in_fresh_process's seconds, or None when the run was killed (SIGKILL: the
    kernel's out-of-memory killer, e.g. transformers' prefill of 128 x 4,096 tokens in 24 GiB)."""
    try:
        return midsize_moe.in_fresh_process(kind, path, batch, prompt, new, threads)
    except subprocess.CalledProcessError as err:
        if err.returncode != -signal.SIGKILL:
            raise
        print(f"  batch {batch} prompt {prompt}: {kind} was killed (SIGKILL: out of memory?)", flush=True)
        return None


def tok_s(value: float | None) -> str:
    return "killed" if value is None else f"{value:8.1f} tok/s"


def cell_text(cell: dict) -> str:
    if cell["ratio"] is not None:
        return f"{cell['ratio']:.2f}x ({cell['engine_tok_s']:.0f} / {cell['hf_tok_s']:.0f})"
    eng, hf = (("killed" if v is None else f"{v:.0f}") for v in (cell["engine_tok_s"], cell["hf_tok_s"]))
    return f"{eng} / {hf}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--prompts", type=int, nargs="+", default=[64, 512, 2048, 4096])
    ap.add_argument("--new", type=int, default=32, help="output tokens per request")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--experts", type=int, nargs="+", default=[32, 64, 128, 256], help="part 2's experts held")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    for name in ("batches", "prompts"):
        if min(getattr(args, name)) < 1:
            raise SystemExit(f"--{name}: every value must be >= 1")
    if args.new < 2 or args.repeats < 1:
        raise SystemExit("--new must be >= 2 and --repeats >= 1")
    path = str(midsize_moe.build("scaling"))
    size = midsize_moe.parameter_bytes(midsize_moe.Path(path))
    print(f"checkpoint {path}: {size['total'] / 1e6 / 4:.0f}M parameters ({size['total'] / 2**20:.0f} MiB float32), "
          f"{args.threads} threads, {args.new} new tokens per request", flush=True)
    cells = []
    for b in args.batches:
        for p in args.prompts:
            runs = {"engine": [], "hf": []}
            for _ in range(args.repeats):
                for kind in ("engine", "hf"):
                    runs[kind].append(killed_or_seconds(kind, path, b, p, args.new, args.threads))
            tok = b * args.new
            eng, hf = (None if None in runs[k] else tok / statistics.median(runs[k]) for k in ("engine", "hf"))
            ratio = None if eng is None or hf is None else eng / hf
            cells.append({"batch": b, "prompt": p, "new": args.new, "engine_tok_s": eng, "hf_tok_s": hf,
                          "ratio": ratio, "engine_s": runs["engine"], "hf_s": runs["hf"]})
            print(f"  batch {b:4d} prompt {p:5d}: engine {tok_s(eng)}, transformers {tok_s(hf)}"
                  + (f", {ratio:.2f}x" if ratio is not None else ""), flush=True)
    print("\n| batch \\ prompt | " + " | ".join(str(p) for p in args.prompts) + " |")
    print("|---|" + "---|" * len(args.prompts))
    for b in args.batches:
        row = [c for c in cells if c["batch"] == b]
        print(f"| {b} | " + " | ".join(cell_text(c) for c in row) + " |")
    print("cells: engine / transformers output tok/s (engine tok/s / transformers tok/s)")
    moe = moe_batch1(args.experts, args.threads)
    print("\n| experts held (top-4) | held MiB | MoE layer, 1 token (ms) | vs the fewest |")
    print("|---:|---:|---:|---:|")
    for r in moe:
        print(f"| {r['experts']} | {r['held_mb']:.0f} | {r['ms']:.3f} | {r['ms'] / moe[0]['ms']:.2f}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": args.threads, "cells": cells, "moe_batch1": moe}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
