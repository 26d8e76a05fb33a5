"""A one-machine SLURM cluster for tests: munged + slurmctld + slurmd under a temporary directory.

Installs Debian's slurm-wlm and munge with apt-get when they are missing. Everything (config, state,
spool, logs, munge socket and key) lives under `root`; the daemons are started in the foreground as
child processes and stopped (by their own pids) in `stop()`.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Optional

SLURM_BINARIES = ("slurmctld", "slurmd", "sbatch", "squeue", "sacct", "scontrol", "srun", "munged")
_RENDEZVOUS_VARS = frozenset({"MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"})


class SlurmUnavailable(RuntimeError):
    """SLURM is missing and cannot be installed here (no apt-get / not root)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_slurm_installed(timeout: float = 600) -> None:
    if all(shutil.which(b) or os.path.exists(f"/usr/sbin/{b}") for b in SLURM_BINARIES):
        return
    if shutil.which("apt-get") is None:
        raise SlurmUnavailable("slurm-wlm is not installed and apt-get is not available")
    if os.geteuid() != 0:
        raise SlurmUnavailable("slurm-wlm is not installed and installing it needs root (apt-get)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "slurm-wlm", "munge"]):
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        if r.returncode != 0:
            raise SlurmUnavailable(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout[-2000:]}{r.stderr[-2000:]}")


class LocalSlurm:
    def __init__(self, root: Path, *, cpus: Optional[int] = None, partition: str = "debug", nodes: int = 1):
        """nodes > 1: that many slurmd daemons (`slurmd -N nodeK`) on this machine, each a SLURM node
        named nodeK with NodeAddr=127.0.0.1, so multi-node scripts run for real on one host."""
        self.root = Path(root)
        self.cpus = cpus or os.cpu_count() or 1
        self.partition = partition
        self.host = socket.gethostname()
        self.nodes = [self.host] if nodes == 1 else [f"node{i + 1}" for i in range(nodes)]
        self.procs: dict[str, subprocess.Popen] = {}
        self.conf = self.root / "slurm.conf"
        self.munge_socket = self.root / "munge" / "munge.socket"

    # ---- environment for clients (sbatch, squeue, srun inside jobs) -----------------------------
    @property
    def env(self) -> dict[str, str]:
        """The test runner's environment, less the torch.distributed rendezvous variables an in-process
        trainer test may have set (sbatch exports the submitter's environment into the job, and a
        leftover MASTER_PORT would name a port this very process still listens on)."""
        env = {k: v for k, v in os.environ.items() if k not in _RENDEZVOUS_VARS}
        return dict(env, SLURM_CONF=str(self.conf))

    def _sbin(self, name: str) -> str:
        return shutil.which(name) or f"/usr/sbin/{name}"

    def _spawn(self, name: str, cmd: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.out", "w")
        self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                            start_new_session=True)

    def start(self, timeout: float = 60) -> "LocalSlurm":
        for d in ("munge", "state", "spool", "log", "run"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        os.chmod(self.root / "munge", 0o755)   # munged wants the socket dir searchable
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        self._spawn("munged", [self._sbin("munged"), "--foreground", "--force", f"--key-file={key}",
                               f"--socket={self.munge_socket}", f"--pid-file={self.root}/munge/munged.pid",
                               f"--seed-file={self.root}/munge/munged.seed", f"--log-file={self.root}/log/munged.log"])
        self._wait(lambda: self.munge_socket.exists(), timeout, "munged socket")
        ctld_port = _free_port()
        if len(self.nodes) == 1:
            node_lines = f"NodeName={self.host} CPUs={self.cpus} RealMemory={{mem}} State=UNKNOWN\n"
        else:
            node_lines = "".join(f"NodeName={n} NodeAddr=127.0.0.1 NodeHostname={self.host} Port={_free_port()} "
                                 f"CPUs={self.cpus} RealMemory={{mem}} State=UNKNOWN\n" for n in self.nodes)
        mem = max(1, (os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) // 2**20 - 1024)
        user = os.environ.get("USER") or "root"
        self.conf.write_text(f"""\
ClusterName=rollouttest
SlurmctldHost={self.host}
SlurmctldPort={ctld_port}
SlurmdPort={_free_port()}
SlurmUser={user}
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket}
StateSaveLocation={self.root}/state
SlurmdSpoolDir={self.root}/spool/%n
SlurmctldPidFile={self.root}/run/slurmctld.pid
SlurmdPidFile={self.root}/run/slurmd-%n.pid
SlurmctldLogFile={self.root}/log/slurmctld.log
SlurmdLogFile={self.root}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
ReturnToService=2
KillWait=5
MinJobAge=300
InactiveLimit=0
{node_lines.format(mem=mem)}PartitionName={self.partition} Nodes={",".join(self.nodes)} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
""")
        self._spawn("slurmctld", [self._sbin("slurmctld"), "-D", "-i", "-f", str(self.conf)])
        for n in self.nodes:
            (self.root / "spool" / n).mkdir(parents=True, exist_ok=True)
            extra = [] if len(self.nodes) == 1 else ["-N", n]
            self._spawn(f"slurmd-{n}", [self._sbin("slurmd"), "-D", "-f", str(self.conf), *extra])
        self._wait(self._node_idle, timeout, "the node to be idle in sinfo")
        return self

    def _node_idle(self) -> bool:
        for name, p in self.procs.items():
            if p.poll() is not None:
                raise RuntimeError(f"{name} exited with {p.returncode}:\n{self.logs()}")
        r = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], env=self.env, capture_output=True, text=True)
        states = r.stdout.split()
        return r.returncode == 0 and len(states) == len(self.nodes) and all(s == "idle" for s in states)

    def _wait(self, cond, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if cond():
                return
            time.sleep(0.3)
        raise RuntimeError(f"timed out after {timeout}s waiting for {what}:\n{self.logs()}")

    def logs(self) -> str:
        out = []
        for f in sorted((self.root / "log").glob("*")):
            out.append(f"==== {f.name}\n" + f.read_text(errors="replace")[-3000:])
        return "\n".join(out)

    # ---- jobs -------------------------------------------------------------------------------------
    def sbatch(self, script: str, *args: str, env: Optional[dict] = None, cwd: Optional[str] = None) -> int:
        r = subprocess.run(["sbatch", "--parsable", *args, script], env={**self.env, **(env or {})},
                           capture_output=True, text=True, cwd=cwd, timeout=60)
        if r.returncode != 0:
            raise RuntimeError(f"sbatch failed: {r.stderr}\n{self.logs()}")
        return int(r.stdout.strip().split(";")[0])

    def job_state(self, job_id: int) -> tuple[str, str]:
        """(state, exit code) from scontrol (no accounting database here)."""
        r = subprocess.run(["scontrol", "show", "job", "-o", str(job_id)], env=self.env, capture_output=True,
                           text=True)
        fields = dict(kv.split("=", 1) for kv in r.stdout.split() if "=" in kv)
        return fields.get("JobState", "UNKNOWN"), fields.get("ExitCode", "")

    def wait_job(self, job_id: int, timeout: float) -> tuple[str, str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state, code = self.job_state(job_id)
            if state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "UNKNOWN", "SUSPENDED"):
                return state, code
            time.sleep(1)
        subprocess.run(["scancel", str(job_id)], env=self.env)
        raise TimeoutError(f"job {job_id} did not finish in {timeout}s:\n{self.logs()}")

    def stop(self) -> None:
        names = [n for n in self.procs if n.startswith("slurmd")] + ["slurmctld", "munged"]
        for name in names:
            p = self.procs.pop(name, None)
            if p is None or p.poll() is not None:
                continue
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)


def job_processes(job_id: int) -> list[str]:
    """Command lines of live processes whose environment says SLURM_JOB_ID=job_id."""
    needle = f"SLURM_JOB_ID={job_id}".encode()
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes()
            if needle in env.split(b"\0"):
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                found.append(f"{pid}: {cmd}")
        except OSError:
            continue
    return found
