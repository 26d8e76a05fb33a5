"""Server benchmark: a real rollout-serve process vs the same workload through the Python API.

    python scripts/bench_server.py [--model-path DIR] [--concurrency 1 16 64] [--prompt-len 32]
                                   [--max-new-tokens 64] [--stream-interval 1] [--grpo-repeats 3]
                                   [--cpu-threads N] [--cpu-reserve N] [--cpu-affinity N ...]
                                   [--json PATH]

GRPO batch (first): 24 prompts x 8 samples (prompts of 32-200 tokens, 16-128 new tokens per
prompt, temperature 1, ignore_eos, logprobs and routing on) sent the way slime sends it, one
concurrent non-streaming /generate per sample, against one `Rollout.generate` call with n=8;
output tokens/s, alternating, every repeat reported and the median ratio.

Workload: closed-loop clients, each sending streaming greedy requests (random prompt ids,
ignore_eos, routing on in int32) one after another. For each concurrency c it reports output
tokens/s (all tokens / wall time) and the p50/p99 time per output token, where the samples are
the gaps between consecutive streamed tokens of a request (each chunk is one token). The same
runs go through `Rollout.async_generate(stream=True)` in-process ("python" rows): the difference
is the server's overhead (HTTP, JSON, SSE, base64 routing). Both alternate, best of --repeats. Response bytes per output token are
measured for non-streaming and streaming /generate responses without routing and with each
routing format.

One HTTP client (one connection pool) serves every repeat against a server, opened and warmed
before the first: slime keeps one global client for a whole training run, AReaL one session per
engine, so a trainer's rollouts reuse kept-alive connections instead of opening one per request.

With --cpu-affinity the engine processes of both sides run on the CPUs listed, and everything
else on the usable CPUs left: this process (the load generator, the Python API's front end) and
rollout-serve's front end (which moves itself there).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import psutil  # noqa: E402


class HttpClient:
    """The load generator's HTTP client: aiohttp (as AReaL's client) or httpx (as slime's).

    NOTE: the client runs on the same two cores as the server and its engine, so its CPU time is
    taken from the engine: httpx spends about ten times aiohttp's CPU per request with a few hundred
    requests in flight (the tables report the client's CPU seconds)."""

    def __init__(self, lib: str, url: str, connections: int):
        self.lib, self.url, self.connections = lib, url, connections + 8

    async def __aenter__(self) -> "HttpClient":
        if self.lib == "aiohttp":
            import aiohttp  # noqa: PLC0415

            self.session = aiohttp.ClientSession(self.url, connector=aiohttp.TCPConnector(limit=self.connections),
                                                 timeout=aiohttp.ClientTimeout(total=600))
        else:
            limits = httpx.Limits(max_connections=self.connections, max_keepalive_connections=self.connections)
            self.session = httpx.AsyncClient(base_url=self.url, timeout=600, limits=limits)
        return self

    async def __aexit__(self, *exc) -> None:
        await (self.session.close() if self.lib == "aiohttp" else self.session.aclose())

    async def post_json(self, path: str, body: dict) -> dict:
        if self.lib == "aiohttp":
            async with self.session.post(path, json=body) as r:
                r.raise_for_status()
                return await r.json()
        r = await self.session.post(path, json=body)
        r.raise_for_status()
        return r.json()

    async def warm(self) -> None:
        """Opens the pool's connections (one concurrent 1-token request on each)."""
        body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 1}}
        await asyncio.gather(*[self.post_json("/generate", body) for _ in range(self.connections - 8)])

    async def stream_lines(self, path: str, body: dict):
        if self.lib == "aiohttp":
            async with self.session.post(path, json=body) as r:
                r.raise_for_status()
                async for raw in r.content:
                    yield raw.decode().rstrip("\r\n")
            return
        async with self.session.stream("POST", path, json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                yield line


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def workload(c: int, prompt_len: int, seed: int) -> list[list[list[int]]]:
    """Per client, the prompts it sends in order."""
    per_client = max(1, {1: 8, 16: 4}.get(c, 2))
    rng = random.Random(seed * 1000 + c)
    return [[[rng.randrange(3, 500) for _ in range(prompt_len)] for _ in range(per_client)] for _ in range(c)]


def summarize(name: str, c: int, wall: float, tokens: int, gaps: list[float]) -> dict:
    return {"api": name, "concurrency": c, "requests_tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "tpot_p50_ms": 1e3 * percentile(gaps, 50), "tpot_p99_ms": 1e3 * percentile(gaps, 99)}


# ---- server side ----------------------------------------------------------------------------------
def _forwards(stats: dict) -> tuple[int, int]:
    return stats["num_prefill_forwards"], stats["num_decode_forwards"]


class Server:
    def __init__(self, flags: list[str], tree: Path = ROOT):
        """rollout-serve of `tree`'s code (another checkout: scripts/bench_against.py --bench server)."""
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        env = dict(os.environ, PYTHONPATH=str(tree), TOKENIZERS_PARALLELISM="false")
        # NOTE: `-m` from the tree's root: its engine processes (python -m ...) then import the tree's code too
        cmd = [sys.executable, "-m", "rollout.server"]
        self.proc = subprocess.Popen(cmd + ["--host", "127.0.0.1", "--port", "0", "--log-level", "warning"] + flags,
                                     stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=str(tree))
        deadline = time.monotonic() + 120
        while True:
            m = re.search(r"listening on (http://\S+)", Path(self.log.name).read_text())
            if m:
                self.url = m.group(1)
                break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(Path(self.log.name).read_text())
            time.sleep(0.05)
        while httpx.get(self.url + "/health").status_code != 200:
            time.sleep(0.05)

    def cpu_seconds(self) -> float:
        """CPU time of the server's front-end process (HTTP, JSON, detokenization; not its engine)."""
        t = psutil.Process(self.proc.pid).cpu_times()
        return t.user + t.system

    def forwards(self) -> tuple[int, int]:
        """(prefill, decode) forwards the server's engine has run."""
        return _forwards(httpx.get(self.url + "/server_info", timeout=30).json()["internal_states"][0])

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(30)
        os.unlink(self.log.name)


async def server_run(http: HttpClient, prompts: list[list[list[int]]], params: dict) -> tuple[float, int, list[float]]:
    gaps: list[float] = []
    tokens = 0

    async def client(http: HttpClient, mine: list[list[int]]) -> None:
        nonlocal tokens
        for p in mine:
            body = {"input_ids": p, "sampling_params": params, "stream": True, "return_routed_experts": True,
                    "incremental_streaming_output": True}   # chunks count their own tokens
            last = None
            async for line in http.stream_lines("/generate", body):
                if not line.startswith("data: {"):
                    continue
                n = len(json.loads(line[6:])["output_ids"])
                now = time.perf_counter()
                if last is not None and n:
                    gaps.append((now - last) / n)
                last = now
                tokens += n

    t0 = time.perf_counter()
    await asyncio.gather(*[client(http, mine) for mine in prompts])
    return time.perf_counter() - t0, tokens, gaps


def response_bytes(url: str, prompt_len: int, params: dict, seed: int) -> list[dict]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 500) for _ in range(prompt_len)] for _ in range(8)]
    rows = []
    with httpx.Client(base_url=url, timeout=600) as c:
        for fmt in ("none", "int32", "compact"):
            extra = {} if fmt == "none" else {"return_routed_experts": True, "routed_experts_format": fmt}
            for stream in (False, True):
                nbytes = tokens = 0
                for p in prompts:
                    body = {"input_ids": p, "sampling_params": params, "stream": stream, "return_logprob": True,
                            "incremental_streaming_output": True, **extra}
                    r = c.post("/generate", json=body)
                    nbytes += len(r.content)
                    tokens += params["max_new_tokens"]
                rows.append({"routing": fmt, "stream": stream, "bytes_per_output_token": nbytes / tokens,
                             "bytes_per_request": nbytes / len(prompts)})
    return rows


