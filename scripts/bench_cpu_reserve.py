"""cpu_reserve A/B: engines with --cpu-reserve 0 and 1 side by side, through the Python API and a
real rollout-serve each, on bench_server's GRPO batch and 64 streaming clients.

    python scripts/bench_cpu_reserve.py [--repeats 5] [--json PATH]

All four engines live for the whole run and the variants alternate within every repeat, so the
machine's background load biases neither; each HTTP client keeps one warmed connection pool.
Prints output tok/s per repeat and the medians (docs/benchmarks-history.md, "Server and engine process").
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bench_server as bs  # noqa: E402

STREAM = {"temperature": 0.0, "max_new_tokens": 64, "ignore_eos": True, "stream_interval": 1}
RESERVES = (0, 1)


async def run(repeats: int) -> dict[str, list[float]]:
    from rollout import Rollout
    from rollout.config import DEFAULT_MODEL_PATH as model

    res: dict[str, list[float]] = {}
    servers = {r: bs.Server(["--model-path", model, "--enable-return-routed-experts", "--cpu-reserve", str(r)])
               for r in RESERVES}
    engines, clients = {}, {}
    try:
        for r in RESERVES:
            engines[r] = Rollout(model, enable_return_routed_experts=True, cpu_reserve=r)
            clients[r] = await bs.HttpClient("aiohttp", servers[r].url, 24 * 8).__aenter__()
            await clients[r].warm()
            warm = bs.grpo_batch(99, prompts=2, samples=2)
            await bs.grpo_server(clients[r], warm, 2)
            bs.grpo_python(engines[r], warm, 2)
        for i in range(repeats):
            batch, streams = bs.grpo_batch(i), bs.workload(64, 32, 0)
            for r in RESERVES:
                wall, n = bs.grpo_python(engines[r], batch, 8)
                res.setdefault(f"grpo_python_r{r}", []).append(n / wall)
                wall, n = await bs.grpo_server(clients[r], batch, 8)
                res.setdefault(f"grpo_server_r{r}", []).append(n / wall)
            for r in RESERVES:
                wall, n, _ = await bs.python_run(engines[r], streams, STREAM)
                res.setdefault(f"streams64_python_r{r}", []).append(n / wall)
                wall, n, _ = await bs.server_run(clients[r], streams, STREAM)
                res.setdefault(f"streams64_server_r{r}", []).append(n / wall)
            print(f"repeat {i}: " + ", ".join(f"{k} {v[-1]:.0f}" for k, v in res.items()), flush=True)
    finally:
        for c in clients.values():
            await c.__aexit__(None, None, None)
        for e in engines.values():
            e.shutdown()
        for s in servers.values():
            s.stop()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None, help="write the per-repeat tok/s here")
    args = ap.parse_args()
    res = asyncio.run(run(args.repeats))
    print("\n| measurement | median tok/s | per repeat |\n|---|---|---|")
    for k, v in sorted(res.items()):
        print(f"| {k} | {statistics.median(v):.0f} | {', '.join(f'{x:.0f}' for x in v)} |")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
