"""The bench step of scripts/gpu_check.py: engine vs transformers, decode step vs the HBM limit,
capture on/off (alternating on, off, off, on: as many runs of each, in an order a linear drift of
the machine cannot bias), weight sync on the paths this machine allows, FlashInfer where it
imports. Every measurement is guarded and every engine is freed before the next one is built."""
from __future__ import annotations

import gc
import importlib.util
import statistics
import time

import torch

import gpu_bench_model as bench


def _free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def _status(ok: bool) -> str:
    return "ok" if ok else "below target"


def capture_order(pairs: int) -> list[bool]:
    """capture on/off runs, ABBA: each as often, their mean positions equal."""
    order: list[bool] = []
    for i in range(pairs):
        order += [True, False] if i % 2 == 0 else [False, True]
    return order


def weight_sync_paths(gpus: int) -> tuple[str, ...]:
    """The weight-sync paths a machine with `gpus` CUDA devices can measure: NCCL refuses two
    ranks on one GPU ("Duplicate GPU detected"), so on one GPU (or none) only the tensor path."""
    return ("tensor", "nccl") if gpus >= 2 else ("tensor",)


def weight_sync_tensor(hf, model, device: str, bucket_bytes: int = 512 << 20) -> dict:
    """The tensor path (update_weights_from_tensor in the engine's process) over the whole model,
    bucket by bucket: each bucket is a fresh copy of its tensors (as a trainer's would be), never
    more than one bucket beyond the model. -> seconds, bytes, GB/s."""
    from rollout.models.loader import load_state_dict_from_tensors, resolve  # noqa: PLC0415

    names = [(k, v) for k, v in hf.state_dict().items() if resolve(model, k) is not None]   # HF names
    total = secs = 0.0
    i = 0
    while i < len(names):
        bucket, size = {}, 0
        while i < len(names) and (not bucket or size + names[i][1].nbytes <= bucket_bytes):
            bucket[names[i][0]] = names[i][1].clone()
            size += names[i][1].nbytes
            i += 1
        bench.sync(device)
        t0 = time.perf_counter()
        load_state_dict_from_tensors(model, bucket)
        bench.sync(device)
        secs += time.perf_counter() - t0
        total += size
        del bucket
    return {"seconds": secs, "bytes": total, "gb_per_s": total / secs / 1e9}


def exact_moe_kernels(report, sec: str, shape, device: str, dtype: torch.dtype, tokens: tuple[int, ...]) -> None:
    """One MoE layer's experts at the model's shape: the batch-invariant kernel (deterministic
    inference) vs the default one (atomics), same routing, median ms side by side; and whether a
    row of the batch is the same bits as that row alone."""
    from bench_moe import timed  # noqa: PLC0415

    from rollout.models.kernels.fused_moe import fused_moe  # noqa: PLC0415
    from rollout.models.kernels.fused_moe_exact import fused_moe_exact  # noqa: PLC0415
    from rollout.models.moe.routing import softmax_topk  # noqa: PLC0415

    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(0)
    w13 = torch.randn(shape.experts, 2 * shape.expert_inter, shape.hidden, generator=gen, device=dev) \
        .mul_(shape.hidden ** -0.5).to(dtype)
    w2 = torch.randn(shape.experts, shape.hidden, shape.expert_inter, generator=gen, device=dev) \
        .mul_(shape.expert_inter ** -0.5).to(dtype)
    repeats = 3 if dev.type == "cpu" else 20
    with torch.inference_mode():
        for n in tokens:
            x = torch.randn(n, shape.hidden, generator=gen, device=dev).to(dtype)
            w, ids = softmax_topk(torch.randn(n, shape.experts, generator=gen, device=dev), shape.top_k, True)
            exact = fused_moe_exact(x, w13, w2, w, ids, 0)
            same = torch.equal(exact[:1], fused_moe_exact(x[:1], w13, w2, w[:1], ids[:1], 0))
            t_exact = timed(lambda: fused_moe_exact(x, w13, w2, w, ids, 0), repeats, dev)
            t_default = timed(lambda: fused_moe(x, w13, w2, w, ids, 0), repeats, dev)
            report.add(sec, f"fused MoE experts T={n} ({str(dtype).removeprefix('torch.')}): batch-invariant / "
                            f"default kernel ms", f"{t_exact * 1e3:.3f} / {t_default * 1e3:.3f} = "
                       f"{t_exact / t_default:.2f}x", "", "", exact_ms=t_exact * 1e3, default_ms=t_default * 1e3)
            report.add(sec, f"fused MoE experts T={n}: batch-invariant row 0 == row 0 alone (bitwise)", same, "True",
                       "ok" if same else "FAIL")


