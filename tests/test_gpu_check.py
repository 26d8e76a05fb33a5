"""scripts/gpu_check.sh on a stand-in for the GPU machine's device image: a fresh venv holding only
the image's packages (scripts/device_like_venv.py, CPU builds linked from this environment) plus
the wheels scripts/gpu_check_prepare.sh carries (for this Python). The --smoke run must write every
row with no error; without the wheels the header must still be written."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from gpu_check_bench import capture_order, weight_sync_paths  # noqa: E402

CARRIED = ("msgspec", "zmq", "fastapi", "pydantic")


def test_capture_runs_alternate_as_many_of_each():
    for pairs in (1, 2, 3, 4):
        order = capture_order(pairs)
        on = [i for i, c in enumerate(order) if c]
        off = [i for i, c in enumerate(order) if not c]
        assert len(on) == len(off) == pairs
        if pairs % 2 == 0:          # ABBA: a linear drift of the machine adds as much to each
            assert sum(on) == sum(off)


def test_nccl_weight_sync_only_with_a_gpu_per_rank():
    assert weight_sync_paths(0) == weight_sync_paths(1) == ("tensor",)
    assert "nccl" in weight_sync_paths(2)


@pytest.fixture(scope="module")
def device_venv(tmp_path_factory):
    base = tmp_path_factory.mktemp("device")
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "device_like_venv.py"), str(base / "venv")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    py = out.stdout.strip().splitlines()[-1]
    missing = subprocess.run([py, "-c", "import importlib.util as u; print([m for m in %r if u.find_spec(m)])"
                              % (CARRIED,)], capture_output=True, text=True, timeout=120)
    assert missing.stdout.strip() == "[]", missing.stdout + missing.stderr   # the image lacks them, so does this
    wheels = base / "wheels"
    ver = f"{sys.version_info.major}.{sys.version_info.minor}"
    got = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check_prepare.sh"), "--python-version", ver,
                          "--dest", str(wheels)], env=dict(os.environ, PYTHON=sys.executable),
                         capture_output=True, text=True, timeout=600)
    assert got.returncode == 0, got.stderr[-3000:]
    return py, str(wheels)


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", **extra)
    return env


def _rows(out_dir):
    with open(os.path.join(out_dir, "gpu_check.json")) as f:
        return json.load(f)["rows"]


@pytest.mark.slow
def test_header_is_written_before_anything_of_the_project_imports(device_venv, tmp_path):
    py, _ = device_venv
    script = os.path.join(ROOT, "scripts", "gpu_check.py")
    for step in ("header", "bench"):   # no wheels carried: the project cannot import
        subprocess.run([py, script, "--out", str(tmp_path), "--smoke", "--step", step, "--budget-s", "60"],
                       cwd=ROOT, env=_env(PYTHONPATH=ROOT), capture_output=True, text=True, timeout=300)
    rows = {(r["section"], r["metric"]): r for r in _rows(tmp_path)}
    lacks = rows[("setup", "modules the device image lacks")]
    assert lacks["status"] == "error" and "msgspec" in lacks["value"] and "zmq" in lacks["value"], lacks
    assert rows[("benchmark", "error")]["status"] == "error"          # a row, not a lost report
    with open(tmp_path / "gpu_check.md") as f:
        assert "| setup | python |" in f.read()


@pytest.mark.slow
def test_gpu_test_modules_collect_on_the_device_image(device_venv, tmp_path):
    py, wheels = device_venv
    site = tmp_path / "site"
    subprocess.run([py, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(site),
                    *[os.path.join(wheels, w) for w in os.listdir(wheels)]], check=True, timeout=300)
    # schemathesis (a dev extra) is absent there: its module skips instead of stopping the collection
    r = subprocess.run([py, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", "gpu",
                        "tests/test_openapi_fuzz.py", "tests/test_sglang_conformance.py"], cwd=ROOT,
                       env=_env(PYTHONPATH=f"{ROOT}:{site}"), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "error" not in r.stdout.lower(), r.stdout[-3000:] + r.stderr[-2000:]
    assert "test_release_memory_frees_gpu_memory" in r.stdout


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_smoke_run_on_the_device_image_writes_every_row(device_venv, tmp_path):
    py, wheels = device_venv
    r = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check.sh"), str(tmp_path / "out"), "--smoke"],
                       env=_env(PYTHON=py, GPU_CHECK_WHEELS=wheels, GPU_CHECK_SITE=str(tmp_path / "site")),
                       capture_output=True, text=True, timeout=1400)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    rows = _rows(tmp_path / "out")
    bad = [r for r in rows if r["status"] in ("error", "FAIL")]
    assert not bad, bad
    metrics = [f"{r['section']}: {r['metric']}" for r in rows]
    wanted = ["setup: python", "setup: carried wheels", "setup: modules the device image lacks",
              "pytest -m gpu: passed / failed / skipped", "benchmark: model",
              "output tok/s (triton, capture on)", "output tok/s (triton, capture off)",
              "output tok/s (transformers generate)", "decode step B=4", "weight sync (tensor path",
              "engine (triton) / transformers", "fused MoE experts T=16 (float32): batch-invariant / default",
              "batch-invariant row 0 == row 0 alone", "decode attention B=4, context 64 (float32): batch-invariant",
              "batch-invariant request 0 == alone", "capture on / off (triton; 2 runs each, alternating)",
              "overlap schedule on / off (triton, capture on; one run each)",
              "total: wall seconds"]
    for want in wanted:
        assert any(want in m for m in metrics), (want, metrics)
    assert not any("skipped: time budget" in str(r["value"]) for r in rows), rows
    lacks = next(r for r in rows if r["metric"] == "modules the device image lacks")
    assert lacks["value"] == "all importable"
