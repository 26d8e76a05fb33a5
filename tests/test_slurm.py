"""The SLURM batch scripts, submitted for real to a SLURM cluster started on this machine.

Installs Debian's slurm-wlm + munge when missing (skips, saying why, only without apt-get/root),
starts munged, slurmctld and two slurmd daemons (nodes node1 and node2 on 127.0.0.1) with a
generated slurm.conf under a temporary directory, submits scripts/slurm/*.sbatch on the embedded
model with sbatch, waits (bounded) and checks the job outputs and that no process of the job is
left. The daemons are stopped afterwards.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from slurm_cluster import LocalSlurm, SlurmUnavailable, ensure_slurm_installed, job_processes

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts" / "slurm"
VENV_BIN = Path(sys.executable).parent
JOB_TIMEOUT = 240


def _serve_cmd() -> str:
    exe = VENV_BIN / "rollout-serve"
    return str(exe) if exe.exists() else f"{sys.executable} -m rollout.server"   # ROLLOUT_SERVE is split on spaces


# ---- without a cluster (default suite) -------------------------------------------------------------
@pytest.mark.parametrize("script", ["rollout.sbatch", "train.sbatch", "lib.sh"])
def test_scripts_parse_and_document_every_knob(script):
    path = SCRIPTS / script
    r = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    text = path.read_text()
    knobs = set(re.findall(r'^: "\$\{([A-Z_]+):?=', text, re.M))
    if script == "lib.sh":
        header = (SCRIPTS / "rollout.sbatch").read_text().split("\n#SBATCH --", 1)[0]
    else:
        header = text.split("\n#SBATCH --", 1)[0]
        assert header.startswith("#!/bin/bash\n#") and "Usage" in header
        assert os.access(path, os.X_OK)
    missing = sorted(k for k in knobs if k not in header)
    assert not missing, f"{script}: knobs not documented in the usage header: {missing}"
    if script == "train.sbatch":
        for var in ("NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", "NCCL_DEBUG", "MASTER_ADDR", "MASTER_PORT"):
            assert var in header


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_scripts_pass_shellcheck():
    r = subprocess.run(["shellcheck", "-x", "-S", "warning", *(str(SCRIPTS / s) for s in
                        ("rollout.sbatch", "train.sbatch", "lib.sh"))], capture_output=True, text=True, cwd=SCRIPTS)
    assert r.returncode == 0, r.stdout + r.stderr


# ---- on a real (one-machine) SLURM cluster ------------------------------------------------------------
@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    try:
        ensure_slurm_installed()
    except SlurmUnavailable as exc:
        pytest.skip(str(exc))
    cluster = LocalSlurm(tmp_path_factory.mktemp("slurm"), cpus=2, nodes=2)
    try:
        cluster.start()
    except Exception:
        cluster.stop()
        raise
    yield cluster
    cluster.stop()
    assert all(p.poll() is not None for p in cluster.procs.values())


def _env(job_dir: Path, **extra: str) -> dict[str, str]:
    env = {"ROLLOUT_PYTHON": sys.executable, "ROLLOUT_SERVE": _serve_cmd(), "ROLLOUT_JOB_DIR": str(job_dir),
           "ROLLOUT_HEALTH_TIMEOUT": "120", "ROLLOUT_STOP_TIMEOUT": "15", "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.update(extra)
    return env


def _finish(slurm: LocalSlurm, job: int, out: Path) -> str:
    state, code = slurm.wait_job(job, JOB_TIMEOUT)
    text = out.read_text(errors="replace") if out.exists() else "<no output>"
    assert state == "COMPLETED" and code == "0:0", f"job {job}: {state} {code}\n{text}\n{slurm.logs()}"
    _assert_nothing_left(job)
    return text


def _serve_until_cancelled(slurm: LocalSlurm, job_dir: Path, out: Path) -> tuple[int, str]:
    """Submits rollout.sbatch without a client command (it serves until cancelled); (job, server URL)."""
    job = slurm.sbatch(str(ROOT / "scripts/slurm/rollout.sbatch"), "--nodes=1", f"--output={out}",
                       cwd=str(ROOT), env=_env(job_dir))
    servers_file = job_dir / "servers.txt"
    deadline = time.monotonic() + JOB_TIMEOUT
    while not servers_file.exists():
        assert time.monotonic() < deadline, out.read_text() if out.exists() else "no output"
        state, _ = slurm.job_state(job)
        assert state in ("PENDING", "RUNNING", "CONFIGURING"), f"{state}: {out.read_text()}"
        time.sleep(0.5)
    (url,) = servers_file.read_text().split()
    return job, url


def _assert_nothing_left(job: int) -> None:
    deadline = time.monotonic() + 30
    while (left := job_processes(job)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"processes of job {job} left behind: {left}"


@pytest.mark.slow
def test_rollout_sbatch_two_nodes_client_and_cleanup(slurm, tmp_path):
    """One server per node on both nodes, smoke test with routing, a client command, clean exit."""
    job_dir, out = tmp_path / "job", tmp_path / "rollout.out"
    client = (f"{sys.executable} -c \"import os, httpx; urls = open(os.environ['ROLLOUT_SERVERS_FILE']).read().split(); "
              "print('client-saw', len(urls), [httpx.get(u + '/health').status_code for u in urls])\"")
    job = slurm.sbatch(str(ROOT / "scripts/slurm/rollout.sbatch"), "--nodes=2", f"--output={out}",
                       cwd=str(ROOT), env=_env(job_dir, ROLLOUT_SMOKE_TEST="1", ROLLOUT_CLIENT_CMD=client,
                                              ROLLOUT_ENGINE_CONFIG="configs/engine/tiny-moe.yaml"))
    text = _finish(slurm, job, out)
    servers = (job_dir / "servers.txt").read_text().split()
    assert len(servers) == 2 and len(set(servers)) == 2, servers
    assert text.count("smoke-test http://") == 2, text
    assert "x 16 int32 ids" in text   # 4 layers x top-4 routing per row
    assert "client-saw 2 [200, 200]" in text, text
    assert "cleanup: done" in text


@pytest.mark.slow
def test_rollout_sbatch_two_servers_per_node_with_gpu_slices(slurm, tmp_path):
    job_dir, out = tmp_path / "job", tmp_path / "rollout.out"
    job = slurm.sbatch(str(SCRIPTS / "rollout.sbatch"), "--nodes=1", "--ntasks-per-node=2", f"--output={out}",
                       cwd=str(ROOT), env=_env(job_dir, ROLLOUT_SERVERS_PER_NODE="2", ROLLOUT_GPUS_PER_SERVER="2",
                                              ROLLOUT_SMOKE_TEST="1", ROLLOUT_CLIENT_CMD="true"))
    text = _finish(slurm, job, out)
    servers = (job_dir / "servers.txt").read_text().split()
    assert len(set(servers)) == 2 and text.count("smoke-test http://") == 2, text
    logs = sorted(p.read_text().splitlines()[0] for p in job_dir.glob("server-*.log"))
    assert [line.split()[-1] for line in logs] == ["gpus=0,1", "gpus=2,3"], logs


@pytest.mark.slow
def test_rollout_sbatch_one_server_spans_both_nodes(slurm, tmp_path):
    """ROLLOUT_NODES_PER_SERVER=2: one server, --nnodes 2 over node1 (HTTP, DP rank 0) and node2
    (DP rank 1), rendezvous at node1's address; both ranks answer with routing; clean exit."""
    job_dir, out = tmp_path / "job", tmp_path / "rollout.out"
    client = (f"{sys.executable} -c \"import os, httpx; (u,) = open(os.environ['ROLLOUT_SERVERS_FILE']).read().split(); "
              "i = httpx.get(u + '/server_info').json(); "
              "r = [httpx.post(u + '/generate', json={'input_ids': [5, 6, 7], 'routed_dp_rank': k, "
              "'return_routed_experts': True, 'sampling_params': {'max_new_tokens': 3}}).json() for k in (0, 1)]; "
              "print('client-saw', i['nnodes'], i['dp_size'], [x['meta_info']['completion_tokens'] for x in r], "
              "all(x['meta_info']['routed_experts'] for x in r))\"")
    job = slurm.sbatch(str(SCRIPTS / "rollout.sbatch"), "--nodes=2", f"--output={out}", cwd=str(ROOT),
                       env=_env(job_dir, ROLLOUT_NODES_PER_SERVER="2", ROLLOUT_SMOKE_TEST="1", ROLLOUT_CLIENT_CMD=client,
                                ROLLOUT_SERVE_ARGS="--enable-return-routed-experts --dp-size 2 --cpu-threads 1"))
    text = _finish(slurm, job, out)
    assert len((job_dir / "servers.txt").read_text().split()) == 1
    assert "client-saw 2 2 [3, 3] True" in text, text
    logs = {p.name: p.read_text() for p in job_dir.glob("server-*.log")}
    assert "node_rank=0" in logs["server-0.log"] and "rollout-serve listening on" in logs["server-0.log"]
    assert "node_rank=1" in logs["server-1.log"] and "node 1 (DP rank 1): the engines ended" in logs["server-1.log"]
    assert (job_dir / "dist-0.addr").read_text().startswith("127.0.0.1:")


