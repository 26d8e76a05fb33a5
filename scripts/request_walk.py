"""The project's files one request runs through, measured: which modules of rollout/ and capture/
execute Python code while one request is served, in the order first entered, per process.

Starts a real `rollout-serve` (the embedded default model, routing capture on) whose processes
(the front end and each engine process) load a small `sitecustomize` that records the file of
every Python call while recording is on. After warm-up requests, recording is switched on in
every process (SIGUSR1), one request is sent, and switched off (SIGUSR2): each process then
writes the files it entered, first call first. This is the count docs/architecture.md's request
walk gives; run it after a change to the request path:

  .venv/bin/python scripts/request_walk.py                   # one non-streaming /generate
  .venv/bin/python scripts/request_walk.py --stream --json walk.json
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from trainer_bridge.launch import LocalServers  # noqa: E402

SITECUSTOMIZE = '''
import json, os, signal, sys, threading
_out = os.environ.get("REQUEST_WALK_DIR")
if _out:
    _seen = {}
    _on = [False]

    def _profile(frame, event, arg):
        if _on[0] and event == "call":
            name = frame.f_code.co_filename
            if name not in _seen:
                _seen[name] = len(_seen)

    def _start(signum, frame):
        _seen.clear()
        _on[0] = True

    def _stop(signum, frame):
        _on[0] = False
        with open(os.path.join(_out, f"{os.getpid()}.json"), "w") as f:
            json.dump({"argv": sys.argv, "files": list(_seen)}, f)

    signal.signal(signal.SIGUSR1, _start)
    signal.signal(signal.SIGUSR2, _stop)
    sys.setprofile(_profile)
    threading.setprofile(_profile)
'''


def project_files(files: list[str]) -> list[str]:
    out = []
    for f in files:
        try:
            rel = Path(f).resolve().relative_to(ROOT)
        except ValueError:
            continue
        if rel.parts[0] in ("rollout", "capture") and rel.suffix == ".py":
            out.append(str(rel))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stream", action="store_true", help="a streamed /generate instead")
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--json", help="write the files per process here")
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="request-walk-") as tmp:
        site = Path(tmp) / "site"
        site.mkdir()
        (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
        dumps = Path(tmp) / "dumps"
        dumps.mkdir()
        env = {"REQUEST_WALK_DIR": str(dumps), "OMP_NUM_THREADS": "2",
               "PYTHONPATH": os.pathsep.join([str(site), str(ROOT), os.environ.get("PYTHONPATH", "")])}
        with LocalServers(1, ["--log-level", "warning", "--enable-return-routed-experts"], log_dir=tmp, env=env,
                          supervise=False) as servers:
            server = servers.servers[0]
            body = {"input_ids": [5, 6, 7, 8, 9, 10], "return_logprob": True, "return_routed_experts": True,
                    "stream": args.stream,
                    "sampling_params": {"temperature": 0.0, "max_new_tokens": args.max_new_tokens, "ignore_eos": True}}
            with httpx.Client(base_url=server.url, timeout=300) as c:
                for i in range(3):   # warm-up: first-call paths (lazy imports, graph/plan caches) stay out
                    c.post("/generate", json={**body, "input_ids": [11 + i, 12, 13, 14]}).raise_for_status()
                procs = [psutil.Process(server.proc.pid)]
                procs += [p for p in procs[0].children(recursive=True) if "python" in p.name().lower()]
                for p in procs:
                    p.send_signal(signal.SIGUSR1)
                time.sleep(0.5)
                r = c.post("/generate", json=body)
                r.raise_for_status()
                time.sleep(0.5)
                for p in procs:
                    p.send_signal(signal.SIGUSR2)
            deadline = time.monotonic() + 30
            while len(list(dumps.iterdir())) < len(procs) and time.monotonic() < deadline:
                time.sleep(0.1)
            walks = {}
            for f in sorted(dumps.iterdir()):
                d = json.loads(f.read_text())
                role = "engine" if any("engine_proc" in a for a in d["argv"]) else "front end"
                walks[f"{role} (pid {f.stem})"] = project_files(d["files"])

    total = []
    for name, files in walks.items():
        print(f"## {name}: {len(files)} files")
        for f in files:
            print(f"  {f}")
        total += [f for f in files if f not in total]
    print(f"\ndistinct files over all processes: {len(total)}")
    if args.json:
        Path(args.json).write_text(json.dumps({"processes": walks, "distinct": total}, indent=1))


if __name__ == "__main__":
    main()
