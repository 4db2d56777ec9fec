"""torchrun-diag under a real Slurm (issue 15): munged, slurmctld and two slurmd ("node0", "node1" on
this host) started and stopped by the test (tests/slurm_cluster.py), jobs submitted with sbatch and
run with `srun torchrun-diag ...`, as users write their job scripts.

* two nodes, the default diag dir: one folder named by the job and the step (both nodes' launchers
  pick the same name in the shared working directory), one merged report naming the culprit's rank
  and its Slurm node name; a deterministic failure exits 1 even with a requeue exit code set;
* a retryable failure with --diag-requeue-exit-code 75 and `RequeueExit=75` in slurm.conf: Slurm
  requeues the job, and its second run (SLURM_RESTART_COUNT=1, its own diag dir) succeeds; the failure
  is blamed on the node (an NCCL network error), the ledger already held one on each node, so with
  --diag-drain the failing node is drained before the requeue and the second run starts on the other;
* scancel: the SIGTERM reaches the launcher, which passes it on, takes the stack of the rank whose
  checkpoint save blocks, writes a "stopped" report and exits 143.

The test skips, saying why, where the Slurm packages are missing or the daemons cannot start
(.ci/run installs them and sets ELASTIC_DIAG_REQUIRE_SLURM=1, so there it fails instead).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
from helpers import EXAMPLE, ROOT, kill_leftovers
from slurm_cluster import SlurmCluster, free_port, running_cluster

from elastic_diag.report.schema import validate

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(360)]

LAUNCHER = Path(sys.executable).parent / "torchrun-diag"
STUCK_SAVE = ROOT / "tests" / "scenarios" / "sigterm_save_blocks.py"
REQUEUE = 75  # EX_TEMPFAIL


@pytest.fixture
def slurm():
    with running_cluster(nodes=2, extra_conf=f"RequeueExit={REQUEUE}\nJobRequeue=1") as cluster:
        yield cluster


def _script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/bash\nexport OMP_NUM_THREADS=1\n" + body)
    path.chmod(0o755)
    return path


def _report(folder: Path) -> dict:
    data = json.loads((folder / "report.json").read_text())
    validate(data)
    return data


def _wait_for_line(path: Path, text: str, timeout: float, slurm: SlurmCluster, job: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text(errors="replace"):
            return
        time.sleep(0.2)
    raise AssertionError(f"{text!r} not in {path} after {timeout:.0f} s:\n"
                         + (path.read_text(errors="replace")[-3000:] if path.exists() else "(no file)")
                         + f"\njob {job}: {slurm.job(job)}\n{slurm.logs()}")  # fmt: skip


def _seed_node_failures(ledger_path: Path) -> None:
    """One earlier NCCL network failure on each node, in two other jobs: a second one makes a node recommended."""
    from elastic_diag.ledger.store import Ledger
    from elastic_diag.ledger.verdicts import verdicts_of_report

    ledger = Ledger(f"sqlite:///{ledger_path}")
    for i, node in enumerate(("node0", "node1")):
        d = {
            "failure_class": "network_error",
            "initiating_rank": 0,
            "initiating_node": node,
            "signature_id": "nccl-network-error",
            "evidence": ["NET/IB : Got completion from peer 10.0.0.3<52244> with status=12 opcode=0 len=0"],
        }
        report = {"run_id": f"earlier-{i}", "status": "failed", "attempts": [
            {"attempt": 0, "status": "failed", "diagnosis": d, "ranks": [{"rank": 0, "node": node}]}]}  # fmt: skip
        ledger.record(verdicts_of_report(report, source="torchrun-diag", job_id=f"slurm:90{i}",
                                         recorded_at=time.time() - 3600))  # fmt: skip
    ledger.close()


def test_srun_torchrun_diag_on_two_nodes_requeue_and_scancel(slurm, tmp_path):
    work = tmp_path / "work"  # every job's working directory: "shared" by both nodes, as on a cluster
    work.mkdir()
    ledger_path = tmp_path / "ledger.sqlite"
    _seed_node_failures(ledger_path)
    try:
        # 1. a retryable failure (requeued, then it succeeds) and a scancel'd job, side by side on one node each
        requeue_job = slurm.sbatch(_script(tmp_path / "requeue.sh", f"""
inject=network-error
[ "${{SLURM_RESTART_COUNT:-0}}" -gt 0 ] && inject=none
srun {LAUNCHER} --standalone --nproc-per-node 2 --diag-requeue-exit-code {REQUEUE} --diag-drain \\
    {EXAMPLE} --inject $inject --culprit-rank 1 --steps 6 --pg-timeout 8
"""), "-N1", "--requeue", "--open-mode=append", "-o", f"{tmp_path}/requeue-%j.out", cwd=work,
            env={"ELASTIC_DIAG_LEDGER": str(ledger_path)})  # fmt: skip
        cancel_out = tmp_path / "cancel.out"
        cancel_job = slurm.sbatch(_script(tmp_path / "cancel.sh", f"""
srun bash -c 'trap "echo the step shell got SIGTERM" TERM
{LAUNCHER} --standalone --nproc-per-node 2 --diag-dir {tmp_path}/cancelled --shutdown-timeout 10 \\
    {STUCK_SAVE}