@pytest.mark.slow
def test_rollout_sbatch_scancel_stops_everything(slurm, tmp_path):
    """No client command: the job serves until cancelled; scancel stops every process."""
    job_dir, out = tmp_path / "job", tmp_path / "rollout.out"
    job, url = _serve_until_cancelled(slurm, job_dir, out)
    r = httpx.post(url + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2},
                                            "return_routed_experts": True}, timeout=60)
    assert r.status_code == 200 and r.json()["meta_info"]["routed_experts"]
    subprocess.run(["scancel", str(job)], env=slurm.env, check=True)
    state, _ = slurm.wait_job(job, JOB_TIMEOUT)
    assert state == "CANCELLED", state
    _assert_nothing_left(job)
    text = out.read_text()
    assert "caught SIGTERM" in text and "cleanup: done" in text, text
    with pytest.raises(httpx.HTTPError):
        httpx.get(url + "/health", timeout=2)


@pytest.mark.slow
def test_train_sbatch_servers_and_trainer_on_different_nodes(slurm, tmp_path):
    """Servers on node1, trainer_bridge.train on node2 (RANK/MASTER_ADDR... from the allocation),
    connected through --set server_urls=[...]; the trainer runs its steps and syncs weights."""
    if not (ROOT / "trainer_bridge" / "train.py").exists():
        pytest.skip("trainer_bridge/train.py is not in this tree")
    job_dir, out, run_dir = tmp_path / "job", tmp_path / "train.out", tmp_path / "run"
    steps = 2
    extra = (f"--set steps={steps} --set prompts_per_step=4 --set samples_per_prompt=2 --set num_eval_prompts=4 "
             f"--set eval_every=0 --set compare_no_replay=false --set progress=false --set run_dir={run_dir}")
    job = slurm.sbatch(str(ROOT / "scripts/slurm/train.sbatch"), "--nodes=2", f"--output={out}", cwd=str(ROOT),
                       env=_env(job_dir, TRAIN_CONFIG="configs/train/tiny.yaml", TRAIN_EXTRA_ARGS=extra,
                                ROLLOUT_SERVE_ARGS="--enable-return-routed-experts --dtype bfloat16"))
    text = _finish(slurm, job, out)
    assert "servers on node1, trainer on node2" in text, text
    (url,) = (job_dir / "servers.txt").read_text().split()
    assert f'server_urls=["{url}"]' in text, text
    assert "trainer exited with 0" in text, text
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_steps = [r for r in records if "reward_mean" in r]
    assert len(train_steps) >= steps, records


