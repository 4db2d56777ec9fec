"""The switch under the launchers users already have (issue 15): `ELASTIC_DIAG=1` in the environment
of `accelerate launch`, of plain `torchrun` running a Lightning Trainer, and of `fabric run`. Each
runs a real framework on CPU with a failure on one rank; the report names that rank."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
from helpers import ROOT, launch, plain_torchrun

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
