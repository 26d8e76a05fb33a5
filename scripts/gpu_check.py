"""The GPU check, one prepared run for one H200 (scripts/gpu_check.sh OUT_DIR runs its steps).

Steps (`--step`), each its own process under scripts/gpu_check.sh with its own budget, each section
guarded (a failure becomes an "error" row and the others still run), each row written to
OUT_DIR/gpu_check.{md,json} as soon as it exists (a later step appends):
  header: python, the carried wheels, the modules the device image lacks; nothing of the project
     is imported, so the header exists whatever fails after it.
  pytest: `pytest -m gpu` on the test files holding GPU tests (collection errors tolerated): CUDA
     graphs vs the same buckets without graphs (bitwise tokens, logprobs, routing), every Triton
     kernel compiled against its torch reference, a kernel replayed in a graph, capture under graphs.
  bench: a Qwen3-30B-A3B-shaped model with random bf16 weights made on the device: output tok/s of
     an RL batch against transformers' generate on the same weights; decode step time at batch 1,
     64 and 256 against the HBM limit; routed-expert capture on/off (alternating, as many runs of
     each); weight sync; FlashInfer rows only where flashinfer imports.
  total: the wall seconds.
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


STEPS = ("header", "pytest", "bench", "killed", "total")
# NOTE: modules the project needs at run time that the device image lacks (carried as wheels)
CARRIED_MODULES = ("msgspec", "zmq", "fastapi", "starlette", "pydantic", "uvicorn", "orjson", "re2")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory for gpu_check.md / gpu_check.json")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shape, Triton interpreter")
    p.add_argument("--step", choices=STEPS, default=None,
                   help="one step (scripts/gpu_check.sh runs each in its own process); default: all in this one")
    p.add_argument("--budget-s", type=float, default=None, help="this step's wall-clock budget")
    p.add_argument("--wheels", default="", help="header: what the carried wheels' install did")
    p.add_argument("--killed", default="", help="killed: the step that ran past its budget")
    p.add_argument("--wall-s", type=float, default=None, help="total: the whole check's wall seconds")
    p.add_argument("--skip-pytest", action="store_true")
    return p.parse_args()


ARGS = parse_args()
if ARGS.smoke:
    os.environ.setdefault("TRITON_INTERPRET", "1")   # NOTE: before anything imports triton
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import torch  # noqa: E402  (the device image's own; nothing of the project is imported here)


class Report:
    def __init__(self, out_dir: str, meta: dict, resume: bool = False):
        self.out_dir = out_dir
        self.meta = meta
        self.rows: list[dict] = []
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, "gpu_check.json")
        if resume and os.path.exists(path):      # a later step of scripts/gpu_check.sh: keep the rows so far
            with open(path) as f:
                self.rows = json.load(f)["rows"]

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


def gpu_test_files() -> list[str]:
    """The test files holding GPU tests: collected by file, so that a module that cannot import on
    the device image (a package it lacks) costs its own tests only."""
    tests = os.path.join(ROOT, "tests")
    return sorted(os.path.join(tests, f) for f in os.listdir(tests)
                  if f.startswith("test_") and f.endswith(".py")
                  and "pytest.mark.gpu" in open(os.path.join(tests, f), encoding="utf-8").read())


def section_pytest(report: Report, budget: float) -> None:
    xml = os.path.join(report.out_dir, "pytest_gpu.xml")
    if os.path.exists(xml):
        os.remove(xml)
    files = gpu_test_files()
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "--continue-on-collection-errors",
           f"--junitxml={xml}", *files]
    limit = max(20.0, budget - 10)
    report.add("pytest -m gpu", "budget seconds", round(limit), status="", files=len(files))
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit)
        tail = (proc.stdout + proc.stderr)[-6000:]
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        tail = f"timed out after {limit:.0f} s\n" + out[-4000:]
        report.add("pytest -m gpu", "run", f"timed out after {limit:.0f} s", status="error")
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


def section_header(report: Report) -> None:
    """What the run stands on, before anything of the project is imported."""
    report.add("setup", "python", f"{platform.python_version()} ({sys.executable})")
    if ARGS.wheels:
        report.add("setup", "carried wheels", ARGS.wheels, status="error" if "FAILED" in ARGS.wheels else "")
    missing = [m for m in CARRIED_MODULES if importlib.util.find_spec(m) is None]
    report.add("setup", "modules the device image lacks", "all importable" if not missing else
               "missing: " + ", ".join(missing), "all importable", "ok" if not missing else "error")
    if not ARGS.smoke and not torch.cuda.is_available():
        report.add("setup", "cuda", "no CUDA device visible", status="error")


def section_bench(report: Report, budget: float) -> None:
    device = "cpu" if ARGS.smoke else "cuda"
    report.add("benchmark", "budget seconds", round(budget))
    from gpu_check_bench import run_benchmark  # noqa: PLC0415  (imports the project)

    with tempfile.TemporaryDirectory() as workdir:
        guarded(report, "benchmark", run_benchmark, report, ARGS.smoke, device, time.time() + budget, workdir)
    gc.collect()


def main() -> int:
    smoke = ARGS.smoke
    meta = dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), mode="smoke (CPU)" if smoke else "gpu",
                device=torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor() or "cpu",
                torch=torch.__version__, triton=version("triton"), transformers=version("transformers"),
                flashinfer=version("flashinfer") if importlib.util.find_spec("flashinfer") else "absent",
                command=" ".join(sys.argv))
    steps = [ARGS.step] if ARGS.step else ["header", "pytest", "bench", "total"]
    report = Report(ARGS.out, meta, resume=steps[0] != "header")
    t0 = time.time()
    budgets = {"pytest": 180.0, "bench": 300.0} if not smoke else {"pytest": 300.0, "bench": 600.0}
    for step in steps:
        budget = ARGS.budget_s if ARGS.step else budgets.get(step, 0.0)
        if step == "header":
            guarded(report, "setup", section_header, report)
        elif step == "pytest" and not ARGS.skip_pytest:
            guarded(report, "pytest -m gpu", section_pytest, report, budget)
        elif step == "bench":
            if not smoke and not torch.cuda.is_available():
                report.add("benchmark", "run", "skipped: no CUDA device", status="error")
            else:
                guarded(report, "benchmark", section_bench, report, budget)
        elif step == "killed":
            report.add(ARGS.killed, "run", f"killed at its budget of {budget:.0f} s", status="error")
        elif step == "total":
            wall = ARGS.wall_s if ARGS.wall_s is not None else time.time() - t0
            report.add("total", "wall seconds", round(wall, 1), f"< {budget or sum(budgets.values()) + 60:.0f}")
    failed = [r for r in report.rows if r["status"] in ("error", "FAIL")]
    return 0 if not failed or steps == ["killed"] else 1


if __name__ == "__main__":
    sys.exit(main())