# ---- the GRPO batch ----------------------------------------------------------------------------
def grpo_batch(seed: int, prompts: int = 24, samples: int = 8) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(3, 500) for _ in range(rng.randint(32, 200))], rng.randint(16, 128))
            for _ in range(prompts)]


def grpo_params(new: int, n: int = 1) -> dict:
    return {"temperature": 1.0, "max_new_tokens": new, "ignore_eos": True, "n": n}


async def grpo_server(http: HttpClient, batch: list[tuple[list[int], int]], samples: int) -> tuple[float, int]:
    async def one(ids: list[int], new: int) -> int:
        body = {"input_ids": ids, "sampling_params": grpo_params(new), "return_logprob": True,
                "return_routed_experts": True}
        return (await http.post_json("/generate", body))["meta_info"]["completion_tokens"]

    t0 = time.perf_counter()
    counts = await asyncio.gather(*[one(ids, new) for ids, new in batch for _ in range(samples)])
    return time.perf_counter() - t0, sum(counts)


def grpo_python(engine, batch: list[tuple[list[int], int]], samples: int) -> tuple[float, int]:
    t0 = time.perf_counter()
    outs = engine.generate(input_ids=[ids for ids, _ in batch],
                           sampling_params=[grpo_params(new, samples) for _, new in batch],
                           return_logprob=True, return_routed_experts=True)
    return time.perf_counter() - t0, sum(len(o.output_ids) for o in outs)


