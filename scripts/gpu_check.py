"""The GPU check of issue 13, one prepared run for one H200 (scripts/gpu_check.sh OUT_DIR).

Sections, each guarded (a failure becomes an "error" row and the others still run), each row
written to OUT_DIR/gpu_check.{md,json} as soon as it exists:
  1. `pytest -m gpu tests/`: CUDA graphs vs the same buckets without graphs (bitwise tokens,
     logprobs, routing) for decode and piecewise prefill buckets, every Triton kernel compiled
     against its torch reference, a kernel replayed in a graph, capture under graphs.
  2. Benchmark on a Qwen3-30B-A3B-shaped model with random bf16 weights made on the device:
     output tok/s of an RL batch (prompts x 8 samples, a few hundred prompt tokens, spread
     max_new_tokens) against transformers' generate on the same weights; decode step time at
     batch 1, 64 and 256 against the HBM limit; routed-expert capture on/off; FlashInfer rows
     only where flashinfer imports.
--smoke runs the same code on the CPU with a tiny shape and the Triton interpreter (checks the
script's logic; its numbers mean nothing).
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory for gpu_check.md / gpu_check.json")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shape, Triton interpreter")
    p.add_argument("--budget-s", type=float, default=None, help="wall-clock budget (default 440; smoke 900)")
    p.add_argument("--skip-pytest", action="store_true")
    return p.parse_args()


ARGS = parse_args()
if ARGS.smoke:
    os.environ.setdefault("TRITON_INTERPRET", "1")   # NOTE: before anything imports triton
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import torch  # noqa: E402

import gpu_bench_model as bench  # noqa: E402


class Report:
    def __init__(self, out_dir: str, meta: dict):
        self.out_dir = out_dir
        self.meta = meta
        self.rows: list[dict] = []
        os.makedirs(out_dir, exist_ok=True)

    def add(self, section: str, metric: str, value, target: str = "", status: str = "", **extra) -> None:
        self.rows.append(dict(section=section, metric=metric, value=value, target=target, status=status, **extra))
        print(f"[{section}] {metric}: {value} {target} {status}", flush=True)
        self.write()

    def write(self) -> None:
        with open(os.path.join(self.out_dir, "gpu_check.json"), "w") as f:
            json.dump({"meta": self.meta, "rows": self.rows}, f, indent=1, default=str)
        lines = [f"# GPU check ({self.meta['date']}, {self.meta['device']})", "",
                 f"torch {self.meta['torch']}, triton {self.meta['triton']}, transformers {self.meta['transformers']}, "
                 f"flashinfer {self.meta['flashinfer']}; mode: {self.meta['mode']}", "",
                 "| section | metric | value | target | status |", "|---|---|---|---|---|"]
        for r in self.rows:
            value = f"{r['value']:.4g}" if isinstance(r["value"], float) else r["value"]
            lines.append(f"| {r['section']} | {r['metric']} | {value} | {r['target']} | {r['status']} |")
        with open(os.path.join(self.out_dir, "gpu_check.md"), "w") as f:
            f.write("\n".join(lines) + "\n")


def version(name: str) -> str:
    try:
        return __import__(name).__version__
    except Exception:  # noqa: BLE001
        return "absent"


def guarded(report: Report, section: str, fn, *args) -> None:
    try:
        fn(*args)
    except Exception as exc:  # noqa: BLE001  (one failing section must not lose the others' rows)
        report.add(section, "error", f"{type(exc).__name__}: {str(exc)[:300]}", status="error",
                   traceback=traceback.format_exc()[-4000:])


def section_pytest(report: Report, deadline: float) -> None:
    xml = os.path.join(report.out_dir, "pytest_gpu.xml")
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}",
           os.path.join(ROOT, "tests")]
    limit = max(30.0, min(200.0, deadline - time.time() - 220))
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit)
        tail = (proc.stdout + proc.stderr)[-3000:]
    except subprocess.TimeoutExpired as exc:
        tail = f"timed out after {limit:.0f} s\n" + str(exc.stdout or "")[-2000:]
    with open(os.path.join(report.out_dir, "pytest_gpu.log"), "w") as f:
        f.write(tail)
    if not os.path.exists(xml):
        report.add("pytest -m gpu", "run", tail.strip().splitlines()[-1] if tail.strip() else "no output",
                   status="error")
        return
    suite = ET.parse(xml).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    total, failed = int(suite.get("tests", 0)), int(suite.get("failures", 0)) + int(suite.get("errors", 0))
    skipped = int(suite.get("skipped", 0))
    report.add("pytest -m gpu", "passed / failed / skipped", f"{total - failed - skipped} / {failed} / {skipped}",
               "0 failed", "ok" if failed == 0 and total > skipped else ("skipped" if failed == 0 else "FAIL"),
               seconds=round(time.time() - t0, 1))
    for case in suite.iter("testcase"):
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None:
            report.add("pytest -m gpu", f"{case.get('classname')}::{case.get('name')}",
                       (bad.get("message") or "")[:200], status="FAIL")


def main() -> int:
    smoke = ARGS.smoke
    device = "cpu" if smoke else "cuda"
    budget = ARGS.budget_s or (900.0 if smoke else 440.0)
    deadline = time.time() + budget
    meta = dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), mode="smoke (CPU)" if smoke else "gpu",
                device=torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor() or "cpu",
                torch=torch.__version__, triton=version("triton"), transformers=version("transformers"),
                flashinfer=version("flashinfer") if importlib.util.find_spec("flashinfer") else "absent",
                command=" ".join(sys.argv))
    report = Report(ARGS.out, meta)
    if not smoke and not torch.cuda.is_available():
        report.add("setup", "cuda", "no CUDA device visible", status="error")
        return 1
    if not ARGS.skip_pytest:
        guarded(report, "pytest -m gpu", section_pytest, report, deadline)
    from gpu_check_bench import run_benchmark  # noqa: PLC0415

    with tempfile.TemporaryDirectory() as workdir:
        guarded(report, "benchmark", run_benchmark, report, smoke, device, deadline, workdir)
    gc.collect()
    report.add("total", "wall seconds", round(budget - (deadline - time.time()), 1), f"< {budget:.0f}")
    return 0 if all(r["status"] not in ("error", "FAIL") for r in report.rows) else 1


if __name__ == "__main__":
    sys.exit(main())
