"""One failure, four launchers (issue 31): scenario scripts of tests/scenarios/ (checked under torchrun-diag by
test_scenarios.py) started by ``srun`` on a real two-node Slurm, by Open MPI's ``mpirun``, and by a parent that
calls ``torch.multiprocessing.spawn``, each under ``elastic-diag exec``; the verdict must be the one expected
under torchrun-diag (the same initiating rank and class). The table is printed at the end of the session
(conftest.py, tests/launcher_parity.py) and kept in docs/launchers.md.

How each launcher starts the scripts, as users write it:

* ``srun -N2 -n<N> --kill-on-bad-exit=1 elastic-diag exec -- bash -c 'RANK=$SLURM_PROCID ... exec python s.py'``
  (no diag dir given: each task finds ``elastic_diag_runs/slurm-<job>.<step>`` in the shared working directory)
  (a torchrun-style script under srun), and a Lightning Trainer started by ``srun`` with nothing else: its
  SLURMEnvironment reads Slurm's variables;
* ``mpirun -np <N> -x MASTER_ADDR -x MASTER_PORT elastic-diag exec -- bash -c 'RANK=$OMPI_COMM_WORLD_RANK ...'``;
* ``elastic-diag exec -- python spawn.py s.py <N>``: a parent that spawns the ranks and runs the script in each.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import launcher_parity
import pytest
from helpers import EXAMPLE
from slurm_cluster import SlurmCluster, free_port, running_cluster
from test_scenarios import CASES, SCENARIOS, Scenario, _id

from elastic_diag.launch.rank_env import LOOKED_FOR
from elastic_diag.report.schema import validate

EXEC = [sys.executable, "-m", "elastic_diag.cli", "exec"]

# (case id, script, its environment): scenarios whose expected verdict test_scenarios.py asserts
PICKED = {
    "exception": ("dataloader_getitem_error.py", {}),
    "sigkill": ("sigkill_mid_traceback.py", {}),
    "segfault": ("dataloader_worker_segfault.py", {}),
    "hang": ("scatter_gather_then_hang.py", {}),
    "healthy": ("broadcast_best_checkpoint_src.py", {"SCENARIO_FAIL_RANK": "-1"}),
    "lightning": ("lightning_training_step_error.py", {}),
}
RUNS = {
    "srun": ("exception", "sigkill", "hang", "healthy", "lightning"),
    "mpirun": ("exception", "segfault", "hang", "healthy"),
    "mp.spawn": ("exception", "sigkill", "hang", "healthy"),
}

SPAWN = """
import os, runpy, socket, sys
import torch.multiprocessing as mp

