"""The event loop's worst stall and the server's memory under hostile requests: one rollout-serve (the
embedded tiny model) on loopback, a /health prober polling it on its own connection through each case,
and through an idle window of the same length right after it (the host's own jitter: on a shared
host the case's excess over its idle reference is what counts); prints a table (worst /health
answer time, case and idle, RSS before and after) and can write JSON. The prober runs in a process
of its own, so the client's work (encoding 30 MB, reading a 57 MB answer) is not counted.

    python scripts/bench_hostile.py [--json out.json] [--only SUBSTRING ...]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import sys
import time

import httpx
import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, ROOT)

from health_prober import HealthProber  # noqa: E402
from server_proc import ServerProcess  # noqa: E402

ADMIN = "bench-admin"


def _probe_main(url: str, period_s: float, stop, out) -> None:
    with HealthProber(url, period_s=period_s) as prober:
        out.put("up")
        stop.wait()
    out.put((prober.worst_s, prober.probes, prober.failures))


class ProbeProcess:
    """HealthProber in a spawned process: `with ProbeProcess(url) as p: ...` then p.worst_s, p.probes."""

    def __init__(self, url: str, period_s: float):
        ctx = mp.get_context("spawn")
        self._stop, self._out = ctx.Event(), ctx.Queue()
        self._proc = ctx.Process(target=_probe_main, args=(url, period_s, self._stop, self._out), daemon=True)

    def __enter__(self) -> "ProbeProcess":
        self._proc.start()
        assert self._out.get(timeout=120) == "up"
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self.worst_s, self.probes, self.failures = self._out.get(timeout=120)
        self._proc.join(30)


def cases(url: str):
    huge8 = "the quick brown fox " * 400_000
    huge30 = "the quick brown fox " * 1_500_000
    regex = {"text": "hello there", "sampling_params": {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True,
                                                       "stop_regex": "([\\s\\S]+)+\u0000"}}
    big = {"input_ids": [5, 6, 7], "return_logprob": True, "top_logprobs_num": 20, "return_routed_experts": True,
           "sampling_params": {"max_new_tokens": 64, "n": 128, "temperature": 1.0, "ignore_eos": True}}
    streamed = {"input_ids": [5, 6, 7], "stream": True, "return_logprob": True, "top_logprobs_num": 20,
                "return_routed_experts": True,
                "sampling_params": {"max_new_tokens": 800, "n": 8, "temperature": 1.0, "ignore_eos": True}}

    def post(path, body):
        data = json.dumps(body).encode()

        def run(c):
            return c.post(path, content=data, headers={"content-type": "application/json"}).status_code
        return run

    def stream(body):
        data = json.dumps(body).encode()

        def run(c):
            sent = 0
            with c.stream("POST", "/generate", content=data, headers={"content-type": "application/json"}) as r:
                for piece in r.iter_raw(1 << 20):
                    sent += len(piece)
            print(f"  streamed {sent / 1e6:.0f} MB", flush=True)
            return r.status_code
        return run

    def connections(first_bytes: bytes):
        def run(c):
            socks = []
            for _ in range(200):
                s = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])))
                if first_bytes:
                    s.sendall(first_bytes)
                socks.append(s)
            time.sleep(2.0)
            for s in socks:
                s.close()
            return 200
        return run

    return [("stop_regex ([\\s\\S]+)+\\0, 48 tokens", post("/generate", regex)),
            ("8 MB text (400)", post("/generate", {"text": huge8})),
            ("30 MB text (400)", post("/generate", {"text": huge30})),
            ("30 MB chat (400)", post("/v1/chat/completions",
                                      {"model": "m", "messages": [{"role": "user", "content": huge30}]})),
            ("n=128 top-20 routing answer", post("/generate", big)),
            ("cumulative stream n=8 800 tok top-20 routing", stream(streamed)),
            ("incremental stream n=8 800 tok top-20 routing", stream({**streamed, "incremental_streaming_output": True})),
            ("200 partial-body connections",
             connections(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{")),
            ("200 partial-header connections", connections(b"POST /generate HTTP/1.1\r\nHost: x\r\n")),
            ("200 silent connections", connections(b""))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--only", nargs="*", default=[], help="run only the cases whose name holds one of these")
    args = ap.parse_args()
    rows = []
    with ServerProcess(["--enable-return-routed-experts", "--admin-api-key", ADMIN]) as srv, \
            httpx.Client(base_url=srv.url, timeout=600, headers={"Authorization": f"Bearer {ADMIN}"}) as c:
        proc = psutil.Process(srv._server.proc.pid)
        c.post("/generate", json={"text": "warm up", "sampling_params": {"max_new_tokens": 8}})
        c.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                             "max_tokens": 2})
        def probe(run):
            before = proc.memory_info().rss
            with ProbeProcess(srv.url, period_s=0.005) as prober:
                time.sleep(0.3)                   # NOTE: the prober's connection is up before the case starts
                t0 = time.perf_counter()
                status = run(c)
                took = time.perf_counter() - t0
                time.sleep(0.3)
            time.sleep(0.5)
            return status, took, prober, before, proc.memory_info().rss

        for name, run in cases(srv.url):
            if args.only and not any(o in name for o in args.only):
                continue
            status, took, prober, before, after = probe(run)
            # NOTE: the idle reference as long as the case
            idle = probe(lambda c, s=took: time.sleep(max(1.0, min(s, 120.0))) or 200)[2]
            rows.append({"case": name, "status": status, "seconds": round(took, 2),
                         "worst_health_ms": round(prober.worst_s * 1000, 1),
                         "idle_worst_health_ms": round(idle.worst_s * 1000, 1), "probes": prober.probes,
                         "health_failures": len(prober.failures), "rss_before_mb": before // 2**20,
                         "rss_after_mb": after // 2**20})
    print(f"{'case':<36} {'status':>6} {'s':>6} {'worst /health ms':>17} {'idle ms':>8} {'probes':>7} "
          f"{'RSS MB before':>14} {'after':>6}")
    for r in rows:
        print(f"{r['case']:<36} {r['status']:>6} {r['seconds']:>6} {r['worst_health_ms']:>17} "
              f"{r['idle_worst_health_ms']:>8} {r['probes']:>7} {r['rss_before_mb']:>14} {r['rss_after_mb']:>6}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
