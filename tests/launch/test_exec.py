"""``elastic-diag exec`` (issue 31): one rank a process started by something other than torchrun, under a
watch. Real processes: three watches started with a launcher's variables (as srun and mpirun set them), a
gloo job whose rank 1 raises; a command with no rank in its environment; the rank variables on their own."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from slurm_cluster import free_port

from elastic_diag.launch.rank_env import RankPlace, job_name, rank_from_env
from elastic_diag.report.schema import validate

EXEC = [sys.executable, "-m", "elastic_diag.cli", "exec"]

JOB = """
import os, sys
from datetime import timedelta
import torch, torch.distributed as dist
# as scripts started by srun or mpirun directly do: the rank from their variables when no launcher set RANK
env = os.environ
rank = int(env.get("RANK") or env.get("SLURM_PROCID") or env.get("OMPI_COMM_WORLD_RANK") or 0)
world = int(env.get("WORLD_SIZE") or env.get("SLURM_NTASKS") or env.get("OMPI_COMM_WORLD_SIZE") or 1)
dist.init_process_group("gloo", rank=rank, world_size=world,
                        timeout=timedelta(seconds=int(os.environ.get("PG_TIMEOUT", "6"))))
t = torch.ones(8)

def wait_for_marker(path):  # a rank that waits for a file nobody writes
    import time
    while not os.path.exists(path):
        time.sleep(0.1)

