"""Throughput benchmark on an RL-shaped workload (prints a table; --json writes the numbers).

Workload: P prompts of 32-256 tokens, n samples each, per-request max_new_tokens spread over
16-256, ignore_eos. Measured side by side in one run, each in a fresh process, interleaved (the
order rotated by one kind each repeat):
  engine (capture off) | engine (capture on, return_routed_experts) | transformers generate
  (one batch of all requests to the largest max_new_tokens, truncated)
  | engine with a busy torch loop in a thread of the caller, against the quiet engine: with the
  engine on every CPU (the default); with one CPU left to the caller (cpu_threads = CPUs - 1,
  quiet and busy); and with the CPUs split (the engine pinned to all but the first,
  cpu_affinity, and the caller to the first, quiet and busy)
then the model's bare forward at decode batch sizes, and the engine's decode step time at
batch 64 against the model forward inside that step.
Also the routing wire size per token and host store bytes per KV slot (scripts/bench_wire.py).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from typing import Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from rollout import Rollout  # noqa: E402
from rollout.config import DEFAULT_MODEL_PATH, EngineConfig  # noqa: E402
from rollout.cpu_affinity import pin_process  # noqa: E402
from rollout.core.engine_core import EngineCore  # noqa: E402
from rollout.batch.forward_batch import ForwardBatch  # noqa: E402
from rollout.core.request import Req  # noqa: E402
from rollout.sampling_params import SamplingParams  # noqa: E402


def workload(num_prompts: int, n: int, vocab: int, seed: int = 0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(32, 256))] for _ in range(num_prompts)]
    params = []
    for _ in range(num_prompts):
        params.append([rng.randint(16, 256) for _ in range(n)])
    return prompts, params


def rotated(kinds: list, repeat: int) -> list:
    """kinds in the order of repeat number `repeat`: rotated by it, so that over the repeats every
    kind runs in every position (2026-12-04: the first run of each repeat, right after the previous
    repeat's transformers process exited, ran ~5% slower than the same engine run second)."""
    k = repeat % len(kinds)
    return kinds[k:] + kinds[:k]


def run_engine(engine: Rollout, prompts, max_news, capture: bool) -> tuple[float, int]:
    input_ids, sps = [], []
    for prompt, news in zip(prompts, max_news):
        for k, m in enumerate(news):
            input_ids.append(prompt)
            sps.append({"temperature": 1.0, "max_new_tokens": m, "ignore_eos": True, "sampling_seed": 1000 + k})
    assert engine.flush_cache()
    t0 = time.perf_counter()
    outs = engine.generate(input_ids=input_ids, sampling_params=sps, return_logprob=True,
                           return_routed_experts=capture)
    dt = time.perf_counter() - t0
    tokens = sum(len(o.output_ids) for o in outs)
    assert tokens == sum(sum(m) for m in max_news)
    return dt, tokens


def run_hf(model_path: str, prompts, max_news) -> tuple[float, int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    rows = [(p, m) for p, news in zip(prompts, max_news) for m in news]
    width = max(len(p) for p, _ in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, _) in enumerate(rows):   # left padding, as generate wants
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    longest = max(m for _, m in rows)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                             top_p=1.0, max_new_tokens=longest, min_new_tokens=longest, pad_token_id=0)
    dt = time.perf_counter() - t0
    assert out.shape[1] == width + longest
    return dt, sum(m for _, m in rows)   # useful tokens after truncating each row to its max_new_tokens


def in_fresh_process(kind: str, model_path: str, num_prompts: int, n: int,
                     tree: Optional[str] = None) -> tuple[float, int]:
    """One measured run in a fresh Python process: kind "engine", "engine_capture", "engine_overlap"
    (the overlap schedule), "engine_busy_caller" (capture off, a busy torch loop in a thread of the
    caller meanwhile), "engine_spare[_busy_caller]"
    (cpu_threads = CPUs - 1), "engine_pinned[_busy_caller]" (split_cpus), "engine_inproc" or "hf".
    Every run starts from the same state (no malloc tuning, OpenMP pools, heap or page layout
    left by earlier runs), as a user's job would; the caller interleaves the kinds.
    tree: another checkout whose worker (and so whose code) runs instead (scripts/bench_against.py)."""
    tree = tree or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import bench_throughput as b; "
            "print(json.dumps(b.worker(*sys.argv[2:4], int(sys.argv[4]), int(sys.argv[5]))))")
    out = subprocess.run([sys.executable, "-c", code, os.path.join(tree, "scripts"), kind, model_path,
                          str(num_prompts), str(n)], check=True, capture_output=True, text=True, cwd=tree)
    dt, tokens = json.loads(out.stdout.strip().splitlines()[-1])
    return dt, tokens