@pytest.mark.slow
def test_train_sbatch_one_node_shares_it_and_sets_the_rendezvous_env(slurm, tmp_path):
    """No node left for the trainer: it runs on the server node (a warning); TRAIN_CMD replaced."""
    job_dir, out = tmp_path / "job", tmp_path / "train.out"
    probe = (f"{sys.executable} -c \"import os, sys, httpx; e = os.environ; url = sys.argv[-1].split('=', 1)[1]; "
             "url = url.strip('[]').strip('\\\"'); r = httpx.get(url + '/health'); "
             "print('probe', e['RANK'], e['WORLD_SIZE'], e['LOCAL_RANK'], e['MASTER_ADDR'], e['MASTER_PORT'], "
             "e['TRAIN_WEIGHT_SYNC_PORT'], r.status_code)\"")
    job = slurm.sbatch(str(SCRIPTS / "train.sbatch"), "--nodes=1", f"--output={out}", cwd=str(ROOT),
                       env=_env(job_dir, TRAIN_CMD=probe, MASTER_PORT="29555"))
    text = _finish(slurm, job, out)
    assert "no node left for the trainer" in text, text
    assert "probe 0 1 0 127.0.0.1 29555 29556 200" in text, text


@pytest.mark.slow
def test_rollout_sbatch_fails_fast_when_a_server_cannot_start(slurm, tmp_path):
    job_dir, out = tmp_path / "job", tmp_path / "rollout.out"
    job = slurm.sbatch(str(SCRIPTS / "rollout.sbatch"), "--nodes=2", f"--output={out}", cwd=str(ROOT),
                       env=_env(job_dir, ROLLOUT_SERVE_ARGS="--max-running-requests 0"))
    state, code = slurm.wait_job(job, JOB_TIMEOUT)
    text = out.read_text()
    assert state == "FAILED", f"{state} {code}\n{text}"
    assert "exited before all servers were healthy" in text and "max_running_requests" in text, text
    assert not (job_dir / "servers.txt").exists()
    _assert_nothing_left(job)