for step in range(6):
    if rank == 1 and step == 3 and os.environ.get("FAIL") == "exception":
        raise KeyError(f"shard-{step}")
    if rank == 1 and step == 3 and os.environ.get("FAIL") == "hang":
        wait_for_marker("/nonexistent/ready")
    if rank == 1 and step == 3 and os.environ.get("FAIL") == "slow-save":
        import time
        time.sleep(6)  # a checkpoint written to slow storage; the others wait in the next all_reduce
    dist.all_reduce(t)
    print(f"rank {rank} step {step}", flush=True)
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.parametrize(
    ("env", "want"),
    [
        ({"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0"}, RankPlace(2, 4, 0, "torchrun")),
        ({"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_STEP_ID": "0"},
         RankPlace(3, 4, 1, "slurm")),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_ID": "7"}, None),  # the batch script, not a step
        ({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1"},
         RankPlace(5, 8, 1, "openmpi")),
        ({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1"}, RankPlace(1, 2, 1, "pmi")),
        ({"PMIX_RANK": "6"}, RankPlace(6, None, None, "pmix")),
        ({"RANK": "3", "WORLD_SIZE": "2"}, RankPlace(3, None, None, "torchrun")),  # a world that cannot hold it
        ({"RANK": "abc", "SLURM_PROCID": "1", "SLURM_STEP_ID": "4"}, RankPlace(1, None, None, "slurm")),
        ({"RANK": "-1"}, None),
        ({"RANK": "9" * 12}, None),
        ({}, None),
    ],
)  # fmt: skip
def test_the_rank_from_each_launchers_variables(env, want):
    assert rank_from_env(env) == want


def test_a_name_every_rank_of_a_job_computes_alike():
    assert job_name({"SLURM_JOB_ID": "41", "SLURM_STEP_ID": "2"}) == "slurm-41.2"
    assert job_name({"SLURM_JOB_ID": "41", "SLURM_STEP_ID": "0", "SLURM_RESTART_COUNT": "1"}) == "slurm-41.0-r1"
    assert job_name({"OMPI_MCA_ess_base_jobid": "123456"}) == "ompi-123456"
    assert job_name({"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}) == "exec-10.0.0.1-29500"
    assert job_name({"SLURM_JOB_ID": "41"}) is None and job_name({}) is None


def _start_ranks(tmp_path: Path, world: int, extra: dict[str, str], *argv: str) -> list[subprocess.Popen[str]]:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    port = free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": str(rank), "WORLD_SIZE": str(world),
               "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), **extra}  # fmt: skip
        procs.append(subprocess.Popen([*EXEC, *argv, "--", sys.executable, str(script)], env=env, cwd=tmp_path,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      start_new_session=True))  # fmt: skip
    return procs


def _finish(procs: list[subprocess.Popen[str]], timeout: float) -> list[tuple[int, str, str]]:
    deadline = time.monotonic() + timeout
    out = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            out.append((p.returncode, stdout, stderr))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_three_ranks_under_watches_name_the_rank_that_raised(tmp_path):
    """Each watch keeps its rank's evidence in the torchrun-diag layout and its exit status; the verdict across
    ranks comes from the same rules: rank 1 raised KeyError, ranks 0 and 2 failed waiting for it; the summary
    is printed once, by the first watch to judge."""
    diag = tmp_path / "diag"
    results = _finish(_start_ranks(tmp_path, 3, {"FAIL": "exception"}, "--diag-dir", str(diag)), 100)
    assert [code for code, _, _ in results] == [1, 1, 1], results
    report = json.loads((diag / "report.json").read_text())
    validate(report)
    d = report["diagnosis"]
    assert (report["status"], d["failure_class"], d["initiating_rank"], d["exception_type"]) == (
        "failed", "python_exception", 1, "KeyError"), d  # fmt: skip
    roles = {r["rank"]: r["role"] for r in report["ranks"]}
    assert roles == {0: "collateral", 1: "initiating", 2: "collateral"}, roles
    summaries = [err for _, _, err in results if "elastic_diag: job FAILED" in err]  # the first watch to judge
    assert len(summaries) == 1 and "job FAILED: initiating rank 1" in summaries[0], [e[-800:] for _, _, e in results]
    assert "rank 1 step 2" in results[1][1] and "KeyError: 'shard-3'" in results[1][2]  # the console still has it
    for rank in range(3):
        folder = diag / "attempt_0" / f"rank_{rank}"
        launcher = json.loads((folder / "launcher.json").read_text())
        assert launcher["rank"]["exit_code"] == 1 and launcher["launcher"] == "elastic-diag exec (torchrun)"
        assert f"rank {rank} step 2" in (folder / "stdout.log").read_text()
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
        assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in folder.iterdir() if f.is_file()), folder
    assert (diag / "report.html").is_file()


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_healthy_job_under_watches_is_healthy_and_exits_0(tmp_path):
    diag = tmp_path / "diag"
    results = _finish(_start_ranks(tmp_path, 2, {}, "--diag-dir", str(diag)), 100)
    assert [code for code, _, _ in results] == [0, 0], results
    report = json.loads((diag / "report.json").read_text())
    assert (report["status"], report["diagnosis"]["failure_class"]) == ("succeeded", "healthy"), report["diagnosis"]
    assert not any("elastic_diag: job" in err for _, _, err in results)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_the_watches_call_a_hang_long_before_the_collective_timeout(tmp_path):
    """Rank 1 waits for a file nobody writes; its peers wait in the next all_reduce (a 120 s timeout). Each
    watch's health monitor reads every rank's progress in the shared diag dir and calls the hang after 4 s:
    its own rank's stacks, then SIGTERM; the verdict names rank 1 with the line it is stuck at."""
    diag = tmp_path / "diag"
    started = time.monotonic()
    results = _finish(_start_ranks(tmp_path, 3, {"FAIL": "hang", "PG_TIMEOUT": "120"}, "--diag-dir", str(diag),
                                   "--diag-hang-timeout", "4"), 100)  # fmt: skip
    assert time.monotonic() - started < 60, "the hang was called by the collective timeout, not the monitor"
    codes = [code for code, _, _ in results]  # a peer stopped a moment before may end rank 0 or 2 with its error
    assert codes[1] == 143 and {codes[0], codes[2]} <= {1, 143}, results
    d = json.loads((diag / "report.json").read_text())["diagnosis"]
    assert (d["initiating_rank"], d["failure_class"]) == (1, "hang"), d
    assert any("in wait_for_marker" in line for line in d["evidence"]), d["evidence"]
    launcher = json.loads((diag / "attempt_0" / "rank_1" / "launcher.json").read_text())
    assert launcher["hang"]["reason"] == "--diag-hang-timeout" and launcher["rank"]["stopped_by_agent"], launcher


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_stall_the_job_gets_over_is_a_warning_naming_the_rank_that_held_it(tmp_path):
    """Rank 1 spends 6 s in a save while its peers wait in the next all_reduce: each watch's monitor takes its
    own rank's part of the stall snapshot (--diag-stall-timeout 2), nothing is stopped, the job succeeds, and
    the report warns of the stall, naming rank 1 and where it was, from the parts merged."""
    diag = tmp_path / "diag"
    results = _finish(_start_ranks(tmp_path, 3, {"FAIL": "slow-save", "PG_TIMEOUT": "60"}, "--diag-dir", str(diag),
                                   "--diag-stall-timeout", "2"), 100)  # fmt: skip
    assert [code for code, _, _ in results] == [0, 0, 0], results
    report = json.loads((diag / "report.json").read_text())
    assert report["status"] == "succeeded", report["diagnosis"]
    stalls = [w for w in report["warnings"] if w["class"] == "stall"]
    assert len(stalls) == 1 and stalls[0]["rank"] == 1 and "job.py" in (stalls[0]["where"] or ""), report["warnings"]
    parts = sorted(p.name for p in (diag / "attempt_0" / "stall_1").glob("stall*.json"))
    assert parts == ["stall.rank_0.json", "stall.rank_1.json", "stall.rank_2.json"], parts


def test_a_rank_killed_by_a_signal_keeps_the_shells_exit_status(tmp_path):
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1"}
    p = subprocess.run([*EXEC, "--diag-dir", str(tmp_path / "d"), "--", sys.executable, "-c",
                        "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert p.returncode == 128 + 9, p
    launcher = json.loads((tmp_path / "d" / "attempt_0" / "rank_0" / "launcher.json").read_text())
    assert launcher["rank"]["exit_code"] == -9
    report = json.loads((tmp_path / "d" / "report.json").read_text())
    assert report["diagnosis"]["initiating_rank"] == 0 and report["status"] == "failed", report["diagnosis"]


def test_the_watch_imports_no_torch(tmp_path):
    code = ("import sys; from elastic_diag.launch.exec_command import run_exec; "
            "c = run_exec([sys.executable, '-c', 'pass'], diag_dir=sys.argv[1]); "
            "print(c, 'torch' in sys.modules)")  # fmt: skip
    p = subprocess.run([sys.executable, "-c", code, str(tmp_path / "d")], env={**os.environ, "RANK": "0"},
                       capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert p.stdout.split() == ["0", "False"], p


def test_two_watches_claiming_one_rank_keep_both_evidences(tmp_path):
    """A task started twice with the same rank: the second watch keeps its evidence beside the first's, the
    verdict says so, neither exit status changes."""
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1"}
    diag = tmp_path / "d"
    first = subprocess.Popen([*EXEC, "--diag-dir", str(diag), "--", sys.executable, "-c",
                              "import time; print('first', flush=True); time.sleep(3)"], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not (diag / "attempt_0" / "rank_0" / "exec.claim").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        second = subprocess.run([*EXEC, "--diag-dir", str(diag), "--", sys.executable, "-c",
                                 "import sys; print('second'); sys.exit(4)"], env=env, capture_output=True,
                                text=True, timeout=60, check=False)  # fmt: skip
        out, _ = first.communicate(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert second.returncode == 4 and first.returncode == 0 and "already watched" in second.stderr, second.stderr
    dup = [d for d in (diag / "attempt_0").iterdir() if d.name.startswith("rank_0.")]
    assert len(dup) == 1 and "second" in (dup[0] / "stdout.log").read_text()
    assert "first" in (diag / "attempt_0" / "rank_0" / "stdout.log").read_text()
    report = json.loads((diag / "report.json").read_text())
    assert any("two processes claimed rank 0" in n for n in report["notes"]), report["notes"]