echo "launcher exit $?"'
"""), "-N1", "-o", str(cancel_out), cwd=work, env={"SCENARIO_CKPT_DIR": str(tmp_path)})  # fmt: skip

        _wait_for_line(cancel_out, "step 5", 120, slurm, cancel_job)
        slurm.client("scancel", cancel_job)  # as users do: SIGTERM to every process of the job, SIGKILL after KillWait
        info = slurm.wait_state(cancel_job, {"CANCELLED", "COMPLETED", "FAILED"}, 60)
        _wait_for_line(cancel_out, "launcher exit", 40, slurm, cancel_job)
        out = cancel_out.read_text()
        assert "launcher exit 143" in out, out[-3000:]
        stopped = _report(tmp_path / "cancelled")
        d = stopped["diagnosis"]
        assert (stopped["status"], d["failure_class"], d["initiating_rank"]) == ("stopped", "killed", None), d
        assert "Stopped from outside by SIGTERM at step " in d["summary"]
        # rank 1 blocks in its save; rank 0 exits, unless the signal reached rank 1 first and rank 0 went on
        # into the next step's all_reduce, waiting for rank 1 (both happen: the signals race): stacks of both
        holdout = {r["rank"]: r for r in stopped["stop"]["ranks"] if not r["exited"]}
        assert 1 in holdout and "save_checkpoint" in (holdout[1]["where"] or ""), stopped["stop"]
        assert "save_checkpoint" in Path(holdout[1]["stack_file"]).read_text()
        assert all(r["stack_file"] for r in holdout.values()), holdout
        assert stopped["node"] in ("node0", "node1"), stopped["node"]  # Slurm's node name, not the host's
        assert info["JobState"] == "CANCELLED", info

        # the requeue: Slurm saw exit 75 and put the job back in the queue (eligible after its requeue
        # delay of about two minutes: released at once here), and the second run succeeded
        deadline = time.monotonic() + 120
        while slurm.job(requeue_job).get("Restarts") != "1" and time.monotonic() < deadline:
            time.sleep(0.3)
        first = slurm.job(requeue_job)
        assert (first.get("Restarts"), first.get("ExitCode")) == ("1", f"{REQUEUE}:0"), first
        slurm.client("scontrol", "update", f"JobId={requeue_job}", "StartTime=now")
        done = slurm.wait_state(requeue_job, {"COMPLETED", "FAILED", "CANCELLED"}, 120)
        assert (done["JobState"], done["ExitCode"]) == ("COMPLETED", "0:0"), done
        runs = work / "elastic_diag_runs"
        failed_run, second_run = _report(runs / f"slurm-{requeue_job}.0"), _report(runs / f"slurm-{requeue_job}.0-r1")
        assert (failed_run["diagnosis"]["initiating_rank"], failed_run["diagnosis"]["failure_class"]) == (
            1, "network_error"), failed_run["diagnosis"]  # fmt: skip
        assert failed_run["requeue"]["requeue"] is True and failed_run["requeue"]["exit_code"] == REQUEUE
        assert second_run["status"] == "succeeded"
        # the node blamed (its second node failure) was drained before the requeue: the second run is on the other
        bad = failed_run["diagnosis"]["initiating_node"]
        assert bad in ("node0", "node1") and second_run["node"] == {"node0": "node1", "node1": "node0"}[bad], (
            bad, second_run["node"])  # fmt: skip
        said = (tmp_path / f"requeue-{requeue_job}.out").read_text(errors="replace")
        assert (f"{bad} is recommended for exclusion: 2 node failure(s) in 14 days (rule: 2) (elastic-diag fleet): "
                "drained it, so the requeued job starts without it") in said, (
            said[-3000:])  # fmt: skip
        node = slurm.client("scontrol", "show", "node", bad).stdout
        assert "DRAIN" in node and "Reason=elastic_diag: 2 node failure(s)" in node, node
        slurm.client("scontrol", "update", f"NodeName={bad}", "State=RESUME")  # both nodes again for the next job

        # 2. two nodes, one srun step, the default diag dir; rank 1 (on node1) raises
        port = free_port()
        job = slurm.sbatch(_script(tmp_path / "two_nodes.sh", f"""
srun {LAUNCHER} --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:{port} \\
    --rdzv-id $SLURM_JOB_ID --diag-requeue-exit-code {REQUEUE} \\
    {EXAMPLE} --inject exception --culprit-rank 1 --steps 8 --pg-timeout 8
"""), "-N2", "--ntasks-per-node=1", "-o", f"{tmp_path}/two-%j.out", cwd=work)  # fmt: skip
        info = slurm.wait_state(job, {"COMPLETED", "FAILED", "CANCELLED"}, 180)
        output = (tmp_path / f"two-{job}.out").read_text(errors="replace")
        assert info["ExitCode"] == "1:0", output[-3000:]  # deterministic: never the requeue code
        folders = sorted(p.name for p in runs.iterdir() if p.name.startswith(f"slurm-{job}"))
        assert folders == [f"slurm-{job}.0"], folders  # one folder for the step, both nodes in it
        merged = _report(runs / f"slurm-{job}.0")
        d = merged["diagnosis"]
        assert (d["initiating_rank"], d["failure_class"]) == (1, "python_exception"), d
        # Slurm's node names (SLURMD_NODENAME), not the host name both "nodes" share here
        nodes = {r["rank"]: r["node"] for r in merged["ranks"]}
        assert d["initiating_node"] == nodes[1] and {n.split()[0] for n in nodes.values()} == {"node0", "node1"}, nodes
        assert merged["requeue"]["requeue"] is False and "not known to be retryable" in merged["requeue"]["reason"]
        assert sorted(r["rank"] for r in merged["ranks"]) == [0, 1]
    finally:
        for folder in [tmp_path / "cancelled", *(work / "elastic_diag_runs").glob("*")]:
            kill_leftovers(folder)