STUBBORN_SERVER = r'''
import http.server, signal, sys, threading
signal.signal(signal.SIGTERM, signal.SIG_IGN)          # a server that ignores SIGTERM
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header("content-type", "application/json"); self.end_headers()
        self.wfile.write(b'{"status": "ok"}')
    def log_message(self, *a):
        pass
srv = http.server.ThreadingHTTPServer(("0.0.0.0", 0), H)
print(f"rollout-serve listening on http://0.0.0.0:{srv.server_address[1]}", flush=True)
srv.serve_forever()
'''


@pytest.mark.slow
def test_rollout_sbatch_sigkills_what_ignores_sigterm(slurm, tmp_path):
    job_dir, out = tmp_path / "job", tmp_path / "rollout.out"
    stub = tmp_path / "stubborn_server.py"
    stub.write_text(STUBBORN_SERVER)
    job = slurm.sbatch(str(SCRIPTS / "rollout.sbatch"), "--nodes=1", f"--output={out}", cwd=str(ROOT),
                       env=_env(job_dir, ROLLOUT_SERVE=f"{sys.executable} {stub}", ROLLOUT_SERVE_ARGS="",
                                ROLLOUT_STOP_TIMEOUT="3", ROLLOUT_CLIENT_CMD="true"))
    text = _finish(slurm, job, out)
    assert "SIGKILL" in text and "cleanup: done" in text, text


@pytest.mark.slow
def test_rollout_sbatch_restarts_a_server_whose_engine_died(slurm, tmp_path):
    """kill -9 of a server's engine process: rollout-serve exits non-zero, its task starts it again
    on the same port, and the URL in the server list serves again; scancel still stops everything."""
    job_dir, out = tmp_path / "job", tmp_path / "rollout.out"
    job, url = _serve_until_cancelled(slurm, job_dir, out)
    engines = [int(p.split(":", 1)[0]) for p in job_processes(job) if "rollout.core.engine_proc" in p]
    assert len(engines) == 1, job_processes(job)
    os.kill(engines[0], 9)
    deadline = time.monotonic() + JOB_TIMEOUT
    while "restart 1 on port" not in (job_dir / "server-0.log").read_text():
        assert time.monotonic() < deadline, (job_dir / "server-0.log").read_text()
        time.sleep(0.5)
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, (job_dir / "server-0.log").read_text()
        time.sleep(0.5)
    r = httpx.post(url + "/generate", json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}},
                   timeout=60)
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 2
    subprocess.run(["scancel", str(job)], check=True, env=slurm.env)
    slurm.wait_job(job, JOB_TIMEOUT)
    _assert_nothing_left(job)
