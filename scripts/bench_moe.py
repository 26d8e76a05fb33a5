"""One MoE layer, torch backend vs triton backend, side by side: router (+ capture) and experts.

    python scripts/bench_moe.py [--tokens 1 64 256 4096] [--dtype bfloat16] [--json PATH]
    python scripts/bench_moe.py --tiny --tokens 4 16    # CPU: under TRITON_INTERPRET=1, a smoke run only

Shape: a Qwen3-30B-A3B MoE layer (hidden 2048, 128 experts, top-8, expert intermediate 768) with
random weights made on the device; --tiny: the embedded model's (128, 16, top-4, 32). Times are
the median of --repeats CUDA-event-timed calls after warm-up: "torch" = softmax_topk + capture
record + FusedExperts' own choice of impl (graph_safe, as inside the engine's CUDA graphs),
"triton" = the router kernel (its own capture store) + the fused MoE. "HBM floor" is the bytes of
the experts' weights that the step must read (the experts that received tokens) / 4.8 TB/s (H200).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from capture.capturer import RoutedExpertsBuffer  # noqa: E402
from rollout.models.moe.experts import FusedExperts
from rollout.models.moe.routing import softmax_topk  # noqa: E402

HBM_BYTES_PER_S = 4.8e12
SHAPES = {"qwen3-30b-a3b": dict(hidden=2048, experts=128, top_k=8, inter=768),
          "tiny": dict(hidden=128, experts=16, top_k=4, inter=32)}


def timed(fn, repeats: int, device: torch.device) -> float:
    """Median seconds of one call."""
    for _ in range(2):
        fn()
    out = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
    return statistics.median(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 256, 4096])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--tiny", action="store_true", help="the embedded model's MoE shape")
    ap.add_argument("--json", default=None, help="also write the rows as JSON here")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print("no GPU: run with TRITON_INTERPRET=1 (and --tiny) for a smoke run of the interpreted kernels")
        return 2
    from rollout.models.kernels.fused_moe import fused_moe  # noqa: PLC0415
    from rollout.models.kernels.topk import softmax_topk_triton  # noqa: PLC0415

    name = "tiny" if args.tiny else "qwen3-30b-a3b"
    shape = SHAPES[name]
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    experts = FusedExperts(shape["hidden"], shape["inter"], shape["experts"]).to(device=device, dtype=dtype)
    with torch.no_grad():
        experts.w13.copy_(torch.randn(experts.w13.shape, generator=gen, device=device) * shape["hidden"] ** -0.5)
        experts.w2.copy_(torch.randn(experts.w2.shape, generator=gen, device=device) * shape["inter"] ** -0.5)
    gate = torch.randn(shape["experts"], shape["hidden"], generator=gen, device=device, dtype=dtype) * 0.05
    expert_bytes = (experts.w13[0].numel() + experts.w2[0].numel()) * experts.w13.element_size()
    rows = []
    with torch.inference_mode():
        for n in args.tokens:
            x = torch.randn(n, shape["hidden"], generator=gen, device=device, dtype=dtype)
            buf = RoutedExpertsBuffer(rows=n, num_layers=1, top_k=shape["top_k"], device=device)
            logits = x @ gate.T                                                   # [N, E]

            def torch_layer():
                w, ids = softmax_topk(logits, shape["top_k"], True, capture=buf, layer_id=0)
                return experts(x, w, ids, graph_safe=True)

            def triton_layer():
                w, ids = softmax_topk_triton(logits, shape["top_k"], True, capture=buf, layer_id=0)
                return fused_moe(x, experts.w13, experts.w2, w, ids, 0)

            ref, out = torch_layer().float(), triton_layer().float()
            err = ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item()
            used = int(torch.unique(softmax_topk(logits, shape["top_k"], True)[1]).numel())
            t_torch, t_triton = timed(torch_layer, args.repeats, device), timed(triton_layer, args.repeats, device)
            rows.append(dict(shape=name, dtype=args.dtype, tokens=n, torch_ms=t_torch * 1e3,
                             triton_ms=t_triton * 1e3, speedup=t_torch / t_triton,
                             hbm_floor_ms=used * expert_bytes / HBM_BYTES_PER_S * 1e3, max_rel_err=err,
                             impl_torch=FusedExperts.choose_impl(x, True, n * shape["top_k"])))
    print(f"MoE layer {name} ({args.dtype}) on {torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}")
    print("| tokens | torch ms (impl) | triton ms | speed-up | HBM floor ms | max rel err |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['tokens']} | {r['torch_ms']:.3f} ({r['impl_torch']}) | {r['triton_ms']:.3f} | "
              f"{r['speedup']:.2f}x | {r['hbm_floor_ms']:.3f} | {r['max_rel_err']:.1e} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
