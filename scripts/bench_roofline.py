#!/usr/bin/env python
"""A roofline on this machine: the host's copy bandwidth and matmul throughput, and a decode step
of a ~1 GB Qwen3-MoE-shaped checkpoint (``midsize_moe.SHAPES["roofline"]``: 8 layers, 32 experts,
top-4, hidden 768, float32, built locally once) against the time its bytes take to stream.

    python scripts/bench_roofline.py [--batches 1 8 64] [--prompt 128] [--threads 2] [--json PATH]

Bandwidth: a STREAM-style copy of a 256 MiB float32 buffer into another (read + write bytes over
time, best of 10). Matmul: float32 2048 x 2048 x 2048 (best of 5). A decode step at batch B reads
every weight outside the experts (attention, norms, routers, embeddings and lm_head: the bound
counts all of them), the experts its B tokens are routed to (E(1 - (1 - k/E)^B) per layer on
average under uniform routing: 4 of 32 at B = 1, all 32 at B = 64) and its KV (B x context x
layers x 2 x kv heads x head dim x 4 bytes). The bound is the larger of those bytes over the
bandwidth and the step's FLOPs (2 per active parameter per token) over the matmul rate; beside it the
same bytes at the rate torch's one-row matmul streams weights larger than the caches (a batch-1
step's projections are such matmuls, and their kernel, not the memory, sets that rate). Step times
come from ``midsize_moe.decode_step_s`` (two runs of 8 and 40 new tokens, the difference per step),
each run in a fresh process, engine and transformers alternating.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import midsize_moe  # noqa: E402


def copy_bandwidth(threads: int, mib: int = 256, repeats: int = 10) -> float:
    """Bytes per second of a float32 copy (read + write)."""
    import torch

    torch.set_num_threads(threads)
    src = torch.rand(mib * 2**20 // 4)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() * 4 / best


def row_matmul_bandwidth(threads: int, mib: int = 512) -> float:
    """Weight bytes per second that a one-row matmul (F.linear of [1, 768] over [768, 768]
    weights, the shape of a batch-1 decode's projections) streams, over a pool of weights larger
    than the caches: what torch's CPU kernels make of the bandwidth at batch 1."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    pool = torch.rand(mib * 2**20 // (4 * 768 * 768), 768, 768)
    x = torch.rand(1, 768)
    for w in pool[:8]:
        F.linear(x, w)
    t0 = time.perf_counter()
    for w in pool:
        F.linear(x, w)
    return pool.numel() * 4 / (time.perf_counter() - t0)


def matmul_flops(threads: int, n: int = 2048, repeats: int = 5) -> float:
    import torch

    torch.set_num_threads(threads)
    a, b = torch.rand(n, n), torch.rand(n, n)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best


def step_bytes_and_flops(size: dict, batch: int, context: int) -> tuple[float, float]:
    cfg = size["config"]
    e = cfg.get("num_experts", cfg.get("num_local_experts"))
    k, layers = cfg["num_experts_per_tok"], cfg["num_hidden_layers"]
    touched = e * (1 - (1 - k / e) ** batch)
    kv = batch * context * layers * 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 4
    weights = size["dense"] + touched * layers * size["per_expert"]
    active_params = (size["dense"] + k * layers * size["per_expert"]) / 4
    return weights + kv, 2 * active_params * batch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens per request (the context decoded over)")
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if min(args.batches) < 1 or args.prompt < 1:
        raise SystemExit("--batches and --prompt: values must be >= 1")
    path = midsize_moe.build("roofline")
    size = midsize_moe.parameter_bytes(path)
    bw, flops = copy_bandwidth(args.threads), matmul_flops(args.threads)
    row_bw = row_matmul_bandwidth(args.threads)
    print(f"host ({args.threads} threads): copy {bw / 1e9:.1f} GB/s, one-row matmul streams {row_bw / 1e9:.1f} GB/s, "
          f"float32 matmul {flops / 1e9:.0f} GFLOP/s; "
          f"checkpoint {path}: {size['total'] / 2**30:.2f} GiB ({size['experts'] / 2**30:.2f} GiB experts)", flush=True)
    rows = []
    for b in args.batches:
        context = args.prompt + 24   # NOTE: the middle of the 8..40-token runs
        nbytes, nflops = step_bytes_and_flops(size, b, context)
        bound = max(nbytes / bw, nflops / flops)
        row = {"batch": b, "context": context, "bytes": nbytes, "flops": nflops, "bound_ms": 1e3 * bound,
               "memory_bound": nbytes / bw >= nflops / flops,
               "row_matmul_bound_ms": 1e3 * max(nbytes / row_bw, nflops / flops)}
        for kind in ("engine", "hf"):
            step = midsize_moe.decode_step_s(kind, str(path), b, args.prompt, args.threads)
            row[f"{kind}_ms"] = 1e3 * step
            row[f"{kind}_x_bound"] = step / bound
        rows.append(row)
        print(f"  batch {b}: bound {row['bound_ms']:.2f} ms; engine {row['engine_ms']:.2f} ms "
              f"({row['engine_x_bound']:.2f}x), transformers {row['hf_ms']:.2f} ms ({row['hf_x_bound']:.2f}x)", flush=True)
    print("\n| batch | bytes per step (MB) | bound (ms) | bound at the one-row matmul's rate (ms) | engine step (ms) | "
          "engine / bound | transformers step (ms) | transformers / bound |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        kind = "memory" if r["memory_bound"] else "compute"
        print(f"| {r['batch']} | {r['bytes'] / 1e6:.0f} | {r['bound_ms']:.2f} ({kind}) | {r['row_matmul_bound_ms']:.2f} | "
              f"{r['engine_ms']:.2f} | **{r['engine_x_bound']:.2f}x** | {r['hf_ms']:.2f} | {r['hf_x_bound']:.2f}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": args.threads, "copy_bytes_per_s": bw, "row_matmul_bytes_per_s": row_bw,
                       "matmul_flops_per_s": flops,
                       "checkpoint_bytes": size["total"], "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