def spare_threads() -> int:
    """Engine threads that leave one usable CPU to the caller."""
    return max(1, EngineConfig(model_path=DEFAULT_MODEL_PATH).resolved_cpu_threads - 1)


def split_cpus() -> tuple[list[int], list[int]]:
    """(the caller's CPUs, the engine's): the first usable CPU, and the rest."""
    usable = sorted(os.sched_getaffinity(0))
    return usable[:1], usable[1:]


def worker(kind: str, model_path: str, num_prompts: int, n: int) -> tuple[float, int]:
    from transformers import AutoConfig

    prompts, max_news = workload(num_prompts, n, AutoConfig.from_pretrained(model_path).vocab_size)
    if kind == "hf":
        return run_hf(model_path, prompts, max_news)
    capture = kind == "engine_capture"
    threads = spare_threads() if kind.startswith("engine_spare") else None
    client = "inproc" if kind == "engine_inproc" else "process"
    mine, engine_cpus = split_cpus() if kind.startswith("engine_pinned") else ([], [])
    with Rollout(model_path, enable_return_routed_experts=capture, cpu_threads=threads, client=client,
                 cpu_affinity=engine_cpus, enable_overlap_schedule=kind == "engine_overlap") as engine:
        if mine:   # the caller's threads (those torch made already too) off the engine's CPUs
            pin_process(mine)
        run_engine(engine, prompts[:2], [m[:2] for m in max_news[:2]], capture)   # warm-up
        if not kind.endswith("busy_caller"):
            return run_engine(engine, prompts, max_news, capture)
        stop = threading.Event()
        busy = threading.Thread(target=busy_torch_loop, args=(stop,), daemon=True)
        busy.start()
        try:
            return run_engine(engine, prompts, max_news, capture)
        finally:
            stop.set()
            busy.join()


def busy_torch_loop(stop: threading.Event) -> None:
    """What a trainer's reward or bookkeeping thread does next to the engine: small torch ops, no pause."""
    a = torch.randn(64, 64)
    while not stop.is_set():
        (a @ a).sum().item()


def compare_inproc(args, total: int, res: dict) -> None:
    runs: dict[str, list[float]] = {"engine": [], "engine_inproc": []}
    for r in range(args.repeats):
        for kind, times in rotated(list(runs.items()), r):
            dt, tokens = in_fresh_process(kind, args.model_path, args.prompts, args.n)
            assert tokens == total, (kind, tokens, total)
            times.append(dt)
    res.update({f"{k}_runs_s": v for k, v in runs.items()})
    res.update({f"{k}_tok_s": total / statistics.median(v) for k, v in runs.items()})
    per = ", ".join(f"{p / i:.2f}" for p, i in zip(runs["engine"], runs["engine_inproc"]))   # times: inverse
    print("\n| client | output tok/s (median) | ratio |\n|---|---|---|")
    print(f"| process (engine process, the default) | {res['engine_tok_s']:.0f} | 1.00 |")
    print(f"| inproc (engine loop on a thread of the caller) | {res['engine_inproc_tok_s']:.0f} | "
          f"{res['engine_inproc_tok_s'] / res['engine_tok_s']:.3f} (per repeat {per}) |")
    write_json(args.json, res)