async def grpo_rows(model_path: str, repeats: int, seed: int, client_lib: str, cpu: dict) -> dict:
    from rollout import Rollout

    srv = Server(["--model-path", model_path, "--enable-return-routed-experts"] + cpu_flags(cpu))
    rows = []
    try:
        with Rollout(model_path, enable_return_routed_experts=True,
                     **{k: v for k, v in cpu.items() if v is not None}) as engine:
            async with HttpClient(client_lib, srv.url, 24 * 8) as http:
                await http.warm()
                warm = grpo_batch(seed + 99, prompts=2, samples=2)
                await grpo_server(http, warm, 2)
                grpo_python(engine, warm, 2)
                for i in range(repeats):
                    batch = grpo_batch(seed + i)
                    for name in ("python", "server"):
                        count = srv.forwards if name == "server" else lambda: _forwards(engine.stats())
                        cpu0, fw0 = (time.process_time(), srv.cpu_seconds()), count()
                        wall, tokens = grpo_python(engine, batch, 8) if name == "python" \
                            else await grpo_server(http, batch, 8)
                        fw = [b - a for a, b in zip(fw0, count())]
                        rows.append({"api": name, "repeat": i, "wall_s": wall, "tokens": tokens,
                                     "tokens_per_s": tokens / wall, "client_cpu_s": time.process_time() - cpu0[0],
                                     "server_cpu_s": srv.cpu_seconds() - cpu0[1], "prefill_forwards": fw[0],
                                     "decode_forwards": fw[1]})
    finally:
        srv.stop()
    ratios = sorted(s["tokens_per_s"] / p["tokens_per_s"] for p, s in zip(rows[::2], rows[1::2]))
    return {"rows": rows, "ratios": ratios, "median_ratio": ratios[len(ratios) // 2], "client": client_lib}


def cpu_flags(cpu: dict) -> list[str]:
    """The server flags of the engine settings `cpu` (cpu_threads, cpu_reserve, cpu_affinity) that are set."""
    return [x for k, v in cpu.items() if v is not None
            for x in ("--" + k.replace("_", "-"), *map(str, v if isinstance(v, (list, tuple)) else [v]))]


# ---- python side ----------------------------------------------------------------------------------
async def python_run(engine, prompts: list[list[list[int]]], params: dict) -> tuple[float, int, list[float]]:
    gaps: list[float] = []
    tokens = 0

    async def client(mine: list[list[int]]) -> None:
        nonlocal tokens
        for p in mine:
            last = None
            async for chunk in engine.async_generate(input_ids=[p], sampling_params=params, stream=True,
                                                     return_routed_experts=True):
                n = len(chunk.output_ids)
                now = time.perf_counter()
                if last is not None and n:
                    gaps.append((now - last) / n)
                last = now
                tokens += n

    t0 = time.perf_counter()
    await asyncio.gather(*[client(mine) for mine in prompts])
    return time.perf_counter() - t0, tokens, gaps


def main() -> None:
    asyncio.run(amain())


async def amain() -> None:
    from rollout.config import DEFAULT_MODEL_PATH

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=DEFAULT_MODEL_PATH)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=2, help="runs per (api, concurrency); the best is kept")
    ap.add_argument("--stream-interval", type=int, default=1, help="sampling_params.stream_interval (tokens/chunk)")
    ap.add_argument("--grpo-repeats", type=int, default=3, help="GRPO batch runs per api (0: skip)")
    ap.add_argument("--client", choices=("aiohttp", "httpx"), default="aiohttp",
                    help="the load generator's HTTP client (it shares the machine's cores with the server)")
    ap.add_argument("--cpu-threads", type=int, default=None,
                    help="torch threads of the engine process, both sides (default: every usable CPU)")
    ap.add_argument("--cpu-reserve", type=int, default=None,
                    help="threads the engine leaves to the front end while requests stream, both sides (default: 0)")
    ap.add_argument("--cpu-affinity", type=int, nargs="+", default=None,
                    help="CPUs of the engine processes, both sides; the rest of the work runs on the other CPUs")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    from rollout.cpu_affinity import keep_off

    keep_off(args.cpu_affinity or ())
    params = {"temperature": 0.0, "max_new_tokens": args.max_new_tokens, "ignore_eos": True,
              "stream_interval": args.stream_interval}
    flags = ["--model-path", args.model_path, "--enable-return-routed-experts", "--disable-prefix-caching"]
    cpu = {"cpu_threads": args.cpu_threads, "cpu_reserve": args.cpu_reserve,
           "cpu_affinity": tuple(args.cpu_affinity) if args.cpu_affinity else None}
    flags += cpu_flags(cpu)
    results: dict = {"config": vars(args), "throughput": [], "bytes": []}
    if args.grpo_repeats:
        results["grpo"] = grpo = await grpo_rows(args.model_path, args.grpo_repeats, args.seed, args.client, cpu)
        print("\nGRPO batch: 24 prompts x 8 samples, one non-streaming /generate per sample vs one "
              "Rollout.generate(n=8); logprobs + routing on")
        print(f"(client: {args.client}; CPU seconds of the benchmark process (the client, or the Python API's "
              f"front end) and of the server's front-end process during each run)")
        print(f"{'api':<8}{'repeat':>8}{'tokens':>8}{'wall s':>9}{'tok/s':>9}{'client cpu s':>14}{'server cpu s':>14}"
              f"{'prefill fw':>12}{'decode fw':>11}")
        for r in grpo["rows"]:
            print(f"{r['api']:<8}{r['repeat']:>8}{r['tokens']:>8}{r['wall_s']:>9.2f}{r['tokens_per_s']:>9.0f}"
                  f"{r['client_cpu_s']:>14.2f}{r['server_cpu_s']:>14.2f}{r['prefill_forwards']:>12}"
                  f"{r['decode_forwards']:>11}")
        print(f"server/python tok/s per repeat: {', '.join(f'{x:.2f}' for x in grpo['ratios'])}; "
              f"median {grpo['median_ratio']:.2f}")

    from rollout import Rollout

    # NOTE: both run side by side and alternate (best of --repeats each), so that load from
    # other processes on a shared machine biases neither.
    srv = Server(flags)
    try:
        with Rollout(args.model_path, enable_return_routed_experts=True, enable_prefix_caching=False,
                     **{k: v for k, v in cpu.items() if v is not None}) as engine:
            async with HttpClient(args.client, srv.url, max(args.concurrency)) as http:
                await http.warm()
                for c in args.concurrency:
                    warm = workload(c, args.prompt_len, args.seed + 99)[:1]
                    await server_run(http, warm, params)
                    await python_run(engine, warm, params)
                    best: dict = {}
                    for _ in range(args.repeats):
                        for name, run in (("python", lambda w: python_run(engine, w, params)),
                                          ("server", lambda w: server_run(http, w, params))):
                            r = summarize(name, c, *await run(workload(c, args.prompt_len, args.seed)))
                            if name not in best or r["tokens_per_s"] > best[name]["tokens_per_s"]:
                                best[name] = r
                    results["throughput"] += [best["python"], best["server"]]
        results["bytes"] = response_bytes(srv.url, args.prompt_len, params, args.seed)
    finally:
        srv.stop()

    print(f"\nprompt {args.prompt_len} tokens, {args.max_new_tokens} new tokens, greedy, routing int32 on, "
          f"streaming {args.stream_interval} token(s) per chunk; model {os.path.basename(args.model_path)}; "
          f"client {args.client}\n")
    print(f"{'api':<8}{'clients':>8}{'tokens':>8}{'tok/s':>10}{'TPOT p50 ms':>13}{'TPOT p99 ms':>13}")
    by = {(r["api"], r["concurrency"]): r for r in results["throughput"]}
    for c in args.concurrency:
        for api in ("python", "server"):
            r = by[(api, c)]
            print(f"{api:<8}{c:>8}{r['requests_tokens']:>8}{r['tokens_per_s']:>10.0f}{r['tpot_p50_ms']:>13.2f}"
                  f"{r['tpot_p99_ms']:>13.2f}")
        s, p = by[("server", c)], by[("python", c)]
        print(f"{'':<8}{'':>8}{'':>8}{'server/python tok/s: ' + format(s['tokens_per_s'] / p['tokens_per_s'], '.2f'):>36}")
    print(f"\n{'routing':<10}{'stream':>8}{'bytes/token':>14}{'bytes/request':>15}   (logprobs on)")
    for r in results["bytes"]:
        print(f"{r['routing']:<10}{str(r['stream']):>8}{r['bytes_per_output_token']:>14.1f}"
              f"{r['bytes_per_request']:>15.0f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