def exact_decode_attention(report, sec: str, shape, device: str, dtype: torch.dtype, batch: int, context: int) -> None:
    """One layer's decode step: the batch-invariant extend kernel (deterministic inference) vs the
    default split-KV decode kernel, median ms side by side; and whether request 0's output in the
    batch is the same bits as alone."""
    from bench_moe import timed  # noqa: PLC0415

    from rollout.models.kernels.decode_attention import decode_attention  # noqa: PLC0415
    from rollout.models.kernels.extend_attention import extend_attention  # noqa: PLC0415

    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(0)
    kv = torch.randn(batch * context, 2, shape.kv_heads, shape.head_dim, generator=gen, device=dev).to(dtype)
    table = torch.randperm(batch * context, generator=gen, device=dev).view(batch, context)
    q = torch.randn(batch, shape.heads, shape.head_dim, generator=gen, device=dev).to(dtype)
    lens = torch.full((batch,), context, device=dev)
    ones = torch.ones(batch, dtype=torch.int64, device=dev)
    scale = shape.head_dim ** -0.5

    def exact(n=batch):
        return extend_attention(q[:n], kv, table[:n], ones[:n], lens[:n], max_extend=1, scale=scale, exact=True)

    with torch.inference_mode():
        same = torch.equal(exact()[:1], exact(1))
        t_exact = timed(exact, 3 if dev.type == "cpu" else 20, dev)
        t_default = timed(lambda: decode_attention(q, kv, table, lens, scale=scale), 3 if dev.type == "cpu" else 20, dev)
    tag = f"B={batch}, context {context} ({str(dtype).removeprefix('torch.')})"
    report.add(sec, f"decode attention {tag}: batch-invariant / default kernel ms",
               f"{t_exact * 1e3:.3f} / {t_default * 1e3:.3f} = {t_exact / t_default:.2f}x", "", "",
               exact_ms=t_exact * 1e3, default_ms=t_default * 1e3)
    report.add(sec, f"decode attention {tag}: batch-invariant request 0 == alone (bitwise)", same, "True",
               "ok" if same else "FAIL")


