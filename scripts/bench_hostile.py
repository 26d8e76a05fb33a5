"""The event loop's worst stall and the server's memory under hostile requests: one rollout-serve (the
embedded tiny model) on loopback, a /health prober polling it on its own connection through each case;
prints a table (worst /health answer time, RSS before and after) and can write JSON.

    python scripts/bench_hostile.py [--json out.json]
"""
from __future__ import annotations

import argparse
import json
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


def cases(url: str):
    huge8 = "the quick brown fox " * 400_000
    huge30 = "the quick brown fox " * 1_500_000
    regex = {"text": "hello there", "sampling_params": {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True,
                                                       "stop_regex": "([\\s\\S]+)+\u0000"}}
    big = {"input_ids": [5, 6, 7], "return_logprob": True, "top_logprobs_num": 20, "return_routed_experts": True,
           "sampling_params": {"max_new_tokens": 64, "n": 128, "temperature": 1.0, "ignore_eos": True}}

    def post(path, body):
        def run(c):
            return c.post(path, json=body).status_code
        return run

    def slowloris(c):
        socks = []
        for _ in range(200):
            s = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])))
            s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{")
            socks.append(s)
        time.sleep(2.0)
        for s in socks:
            s.close()
        return 200

    return [("idle (reference)", lambda c: time.sleep(2.0) or 200),
            ("stop_regex ([\\s\\S]+)+\\0, 48 tokens", post("/generate", regex)),
            ("8 MB text (400)", post("/generate", {"text": huge8})),
            ("30 MB text (400)", post("/generate", {"text": huge30})),
            ("30 MB chat (400)", post("/v1/chat/completions",
                                      {"model": "m", "messages": [{"role": "user", "content": huge30}]})),
            ("n=128 top-20 routing answer", post("/generate", big)),
            ("200 partial-body connections", slowloris)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    with ServerProcess(["--enable-return-routed-experts", "--admin-api-key", ADMIN]) as srv, \
            httpx.Client(base_url=srv.url, timeout=600, headers={"Authorization": f"Bearer {ADMIN}"}) as c:
        proc = psutil.Process(srv._server.proc.pid)
        c.post("/generate", json={"text": "warm up", "sampling_params": {"max_new_tokens": 8}})
        c.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                             "max_tokens": 2})
        for name, run in cases(srv.url):
            before = proc.memory_info().rss
            with HealthProber(srv.url, period_s=0.005) as prober:
                time.sleep(0.3)                   # NOTE: the prober's connection is up before the case starts
                t0 = time.perf_counter()
                status = run(c)
                took = time.perf_counter() - t0
                time.sleep(0.3)
            time.sleep(0.5)
            rows.append({"case": name, "status": status, "seconds": round(took, 2),
                         "worst_health_ms": round(prober.worst_s * 1000, 1), "probes": prober.probes,
                         "health_failures": len(prober.failures), "rss_before_mb": before // 2**20,
                         "rss_after_mb": proc.memory_info().rss // 2**20})
    print(f"{'case':<36} {'status':>6} {'s':>6} {'worst /health ms':>17} {'probes':>7} {'RSS MB before':>14} "
          f"{'after':>6}")
    for r in rows:
        print(f"{r['case']:<36} {r['status']:>6} {r['seconds']:>6} {r['worst_health_ms']:>17} {r['probes']:>7} "
              f"{r['rss_before_mb']:>14} {r['rss_after_mb']:>6}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