def run(index, script, world, port):
    os.environ.update(RANK=str(index), LOCAL_RANK=str(index), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    sys.argv = [script]
    runpy.run_path(script, run_name="__main__")

if __name__ == "__main__":
    script, world = sys.argv[1], int(sys.argv[2])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(run, args=(script, world, port), nprocs=world)
"""

ENV_RANK = {
    "srun": "RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID",
    "mpirun": "RANK=$OMPI_COMM_WORLD_RANK WORLD_SIZE=$OMPI_COMM_WORLD_SIZE LOCAL_RANK=$OMPI_COMM_WORLD_LOCAL_RANK",
}


def _scenario(case: str) -> Scenario:
    script, env = PICKED[case]
    found = [s for s in CASES if s.script == script and s.env == env and not s.flags]
    assert len(found) == 1, (case, found)
    return found[0]


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LOOKED_FOR and not k.startswith(("SLURM_", "OMPI_"))}
    for k in ("WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return {**env, "OMP_NUM_THREADS": "1", **extra}


REQUEUE = 75  # EX_TEMPFAIL; slurm.conf's RequeueExit


@pytest.fixture(scope="module")
def slurm() -> Iterator[SlurmCluster]:
    with running_cluster(nodes=2, extra_conf=f"RequeueExit={REQUEUE}\nJobRequeue=1") as cluster:
        yield cluster


def _start(launcher: str, case: str, s: Scenario, tmp_path: Path, cluster: SlurmCluster | None) -> tuple[
        subprocess.CompletedProcess[str], Path]:  # fmt: skip
    diag = tmp_path / "diag"
    script = str(SCENARIOS / s.script)
    env = _clean_env(TMPDIR=str(tmp_path), **s.env)
    if launcher == "srun":
        assert cluster is not None
        # no diag dir given: the default, named by Slurm's job and step, in the shared working directory
        env = {**cluster.env, **env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
        if case == "lightning":  # nothing but srun: Lightning's SLURMEnvironment reads Slurm's variables
            argv = ["srun", "-N2", "--ntasks-per-node=1", "--kill-on-bad-exit=1", *EXEC, "--", sys.executable, script]
        else:
            argv = ["srun", "-N2", f"-n{s.nproc}", "-O", "--kill-on-bad-exit=1", *EXEC, "--", "bash", "-c",
                    f"{ENV_RANK['srun']} exec {sys.executable} {script}"]  # fmt: skip
    elif launcher == "mpirun":
        mpirun = shutil.which("mpirun")
        if mpirun is None:
            if os.environ.get("ELASTIC_DIAG_REQUIRE_MPI") == "1":
                pytest.fail("ELASTIC_DIAG_REQUIRE_MPI=1 but mpirun is missing (apt-get install openmpi-bin)")
            pytest.skip("Open MPI is not installed (apt-get install openmpi-bin)")
        # --allow-run-as-root: the tests run as root here; --oversubscribe: 3 ranks on 2 cores
        argv = [mpirun, "--allow-run-as-root", "--oversubscribe", "-np", str(s.nproc), "-x", "MASTER_ADDR=127.0.0.1",
                "-x", f"MASTER_PORT={free_port()}", "-x", "OMP_NUM_THREADS=1", "-x", "TMPDIR",
                *(x for k in s.env for x in ("-x", k)), *EXEC, "--", "bash", "-c",
                f"{ENV_RANK['mpirun']} exec {sys.executable} {script}"]  # fmt: skip
    else:
        (tmp_path / "spawn.py").write_text(SPAWN)
        argv = [*EXEC, "--diag-dir", str(diag), "--", sys.executable, str(tmp_path / "spawn.py"), script,
                str(s.nproc)]  # fmt: skip
    p = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=s.timeout,
                       check=False)  # fmt: skip
    if launcher != "mp.spawn":  # the default diag dir: named by Slurm's job and step, Open MPI's job id
        named = list((tmp_path / "elastic_diag_runs").glob("slurm-*.0" if launcher == "srun" else "ompi-*"))
        assert len(named) == 1, (named, p.stderr[-3000:])
        diag = named[0]
    return p, diag


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize(("launcher", "case"), [(lc, c) for lc, cases in RUNS.items() for c in cases])
def test_the_verdict_is_the_one_under_torchrun_diag(request, tmp_path, launcher, case):
    s = _scenario(case)
    cluster = request.getfixturevalue("slurm") if launcher == "srun" else None
    p, diag = _start(launcher, case, s, tmp_path, cluster)
    out = p.stdout[-2500:] + p.stderr[-2500:] + (cluster.logs() if cluster else "")
    assert (diag / "report.json").is_file(), out
    report = json.loads((diag / "report.json").read_text())
    validate(report)
    d = report["diagnosis"]
    launcher_parity.record(_id(s), launcher, d, report["status"], (s.culprit, s.cls))
    assert (d["initiating_rank"], d["failure_class"]) == (s.culprit, s.cls), (d, out)
    # the relaunch a verification re-runs: the same launcher and command under a new watch, its own diag dir
    relaunch = report["launch"]["relaunch"]
    lead = {"srun": "srun -N 2 -n ", "mpirun": "mpirun -np ", "mp.spawn": ""}[launcher]
    assert relaunch.startswith(lead) and f"exec --diag-dir {diag}.verify -- " in relaunch, relaunch
    if case == "healthy":
        assert p.returncode == 0 and report["status"] == "succeeded", out
        assert "elastic_diag: job" not in p.stdout + p.stderr
        return
    assert p.returncode != 0 and report["status"] == "failed", out
    assert (p.stdout + p.stderr).count(f"elastic_diag: job FAILED: initiating rank {s.culprit}") == 1, out
    if launcher == "srun":  # one task on each node at least: the ranks' folders say where they ran
        nodes = {json.loads(f.read_text())["node"] for f in (diag / "attempt_0").glob("rank_*/launcher.json")}
        assert nodes == {"node0", "node1"}, nodes
    if case == "hang":  # the stuck rank's stack, taken before the launcher's teardown reached it
        assert any("in postprocess" in line for line in d["evidence"]), d["evidence"]


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_diag_dir_per_host_gives_a_verdict_per_host_that_says_what_is_missing(tmp_path, slurm):
    """Each node's watch writes into a folder of that node only (a diag dir on local disk): each folder gets a
    verdict over the ranks it saw and names the ranks whose evidence is missing; the culprit's node names it,
    the other says it cannot name a rank (never healthy)."""
    s = _scenario("exception")  # rank 1 raises; one rank on each node
    env = {**slurm.env, **_clean_env(TMPDIR=str(tmp_path)), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    per_host = tmp_path / "local"
    argv = ["srun", "-N2", f"-n{s.nproc}", "--kill-on-bad-exit=1", "bash", "-c",
            f"exec {shlex.join(EXEC)} --diag-dir {per_host}/$SLURMD_NODENAME -- bash -c "
            f"'{ENV_RANK['srun']} exec {sys.executable} {SCENARIOS / s.script}'"]  # fmt: skip
    p = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=s.timeout, check=False)
    out = p.stdout[-2500:] + p.stderr[-2500:] + slurm.logs()
    assert p.returncode != 0, out
    reports = {d.name: json.loads((d / "report.json").read_text()) for d in per_host.iterdir()}
    assert set(reports) == {"node0", "node1"}, (reports.keys(), out)
    seen = {name: [r["rank"] for r in rep["ranks"]] for name, rep in reports.items()}
    assert sorted(sum(seen.values(), [])) == [0, 1], seen
    for name, rep in reports.items():
        validate(rep)
        assert rep["status"] == "failed", rep["status"]
        missing = sorted({0, 1} - set(seen[name]))
        assert any(f"no evidence from rank(s) {missing}" in n and "not shared" in n for n in rep["notes"]), rep["notes"]
        d = rep["diagnosis"]
        if 1 in seen[name]:
            assert (d["initiating_rank"], d["failure_class"]) == (1, "python_exception"), d
        else:  # only a rank that failed waiting for its peer: no rank named, and it says where to look
            assert d["initiating_rank"] is None and "evidence is missing" in d["summary"], d


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_retryable_failure_under_srun_asks_slurm_for_a_new_allocation(tmp_path, slurm):
    """`srun elastic-diag exec --diag-requeue-exit-code 75`, `RequeueExit=75` in slurm.conf: a network error on
    rank 1 is retryable, every watch exits 75 and Slurm requeues the job (its next run's diag dir is named
    `-r1`: test_exec.py), as under torchrun-diag (tests/launch/test_slurm.py, which also runs the second run)."""
    work = tmp_path / "work"
    work.mkdir()
    script = tmp_path / "requeue.sh"
    script.write_text(f"""#!/bin/bash
export OMP_NUM_THREADS=1 MASTER_ADDR=127.0.0.1 MASTER_PORT={free_port()}
inject=network-error
[ "${{SLURM_RESTART_COUNT:-0}}" -gt 0 ] && inject=none
srun -N1 -n2 -O {shlex.join(EXEC)} --diag-requeue-exit-code {REQUEUE} -- bash -c \
  "RANK=\\$SLURM_PROCID WORLD_SIZE=\\$SLURM_NTASKS LOCAL_RANK=\\$SLURM_LOCALID exec {sys.executable} {EXAMPLE} \
   --inject $inject --culprit-rank 1 --steps 6 --pg-timeout 8"
""")
    script.chmod(0o755)
    job = slurm.sbatch(script, "-N1", "--requeue", "--open-mode=append", "-o", f"{tmp_path}/requeue-%j.out", cwd=work)
    deadline = time.monotonic() + 150
    while slurm.job(job).get("Restarts") != "1" and time.monotonic() < deadline:
        time.sleep(0.3)
    first = slurm.job(job)
    out = (
        (tmp_path / f"requeue-{job}.out").read_text(errors="replace")
        if (tmp_path / f"requeue-{job}.out").exists()
        else ""
    )
    assert (first.get("Restarts"), first.get("ExitCode")) == ("1", f"{REQUEUE}:0"), (first, out[-3000:], slurm.logs())
    slurm.client("scancel", job)  # the requeued run itself is torchrun-diag's test (test_slurm.py): same mechanics
    runs = work / "elastic_diag_runs"
    failed = json.loads((runs / f"slurm-{job}.0" / "report.json").read_text())
    validate(failed)
    d = failed["diagnosis"]
    assert (d["initiating_rank"], d["failure_class"]) == (1, "network_error"), d
    assert failed["requeue"] == {"requeue": True, "exit_code": REQUEUE, "reason": failed["requeue"]["reason"]}
