"""A real Slurm on this host for the tests: munged, slurmctld and one slurmd per node, all in a temp
dir, started and stopped by the test (Debian's slurm-wlm and munge; ../shared/SLURM_NOTES.md has the
measured facts this follows). Several "nodes" share the host (each slurmd has its own port and
spool); every client call carries SLURM_CONF. Accounting is off: job outcomes come from
``scontrol show job`` (kept for MinJobAge after the end) and the jobs' own output files.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo", "scancel")


def missing_tools() -> list[str]:
    return [d for d in DAEMONS if shutil.which(d) is None and not Path("/usr/sbin", d).exists()]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _exe(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


class SlurmCluster:
    """``nodes`` slurmd daemons named node0, node1, ... on 127.0.0.1, one CPU each."""

    def __init__(self, root: Path, *, nodes: int = 2, extra_conf: str = "") -> None:
        self.root = root
        self.nodes = [f"node{i}" for i in range(nodes)]
        self.extra_conf = extra_conf
        self.conf = root / "slurm.conf"
        self.munge_socket = root / "munge" / "munge.socket"
        self.pid_files: list[Path] = []
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    # -- life --------------------------------------------------------------------------------------
    def start(self, timeout: float = 30.0) -> None:
        """Start the daemons; raise RuntimeError with their logs when the nodes do not come up idle."""
        munge = self.root / "munge"
        munge.mkdir(parents=True, mode=0o700)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self._daemon([_exe("munged"), f"--key-file={key}", f"--socket={self.munge_socket}", f"--pid-file={munge}/pid",
                      f"--log-file={munge}/log", f"--seed-file={munge}/seed", "-f"], munge / "pid")  # fmt: skip
        self._write_conf()
        for node in self.nodes:
            (self.root / f"spool_{node}").mkdir()
        self._daemon([_exe("slurmctld"), "-f", str(self.conf)], self.root / "slurmctld.pid")
        for node in self.nodes:
            self._daemon([_exe("slurmd"), "-f", str(self.conf), "-N", node], self.root / f"slurmd.{node}.pid")
        deadline = time.monotonic() + timeout
        states = ""
        while time.monotonic() < deadline:
            states = self.client("sinfo", "-h", "-N", "-o", "%N %t", check=False).stdout
            up = {line.split()[0] for line in states.splitlines() if line.split()[-1:] == ["idle"]}
            if set(self.nodes) <= up:
                return
            time.sleep(0.5)
        raise RuntimeError(f"the Slurm nodes did not come up idle in {timeout:.0f} s (sinfo: {states!r}):\n"
                           + self.logs())  # fmt: skip

    def stop(self) -> None:
        """Cancel what still runs, stop the daemons (SIGTERM, then SIGKILL), leave nothing behind."""
        with contextlib.suppress(Exception):
            self.client("scancel", "--full", "--signal=KILL", "--user", "root", check=False, timeout=10)
        for pid_file in reversed(self.pid_files):
            pid = self._pid(pid_file)
            if pid is None:
                continue
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and _alive(pid):
                time.sleep(0.1)
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)

    def _daemon(self, argv: list[str], pid_file: Path) -> None:
        subprocess.run(argv, env=self.env, check=True, timeout=30, stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE)  # fmt: skip
        self.pid_files.append(pid_file)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and self._pid(pid_file) is None:
            time.sleep(0.05)

    @staticmethod
    def _pid(pid_file: Path) -> int | None:
        try:
            return int(pid_file.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def _write_conf(self) -> None:
        host = socket.gethostname()
        r = self.root
        lines = [
            "ClusterName=edtest", f"SlurmctldHost={host}(127.0.0.1)", "AuthType=auth/munge",
            f"AuthInfo=socket={self.munge_socket}", "CredType=cred/munge", f"SlurmctldPort={free_port()}",
            f"StateSaveLocation={r}/state", f"SlurmdSpoolDir={r}/spool_%n", f"SlurmctldPidFile={r}/slurmctld.pid",
            f"SlurmdPidFile={r}/slurmd.%n.pid", f"SlurmctldLogFile={r}/slurmctld.log",
            f"SlurmdLogFile={r}/slurmd.%n.log",
            "SlurmUser=root", "SlurmdUser=root", "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
            "SelectType=select/cons_tres", "JobAcctGatherType=jobacct_gather/none", "MpiDefault=none",
            "ReturnToService=2", "MinJobAge=600", "KillWait=30", "SchedulerType=sched/builtin",
            *self.extra_conf.split("\n"),
        ]  # fmt: skip
        (r / "state").mkdir()
        for node in self.nodes:
            lines.append(f"NodeName={node} NodeHostname={host} NodeAddr=127.0.0.1 Port={free_port()} CPUs=1 "
                         "RealMemory=4000")  # fmt: skip
        lines.append(f"PartitionName=debug Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(line for line in lines if line.strip()) + "\n")

    # -- clients -------------------------------------------------------------------------------------
    def client(self, *argv: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        return subprocess.run([_exe(argv[0]), *argv[1:]], env=self.env, capture_output=True, text=True, check=check,
                              timeout=timeout)  # fmt: skip

    def sbatch(self, script: Path, *options: str, cwd: Path, env: dict[str, str] | None = None) -> str:
        run = subprocess.run([_exe("sbatch"), "--parsable", *options, str(script)], env={**self.env, **(env or {})},
                             cwd=cwd, capture_output=True, text=True, check=True, timeout=30)  # fmt: skip
        return run.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        out = self.client("scontrol", "show", "job", "-o", job_id, check=False).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait_state(self, job_id: str, states: set[str], timeout: float) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        info: dict[str, str] = {}
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            time.sleep(0.3)
        raise TimeoutError(f"job {job_id} not in {sorted(states)} after {timeout:.0f} s: {info}\n" + self.logs())

    def logs(self, tail: int = 30) -> str:
        out = []
        for log in sorted(self.root.glob("*.log")) + [self.root / "munge" / "log"]:
            with contextlib.suppress(OSError):
                out.append(f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-tail:]))
        return "\n".join(out)


@contextlib.contextmanager
def running_cluster(*, nodes: int = 2, extra_conf: str = "") -> Iterator[SlurmCluster]:
    """A started cluster in a short folder of its own, stopped and removed after; skips saying why where Slurm
    cannot run here (fails instead with ELASTIC_DIAG_REQUIRE_SLURM=1, as .ci/run sets). The folder is short:
    slurmd's step sockets (<spool>/<node>_<job>.<step>) must fit in the 108 bytes of a Unix socket path, which
    pytest's tmp_path under xdist does not leave."""
    import pytest

    def skip_or_fail(reason: str) -> None:
        if os.environ.get("ELASTIC_DIAG_REQUIRE_SLURM") == "1":
            pytest.fail(f"ELASTIC_DIAG_REQUIRE_SLURM=1 but {reason}")
        pytest.skip(reason)

    if os.geteuid() != 0:
        skip_or_fail("a private Slurm needs root here (SlurmUser=root, munged's key)")
    if missing := missing_tools():
        skip_or_fail(f"Slurm is not installed (missing {', '.join(missing)}; apt-get install slurm-wlm munge)")
    root = Path(tempfile.mkdtemp(prefix="edslurm-", dir="/tmp"))
    cluster = SlurmCluster(root, nodes=nodes, extra_conf=extra_conf)
    try:
        try:
            cluster.start()
        except (RuntimeError, OSError) as e:
            cluster.stop()
            skip_or_fail(f"the Slurm daemons did not start: {e}")
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:  # a zombie of ours is not alive
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][:1] != "Z"
    except OSError:
        return False
