"""Deterministic vs default engine throughput on bench_throughput's workload (prints a table;
--json writes the numbers). Each run is a fresh engine process; the two modes alternate.

--interleave: instead, one EngineCore per mode in this process, the same requests in both, stepped
alternately (default step, deterministic step, ...) with each step timed: on a shared, loaded
host both modes then see the same load at the same moments, which alternating whole runs does
not give. Both cores first run an untimed warm-up pass; tok/s counts the tokens the engines
emitted over the summed time of their steps (prefill and decode steps alike, no client or
process overhead), so it is the engine's own rate and reads higher than end-to-end runs. --cpu-threads sets the engines' torch threads (1 avoids stalls of a thread pool whose
threads the other jobs keep descheduled)."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_throughput import run_engine, workload  # noqa: E402
from rollout import Rollout  # noqa: E402
from rollout.config import DEFAULT_MODEL_PATH, EngineConfig  # noqa: E402
from rollout.core.engine_core import EngineCore  # noqa: E402
from rollout.core.request import Req  # noqa: E402
from rollout.sampling_params import SamplingParams  # noqa: E402

MODES = ("default", "deterministic")


def interleaved(model_path: str, prompts, max_news, cpu_threads) -> dict[str, float]:
    """tok/s per mode: both engines in this process, stepped alternately, only their steps timed.
    Both first run a warm-up pass (2 prompts x 2 samples, untimed) so that first-call costs (lazy
    kernel and allocator set-up, first-touch pages) are not counted; the tokens are those the
    engines actually emitted (their updates, read between the timed steps), checked against the
    workload's max_new_tokens."""
    cores = {mode: EngineCore(EngineConfig(model_path=model_path, enable_return_routed_experts=True,
                                           enable_deterministic_inference=mode == "deterministic",
                                           cpu_threads=cpu_threads)) for mode in MODES}
    step_all(cores, prompts[:2], [m[:2] for m in max_news[:2]])   # warm-up
    busy, tokens = step_all(cores, prompts, max_news)
    for mode in MODES:
        assert tokens[mode] == sum(map(sum, max_news)), (mode, tokens[mode])
    return {mode: tokens[mode] / busy[mode] for mode in MODES}


def step_all(cores: dict, prompts, max_news) -> tuple[dict[str, float], dict[str, int]]:
    """Adds the requests to every core and steps them alternately to the end: (busy s, tokens emitted)."""
    for core in cores.values():
        for uid, (prompt, k, m) in enumerate((p, k, m) for p, news in zip(prompts, max_news)
                                             for k, m in enumerate(news)):
            core.add_request(Req(uid=uid, rid=str(uid), prompt_ids=prompt, seed=1000 + k, return_logprob=True,
                                 params=SamplingParams(temperature=1.0, max_new_tokens=m, ignore_eos=True),
                                 return_routed_experts=True, max_total_len=core.context_length))
    busy = {mode: 0.0 for mode in cores}
    tokens = {mode: 0 for mode in cores}
    finished = {mode: 0 for mode in cores}
    while any(core.has_work() for core in cores.values()):
        for mode, core in cores.items():
            if core.has_work():
                t0 = time.perf_counter()
                core.step()
                busy[mode] += time.perf_counter() - t0
                for upd in core.take_updates():   # NOTE: untimed (the engine loop sends these between steps)
                    tokens[mode] += len(upd.output_ids) // 4   # int32 bytes
                    finished[mode] += upd.finished
    count = sum(map(len, max_news))
    assert all(n == count for n in finished.values()), (finished, count)
    return busy, tokens


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model-path", default=DEFAULT_MODEL_PATH)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--interleave", action="store_true", help="both modes in this process, stepped alternately")
    ap.add_argument("--cpu-threads", type=int, default=None, help="the engines' torch threads (default: all CPUs)")
    args = ap.parse_args(argv)
    from transformers import AutoConfig

    prompts, max_news = workload(args.prompts, args.n, AutoConfig.from_pretrained(args.model_path).vocab_size)
    rates: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(args.repeats):
        if args.interleave:
            for mode, rate in interleaved(args.model_path, prompts, max_news, args.cpu_threads).items():
                rates[mode].append(rate)
            print("run interleaved: " + ", ".join(f"{m} {r[-1]:.1f} tok/s" for m, r in rates.items()), flush=True)
            continue
        for mode in rates:
            with Rollout(args.model_path, enable_return_routed_experts=True, cpu_threads=args.cpu_threads,
                         enable_deterministic_inference=mode == "deterministic") as engine:
                dt, tokens = run_engine(engine, prompts, max_news, capture=True)
            rates[mode].append(tokens / dt)
            print(f"run {mode}: {tokens} tokens in {dt:.1f} s", flush=True)
    med = {mode: statistics.median(r) for mode, r in rates.items()}
    print(f"{'mode':<15}{'tok/s (median)':>16}  runs")
    for mode, r in rates.items():
        print(f"{mode:<15}{med[mode]:>16.1f}  " + " ".join(f"{x:.1f}" for x in r))
    ratio = med["deterministic"] / med["default"]
    per_run = [d / b for d, b in zip(rates["deterministic"], rates["default"])]
    print(f"deterministic / default: {ratio:.2f}x (per repeat " + ", ".join(f"{x:.2f}" for x in per_run) + ")")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "tok_per_s": rates, "median": med, "ratio": ratio,
                       "ratio_per_repeat": per_run}, f, indent=2)


if __name__ == "__main__":
    main()