def write_json(path: Optional[str], res: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(res, f, indent=2)
        print(f"wrote {path}")


def decode_batch(core: EngineCore, bsz: int, ctx: int) -> ForwardBatch:
    slots = core.kv_pool.alloc(bsz * (ctx + 1))
    assert slots is not None, "KV pool too small for the bare-forward benchmark"
    per = slots.view(bsz, ctx + 1)
    fb = ForwardBatch.build(input_ids=[5] * bsz, out_cache_loc=per[:, -1].clone(), prefix_lens=[ctx] * bsz,
                            extend_lens=[1] * bsz, kv_indices=per, kv_pool=core.kv_pool)
    core.kv_pool.free(slots)
    return fb


@torch.inference_mode()
def bare_forward_time(core: EngineCore, bsz: int, ctx: int, repeats: int) -> float:
    fb = decode_batch(core, bsz, ctx)
    core.model(fb)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        core.model(fb)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def engine_decode_overhead(model_path: str, bsz: int, prompt_len: int, new: int, capture: bool,
                           overlap: bool = False) -> dict:
    """Engine decode step time at batch bsz vs the model forward inside that step (with the overlap
    schedule: the steps' wall time vs the forwards on the forward thread)."""
    core = EngineCore(EngineConfig(model_path=model_path, enable_return_routed_experts=capture,
                                   max_running_requests=bsz, enable_overlap_schedule=overlap))
    rng = random.Random(1)
    for i in range(bsz):
        core.add_request(Req(uid=i, rid=str(i), prompt_ids=[rng.randrange(3, 500) for _ in range(prompt_len)],
                             params=SamplingParams(temperature=1.0, max_new_tokens=new, ignore_eos=True),
                             seed=i, return_routed_experts=capture, max_total_len=core.context_length))
    while core.scheduler.waiting:
        core.step()
    started: list[float] = []
    fwd_times: list[float] = []
    # NOTE: the model forwards are timed during the very steps they belong to, so background load on
    # a shared machine hits the steps and their forwards alike.
    pre = core.model.register_forward_pre_hook(lambda *_: started.append(time.perf_counter()))
    post = core.model.register_forward_hook(lambda *_: fwd_times.append(time.perf_counter() - started.pop()))
    step_times = []
    while core.has_work():
        t0 = time.perf_counter()
        core.step()
        step_times.append(time.perf_counter() - t0)
    pre.remove()
    post.remove()
    core.close()
    step = statistics.median(step_times)
    bare = statistics.median(fwd_times)
    return {"batch": bsz, "capture": capture, "overlap": overlap, "step_ms": step * 1e3,
            "model_forward_ms": bare * 1e3, "overhead": 1 - bare / step}


def overhead_in_fresh_process(model_path: str, capture: bool, overlap: bool) -> dict:
    """engine_decode_overhead at batch 64 in a fresh Python process (an OpenMP pool left by an
    earlier engine in this process would throttle the forward thread's)."""
    here = os.path.dirname(os.path.abspath(__file__))
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import bench_throughput as b; "
            "print(json.dumps(b.engine_decode_overhead(sys.argv[2], 64, 144, 64, sys.argv[3] == '1', sys.argv[4] == '1')))")
    out = subprocess.run([sys.executable, "-c", code, here, model_path, str(int(capture)), str(int(overlap))],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def compare_overlap(args, total: int, res: dict) -> None:
    """The sequential engine loop against the overlap schedule (enable_overlap_schedule): the
    workload's tok/s and the batch-64 decode step against its model forward, in fresh processes,
    alternating."""
    runs: dict[str, list[float]] = {"engine": [], "engine_overlap": []}
    steps: dict[bool, list[dict]] = {False: [], True: []}
    for r in range(args.repeats):
        for kind, times in rotated(list(runs.items()), r):
            dt, tokens = in_fresh_process(kind, args.model_path, args.prompts, args.n)
            assert tokens == total, (kind, tokens, total)
            times.append(dt)
        for overlap, mine in steps.items():
            mine.append(overhead_in_fresh_process(args.model_path, True, overlap))
    res.update({f"{k}_runs_s": v for k, v in runs.items()})
    res.update({f"{k}_tok_s": total / statistics.median(v) for k, v in runs.items()})
    res["decode_overhead_runs"] = steps[False] + steps[True]
    res["decode_overhead"] = [{key: statistics.median(r[key] for r in mine) for key in
                               ("step_ms", "model_forward_ms", "overhead")} | {"batch": 64, "capture": True,
                                                                              "overlap": overlap}
                              for overlap, mine in steps.items()]
    per = ", ".join(f"{p / o:.2f}" for p, o in zip(runs["engine"], runs["engine_overlap"]))   # times: inverse
    print("\n| engine loop | output tok/s (median) | ratio | batch-64 decode step ms | model forward ms | "
          "engine overhead |\n|---|---|---|---|---|---|")
    for (kind, label), r in zip((("engine", "sequential (the default)"),
                                 ("engine_overlap", "overlap schedule")), res["decode_overhead"]):
        ratio = "1.00" if kind == "engine" else f"{res[kind + '_tok_s'] / res['engine_tok_s']:.3f} (per repeat {per})"
        print(f"| {label} | {res[kind + '_tok_s']:.0f} | {ratio} | {r['step_ms']:.2f} | {r['model_forward_ms']:.2f} | "
              f"{100 * r['overhead']:.1f}% |")
    write_json(args.json, res)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=DEFAULT_MODEL_PATH)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3,
                    help="repeats of: engine capture off, engine capture on (fresh engine each), transformers; "
                         "and of the batch-64 overhead runs (medians reported)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--inproc", action="store_true",
                    help="only: the engine process (default client) against the same engine loop on a thread of "
                         "the caller (client='inproc', the layout before the engine had a process), alternating")
    ap.add_argument("--overlap", action="store_true",
                    help="only: the sequential engine loop against the overlap schedule (enable_overlap_schedule), "
                         "tok/s and the batch-64 decode step's overhead, alternating")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    res: dict = {"torch": torch.__version__, "threads": torch.get_num_threads(), "model": args.model_path}
    with Rollout(args.model_path, enable_return_routed_experts=True) as probe:
        vocab = probe.info.vocab_size
    prompts, max_news = workload(args.prompts, args.n, vocab)
    total = sum(sum(m) for m in max_news)
    print(f"workload: {args.prompts} prompts x n={args.n}, {total} output tokens")

    # NOTE: every run in a fresh process, interleaved: one engine alive at a time (libgomp
    # throttles every OpenMP pool once more OpenMP threads exist than CPUs), each run from the
    # same process state, and the kinds side by side under the same background load.
    if args.inproc:
        return compare_inproc(args, total, res)
    if args.overlap:
        return compare_overlap(args, total, res)
    t_off, t_on, t_busy, t_hf, t_spare, t_spare_busy = [], [], [], [], [], []
    t_pinned, t_pinned_busy = [], []
    useful = total
    kinds = [("engine", t_off), ("engine_capture", t_on), ("engine_busy_caller", t_busy),
             ("engine_spare", t_spare), ("engine_spare_busy_caller", t_spare_busy)]
    kinds += [("engine_pinned", t_pinned), ("engine_pinned_busy_caller", t_pinned_busy)] if split_cpus()[1] else []
    kinds += [] if args.skip_hf else [("hf", t_hf)]
    for r in range(args.repeats):
        for kind, times in rotated(kinds, r):
            dt, tokens = in_fresh_process(kind, args.model_path, args.prompts, args.n)
            if kind == "hf":
                useful = tokens
            else:
                assert tokens == total, (kind, tokens, total)
            times.append(dt)
    tps_off, tps_on = total / statistics.median(t_off), total / statistics.median(t_on)
    res["engine_tok_s"], res["engine_capture_tok_s"] = tps_off, tps_on
    res["capture_on_off_ratio"] = tps_on / tps_off
    res["engine_runs_s"], res["engine_capture_runs_s"] = t_off, t_on
    res["engine_busy_caller_tok_s"] = total / statistics.median(t_busy)
    res["engine_busy_caller_runs_s"] = t_busy
    res["busy_caller_ratio"] = res["engine_busy_caller_tok_s"] / tps_off
    res["spare_threads"] = spare_threads()
    res["engine_spare_tok_s"] = total / statistics.median(t_spare)
    res["engine_spare_busy_caller_tok_s"] = total / statistics.median(t_spare_busy)
    res["engine_spare_runs_s"], res["engine_spare_busy_caller_runs_s"] = t_spare, t_spare_busy
    res["spare_busy_caller_ratio"] = res["engine_spare_busy_caller_tok_s"] / res["engine_spare_tok_s"]
    if t_pinned:
        res["caller_cpus"], res["engine_cpus"] = split_cpus()
        res["engine_pinned_tok_s"] = total / statistics.median(t_pinned)
        res["engine_pinned_busy_caller_tok_s"] = total / statistics.median(t_pinned_busy)
        res["engine_pinned_runs_s"], res["engine_pinned_busy_caller_runs_s"] = t_pinned, t_pinned_busy
        res["pinned_busy_caller_ratio"] = res["engine_pinned_busy_caller_tok_s"] / res["engine_pinned_tok_s"]
    if t_hf:
        res["hf_tok_s"] = useful / statistics.median(t_hf)
        res["hf_runs_s"] = t_hf
        res["engine_vs_hf"] = tps_off / res["hf_tok_s"]
        # per repeat, each engine run against the transformers run next to it
        res["engine_vs_hf_per_repeat"] = [h / e for e, h in zip(t_off, t_hf)]
    core = EngineCore(EngineConfig(model_path=args.model_path))
    res["bare_forward"] = []
    for bsz in (1, 8, 32, 64, 128):
        t = bare_forward_time(core, bsz, 200, 10)
        res["bare_forward"].append({"batch": bsz, "ctx": 200, "ms": t * 1e3, "tok_s": bsz / t})
    del core
    runs = [engine_decode_overhead(args.model_path, 64, 144, 64, cap)
            for _ in range(args.repeats) for cap in (False, True)]
    res["decode_overhead_runs"] = runs
    res["decode_overhead"] = []
    for cap in (False, True):
        mine = [r for r in runs if r["capture"] == cap]
        res["decode_overhead"].append({key: statistics.median(r[key] for r in mine) for key in
                                       ("step_ms", "model_forward_ms", "overhead")} | {"batch": 64, "capture": cap})

    print("\n| measurement | output tok/s | ratio |")
    print("|---|---|---|")
    print(f"| engine, capture off | {tps_off:.0f} | 1.00 |")
    print(f"| engine, capture on (return_routed_experts) | {tps_on:.0f} | {tps_on / tps_off:.3f} (on/off) |")
    print(f"| engine, a busy torch loop in the caller's thread | {res['engine_busy_caller_tok_s']:.0f} | "
          f"{res['busy_caller_ratio']:.3f} (busy/quiet) |")
    spare = f"cpu_threads={res['spare_threads']}"
    print(f"| engine, {spare} (a CPU left to the caller) | {res['engine_spare_tok_s']:.0f} | "
          f"{res['engine_spare_tok_s'] / tps_off:.3f} (vs every CPU) |")
    print(f"| engine, {spare}, a busy torch loop in the caller's thread | "
          f"{res['engine_spare_busy_caller_tok_s']:.0f} | {res['spare_busy_caller_ratio']:.3f} (busy/quiet) |")
    if t_pinned:
        split = f"cpu_affinity={res['engine_cpus']}, the caller on CPU(s) {res['caller_cpus']}"
        print(f"| engine, {split} | {res['engine_pinned_tok_s']:.0f} | "
              f"{res['engine_pinned_tok_s'] / tps_off:.3f} (vs every CPU) |")
        print(f"| engine, {split}, a busy torch loop in the caller's thread | "
              f"{res['engine_pinned_busy_caller_tok_s']:.0f} | {res['pinned_busy_caller_ratio']:.3f} (busy/quiet; "
              f"{res['engine_pinned_busy_caller_tok_s'] / tps_off:.3f} of every CPU quiet) |")
    if "hf_tok_s" in res:
        per = ", ".join(f"{x:.2f}" for x in res["engine_vs_hf_per_repeat"])
        print(f"| transformers generate (batched, truncated) | {res['hf_tok_s']:.0f} | "
              f"{res['engine_vs_hf']:.2f}x (engine/hf; per repeat {per}) |")
    print("\n| bare forward, decode batch | ctx | ms/step | tok/s |")
    print("|---|---|---|---|")
    for r in res["bare_forward"]:
        print(f"| {r['batch']} | {r['ctx']} | {r['ms']:.2f} | {r['tok_s']:.0f} |")
    print("\n| engine decode step, batch 64 | step ms | model forward ms | engine overhead |")
    print("|---|---|---|---|")
    for r in res["decode_overhead"]:
        print(f"| capture {'on' if r['capture'] else 'off'} | {r['step_ms']:.2f} | {r['model_forward_ms']:.2f} | "
              f"{100 * r['overhead']:.1f}% |")
    import bench_wire

    wire = [bench_wire.bench(s, 4096, 3) for s in bench_wire.SHAPES]
    print()
    bench_wire.print_table(wire)
    res["wire"] = wire
    write_json(args.json, res)


if __name__ == "__main__":
    main()
