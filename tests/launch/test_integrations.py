"""The switch under the launchers users already have (issue 15): `ELASTIC_DIAG=1` in the environment
of `accelerate launch`, of plain `torchrun` running a Lightning Trainer, and of `fabric run`. Each
runs a real framework on CPU with a failure on one rank; the report names that rank."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import ROOT, kill_leftovers, launch, plain_torchrun, script_args, torchrun_diag

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

SCENARIOS = ROOT / "tests" / "scenarios"
BIN = Path(sys.executable).parent


def _verdict(report: dict) -> tuple:
    d = report["diagnosis"]
    return d["initiating_rank"], d["failure_class"], d["exception_type"]


def test_accelerate_launch_multi_gpu_on_cpu(tmp_path):
    """accelerate's --multi_gpu path runs torch.distributed.run in its own process, with the static
    backend (its default rdzv_backend)."""
    accelerate = shutil.which("accelerate", path=str(BIN))
    assert accelerate, "accelerate is in the test extra"
    argv = [accelerate, "launch", "--multi_gpu", "--num_processes", "3", "--num_machines", "1",
            "--main_process_port", "0", str(SCENARIOS / "accelerate_loop_error.py")]  # fmt: skip
    run = launch(argv, tmp_path, timeout=240,
                 env={"ELASTIC_DIAG": "1", "ACCELERATE_USE_CPU": "1", "ELASTIC_DIAG_DIR": str(tmp_path)})  # fmt: skip
    assert run.returncode == 1, run.stderr[-3000:]
    assert _verdict(run.report) == (1, "python_exception", "IndexError")
    assert "started by ELASTIC_DIAG=1 (torchrun --rdzv-backend static)" in run.report["notes"][0]
    # the verification re-runs `accelerate launch` as it was, not torchrun with accelerate's options
    assert f"{accelerate} launch --multi_gpu --num_processes 3 " in run.report["launch"]["relaunch"]


def test_lightning_trainer_under_plain_torchrun(tmp_path):
    argv = plain_torchrun("--standalone", "--nproc-per-node", "3", str(SCENARIOS / "lightning_training_step_error.py"))
    run = launch(argv, tmp_path, timeout=240, env={"ELASTIC_DIAG": "1", "ELASTIC_DIAG_DIR": str(tmp_path)})
    assert run.returncode == 1, run.stderr[-3000:]
    assert _verdict(run.report) == (1, "python_exception", "ValueError")


def test_fabric_run(tmp_path):
    fabric = shutil.which("fabric", path=str(BIN))
    assert fabric, "lightning (and its fabric CLI) is in the test extra"
    argv = [fabric, "run", "--accelerator", "cpu", "--strategy", "ddp", "--devices", "3",
            str(SCENARIOS / "fabric_loop_error.py")]  # fmt: skip
    run = launch(argv, tmp_path, timeout=240, env={"ELASTIC_DIAG": "1", "ELASTIC_DIAG_DIR": str(tmp_path)})
    assert run.returncode == 1, run.stderr[-3000:]
    assert _verdict(run.report) == (2, "python_exception", "IndexError")


def _signal_when_training(argv: list[str], diag_dir: Path, signum: int, env: dict[str, str]) -> tuple[int, str]:
    """Start the launcher, wait until rank 0's beacon has counted a few steps, send it ``signum`` as
    Slurm's scancel or a Kubernetes eviction would (SIGTERM) or Ctrl-C (SIGINT); its exit status and stderr."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    proc = subprocess.Popen(argv, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    progress = diag_dir / "attempt_0" / "rank_0" / "progress.json"
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if json.loads(progress.read_text()).get("steps", 0) >= 3:
                    break
            except (OSError, ValueError):
                pass
            time.sleep(0.2)
        assert proc.poll() is None, "the launcher ended before it was signalled"
        os.kill(proc.pid, signum)
        if signum == signal.SIGTERM:  # as under Slurm: every process of the job signalled, srun passes it on again
            time.sleep(0.3)
            os.kill(proc.pid, signum)
        _out, err = proc.communicate(timeout=120)
        return proc.returncode, err
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        kill_leftovers(diag_dir)


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["sigterm", "sigint"])
def test_a_signal_to_the_launcher_is_a_stop_from_outside(tmp_path, signum, code):
    """scancel, a time limit, preemption or an eviction (SIGTERM), or Ctrl-C (SIGINT): the launcher passes
    the signal on to the workers as torchrun does, writes a report with status "stopped", class killed and
    no initiating rank, and exits 128 + the signal's number. No worker is left."""
    termination_log = tmp_path / "termination-log"
    # the preemption-aware loop users write for Slurm: on SIGTERM each rank saves and exits, and rank 1's
    # save blocks (a file system that stopped answering); SIGINT (Ctrl-C) interrupts every rank at once
    argv = torchrun_diag("--standalone", "--nproc-per-node", "2", "--diag-dir", str(tmp_path),
                         "--shutdown-timeout", "8", "--diag-termination-log", str(termination_log),
                         str(SCENARIOS / "sigterm_save_blocks.py"))  # fmt: skip
    returncode, err = _signal_when_training(argv, tmp_path, signum, {"SCENARIO_CKPT_DIR": str(tmp_path)})
    assert returncode == code, err[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert termination_log.read_text().startswith("elastic_diag: job STOPPED from outside (no rank failed): Stopped")
    d = report["diagnosis"]
    assert (report["status"], d["failure_class"], d["initiating_rank"]) == ("stopped", "killed", None)
    name = signal.Signals(signum).name
    assert f"Stopped from outside by {name} at step " in d["summary"]
    assert "job STOPPED from outside" in err and "Traceback" not in err.split("job STOPPED")[-1]
    held = [r for r in report["stop"]["ranks"] if not r["exited"]]
    if signum == signal.SIGTERM:  # rank 1's stack, taken before torch killed it; the repeated signal did not cut in
        # (rank 0 is held too when the signal reached rank 1 first and rank 0 went on into the next all_reduce)
        by_rank = {r["rank"]: r for r in held}
        assert 1 in by_rank and "in save_checkpoint" in by_rank[1]["where"], report["stop"]
        assert "did not exit within 5 s of it" in d["summary"] and "save_checkpoint" in d["summary"]
        assert "SIGTERM again while stopping; the stop goes on" in err, err[-3000:]
    else:  # Ctrl-C interrupts every rank; one still in a collective when the grace ends has its stack taken
        assert all(r["stack_file"] for r in held), report["stop"]
    ps = subprocess.run(["pgrep", "-f", f"--diag-dir {tmp_path}"], capture_output=True, text=True, check=False)
    assert ps.stdout.strip() == "", "a process of the job is still running"


def test_a_signal_under_plain_torchrun_with_the_switch_writes_the_stopped_report(tmp_path):
    argv = plain_torchrun("--standalone", "--nproc-per-node", "2", *script_args("none"), "--steps", "100000")
    returncode, err = _signal_when_training(argv, tmp_path, signal.SIGTERM,
                                            {"ELASTIC_DIAG": "1", "ELASTIC_DIAG_DIR": str(tmp_path)})  # fmt: skip
    assert returncode == 143, err[-3000:]  # as torchrun-diag (plain torchrun: 1 and a traceback)
    report = json.loads((tmp_path / "report.json").read_text())
    assert (report["status"], report["diagnosis"]["failure_class"]) == ("stopped", "killed")