def run_benchmark(report, smoke: bool, device: str, deadline: float, workdir: str) -> None:
    from gpu_check import guarded  # noqa: PLC0415

    shape = bench.SMOKE if smoke else bench.QWEN3_30B_A3B
    dtype = torch.float32 if smoke else torch.bfloat16
    sec = "benchmark"
    t0 = time.time()
    hf, ours, cfg, model_dir = bench.build_models(shape, device, dtype, workdir)
    params = sum(p.numel() for p in ours.parameters())
    report.add(sec, "model", f"Qwen3-MoE {shape.layers}L h{shape.hidden} E{shape.experts} top{shape.top_k} "
               f"{params / 1e9:.2f}B params {str(dtype).removeprefix('torch.')}, random, built in "
               f"{time.time() - t0:.1f} s")
    if smoke:
        work = dict(prompts=1, samples=8, prompt_lens=(12, 20), new_tokens=(2, 6))
        decode_batches, decode_prompt, decode_steps = (1, 4, 8), 16, 3
        engine = dict(max_running_requests=8, chunked_prefill_size=64, max_total_tokens=1024, context_length=256,
                      decode_graph_batch_sizes=(1, 2, 4, 8), prefill_graph_token_sizes=(32, 64))
    else:
        work = dict(prompts=16, samples=8, prompt_lens=(200, 400), new_tokens=(32, 256))
        decode_batches, decode_prompt, decode_steps = (1, 64, 256), 512, 10
        engine = dict(max_running_requests=256, chunked_prefill_size=8192, max_total_tokens=256 * 640,
                      context_length=2048, decode_graph_batch_sizes=(1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256),
                      prefill_graph_token_sizes=(1024, 4096, 8192))
    engine.update(device=device, dtype="float32" if smoke else "bfloat16")
    batch = bench.rl_batch(shape.vocab, **work)
    kv_per_token = 2 * shape.layers * shape.kv_heads * shape.head_dim * torch.empty((), dtype=dtype).element_size()
    rl_name = f"RL batch {work['prompts']}x{work['samples']}, prompts {work['prompt_lens']}, new {work['new_tokens']}"
    results: dict = {}

    def engine_runs(backend: str, capture: bool, decode: bool, overlap: bool | None = None) -> None:
        """overlap: None as the engine's default (results under (backend, capture)); True / False:
        the overlap schedule on / off (results under ("overlap", overlap))."""
        if time.time() > deadline - 60:
            report.add(sec, f"{backend} capture={'on' if capture else 'off'}", "skipped: time budget", status="skipped")
            return
        t = time.time()
        core = bench.make_core(ours, cfg, model_dir, attention_backend=backend, enable_return_routed_experts=capture,
                               **engine, **({} if overlap is None else {"enable_overlap_schedule": overlap}))
        tag = f"{backend}, capture {'on' if capture else 'off'}" + ("" if overlap is None else
                                                                     f", overlap schedule {'on' if overlap else 'off'}")
        report.add(sec, f"engine start seconds ({tag}; CUDA graphs {'captured' if not smoke else 'n/a on CPU'})",
                   round(time.time() - t, 1))
        try:
            bench.run_engine(core, batch[:2], device, capture)                 # warm-up (compiles kernels)
            r = bench.run_engine(core, batch, device, capture)
            results.setdefault((backend, capture) if overlap is None else ("overlap", overlap), []).append(r["tok_per_s"])
            report.add(sec, f"{rl_name}: output tok/s ({tag})", round(r["tok_per_s"], 1), "",
                       f"{r['tokens']} tokens in {r['seconds']:.2f} s")
            for b in decode_batches if decode else ():
                if time.time() > deadline - 30:
                    report.add(sec, f"decode step B={b} ({tag})", "skipped: time budget", status="skipped")
                    continue
                d = bench.decode_step_time(core, shape.vocab, b, decode_prompt, decode_steps, device)
                limit = bench.hbm_limit_s(ours, shape, b, d["context"], kv_per_token)
                ratio = d["step_s"] / limit["limit_s"]
                report.add(sec, f"decode step B={b}, context {d['context']} ({tag}): ms / HBM-limit ms",
                           f"{d['step_s'] * 1e3:.2f} / {limit['limit_s'] * 1e3:.2f} = {ratio:.2f}x",
                           "<= 2x at B=64" if b == decode_batches[1] else "",
                           _status(ratio <= 2.0) if b == decode_batches[1] else "",
                           bytes_per_step=limit["bytes"])
                report.add(sec, f"decode step B={b} ({tag}): host ms (step less its wait for the device)",
                           round(d["host_s"] * 1e3, 3))
        finally:
            del core
            _free(device)

    backends = ["triton"] + (["flashinfer"] if importlib.util.find_spec("flashinfer") else [])
    order = capture_order(2)
    for capture in order[:2]:
        guarded(report, sec, engine_runs, "triton", capture, capture)

    def transformers_run() -> None:
        room = deadline - time.time() - 60 * len(backends[1:]) - 20
        if room < 20:
            report.add(sec, "transformers generate", "skipped: time budget", status="skipped")
            return
        r = bench.run_hf(hf, batch, device, max_time=min(150.0, room))
        results["hf"] = r["tok_per_s"]
        partial = "" if r["steps"] >= r["longest"] else " (stopped by max_time: partial)"
        report.add(sec, f"{rl_name}: output tok/s (transformers generate)", round(r["tok_per_s"], 1), "",
                   f"{r['tokens']} useful tokens, {r['steps']}/{r['longest']} steps in {r['seconds']:.2f} s{partial}")

    def weight_sync() -> None:
        gpus = torch.cuda.device_count() if device.startswith("cuda") else 0
        for path in weight_sync_paths(gpus):
            if path == "nccl":   # NOTE: a trainer rank on a second GPU; not built into this check yet
                report.add(sec, "weight sync (nccl, trainer on cuda:1)", "not measured by this check", status="skipped")
                continue
            w = weight_sync_tensor(hf, ours, device)
            report.add(sec, "weight sync (tensor path, 512 MB buckets): GB/s", round(w["gb_per_s"], 2), "",
                       f"{w['bytes'] / 1e6:.1f} MB in {w['seconds']:.3f} s")
        if gpus < 2:
            report.add(sec, "weight sync (nccl)", f"skipped: {gpus} GPU(s); NCCL needs a GPU per rank",
                       status="skipped")

    guarded(report, sec, transformers_run)
    guarded(report, sec, exact_moe_kernels, report, sec, shape, device, dtype, (4, 16) if smoke else (64, 4096))
    guarded(report, sec, exact_decode_attention, report, sec, shape, device, dtype, *((4, 64) if smoke else (64, 2048)))
    for backend in backends[1:]:
        guarded(report, sec, engine_runs, backend, True, True)
    guarded(report, sec, weight_sync)
    if time.time() < deadline - 120:
        for capture in order[2:]:     # the second pair, in the other order
            guarded(report, sec, engine_runs, "triton", capture, False)
    if time.time() < deadline - 150:
        # NOTE: the overlap schedule is off by default until this pair says what it gives on a GPU
        for overlap in (True, False):
            guarded(report, sec, engine_runs, "triton", True, False, overlap)
    ov, seq = results.get(("overlap", True)), results.get(("overlap", False))
    if ov and seq:
        report.add(sec, "RL batch: overlap schedule on / off (triton, capture on; one run each)",
                   round(ov[0] / seq[0], 3), "", "", on=ov[0], off=seq[0])
    for backend in backends:
        if (backend, True) in results and "hf" in results:
            ratio = max(results[(backend, True)]) / results["hf"]
            report.add(sec, f"RL batch: engine ({backend}) / transformers", round(ratio, 2), ">= 5",
                       _status(ratio >= 5))
    on, off = results.get(("triton", True), []), results.get(("triton", False), [])
    n = min(len(on), len(off))
    if n:
        # NOTE: complete pairs only (as many runs of each, ABBA): a drift of the machine cancels
        ratio = statistics.mean(on[:n]) / statistics.mean(off[:n])
        report.add(sec, f"RL batch: capture on / off (triton; {n} runs each, alternating)", round(ratio, 3), ">= 0.98", _status(ratio >= 0.98),
                   runs_each=n, on=on[:n], off=off[:n])
