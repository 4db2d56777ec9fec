"""The fault-injection matrix: real torchrun-diag, 4 CPU ranks on gloo, the culprit is rank 2.

Each case runs the example training script under the launcher and checks the report names the
right initiating rank and class, with the culprit's last stderr lines in it.
"""

from __future__ import annotations

import re

import pytest

from conftest import EXAMPLE, launch, plain_torchrun, torchrun_diag

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(150)]

CULPRIT = 2
COMMON = ["--standalone", "--nproc-per-node", "4"]


def script_args(inject: str, pg_timeout: float = 8) -> list[str]:
    return [str(EXAMPLE), "--inject", inject, "--culprit-rank", str(CULPRIT), "--pg-timeout", str(pg_timeout)]


CASES = [
    # inject, class, exception type, a line that must be in the culprit's last_lines
    ("exception", "python_exception", "ValueError", "ValueError: injected failure"),
    ("exception-after-cleanup", "python_exception", "ValueError", "ValueError: injected failure"),
    ("segfault", "segfault", None, "Fatal Python error: Segmentation fault"),
    ("sigkill", "killed", None, None),
    ("exit", "silent_exit", None, None),
    ("memoryerror", "host_oom", "MemoryError", "MemoryError"),
    ("hang", "hang", None, None),
]


@pytest.mark.parametrize("inject, cls, exc_type, culprit_line", CASES, ids=[c[0] for c in CASES])
def test_fault_matrix_names_the_culprit(tmp_path, inject, cls, exc_type, culprit_line):
    run = launch(torchrun_diag(*COMMON, "--diag-dir", str(tmp_path), *script_args(inject)), tmp_path)
    assert run.returncode == 1, run.stderr[-3000:]
    report = run.report
    d = report["diagnosis"]
    assert report["status"] == "failed"
    assert (d["initiating_rank"], d["failure_class"], d["exception_type"]) == (CULPRIT, cls, exc_type), d
    assert d["summary"] and d["evidence"] and d["fix"] and d["verify"]
    roles = {r["rank"]: r["role"] for r in report["ranks"]}
    assert roles[CULPRIT] == "initiating"
    assert set(roles.values()) <= {"initiating", "collateral", "stopped"}
    assert d["collateral_ranks"] == sorted(r for r, role in roles.items() if role == "collateral")
    culprit = run.rank(CULPRIT)
    if culprit_line:
        assert any(culprit_line in line for line in culprit["last_lines"]), culprit["last_lines"]
    if inject == "sigkill":
        assert culprit["signal"] == "SIGKILL" and culprit["exit_code"] == -9
    if inject == "hang":
        assert culprit["stack"] and "in inject" in culprit["stack"]
        assert "train_ddp.py" in d["summary"]
    # torchrun's own summary, printed above ours, names the culprit as root cause too
    root = re.search(r"Root Cause \(first observed failure\):\n\[0\]:\n(?:.*\n){2}\s+rank\s+: (\d+)", run.stderr)
    assert root and int(root.group(1)) == CULPRIT, run.stderr[-2000:]
    assert f"initiating rank {CULPRIT}" in run.stderr
    # every rank's streams are kept, and the console still showed them
    assert (tmp_path / "attempt_0" / f"rank_{CULPRIT}" / "stderr.log").exists()
    assert "[default0]:step 0 loss" in run.stdout


def test_healthy_run_raises_no_alarm(tmp_path):
    run = launch(torchrun_diag(*COMMON, "--diag-dir", str(tmp_path), *script_args("none")), tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    report = run.report
    assert report["status"] == "succeeded" and report["diagnosis"]["failure_class"] == "healthy"
    assert report["diagnosis"]["initiating_rank"] is None and report["warnings"] == []
    assert [r["role"] for r in report["ranks"]] == ["healthy"] * 4
    assert "FAILED" not in run.stderr and "job succeeded" in run.stderr


def test_transient_failure_then_restart_succeeds(tmp_path):
    run = launch(
        torchrun_diag(*COMMON, "--max-restarts", "1", "--diag-dir", str(tmp_path), *script_args("transient")), tmp_path
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = run.report
    assert report["status"] == "succeeded" and report["diagnosis"]["failure_class"] == "healthy"
    first, second = report["attempts"]
    assert first["status"] == "failed" and second["status"] == "succeeded"
    assert (first["diagnosis"]["initiating_rank"], first["diagnosis"]["failure_class"]) == (CULPRIT, "python_exception")
    assert (tmp_path / "attempt_0" / "report.json").exists() and (tmp_path / "attempt_1" / "report.json").exists()


def _torchrun_root_cause(stderr: str) -> int:
    m = re.search(r"Root Cause \(first observed failure\):\n\[0\]:\n(?:.*\n){2}\s+rank\s+: (\d+)", stderr)
    assert m, stderr[-3000:]
    return int(m.group(1))


@pytest.mark.parametrize("inject", ["exception-after-cleanup", "hang"])
def test_plain_torchrun_blames_a_waiting_rank_where_we_do_not(tmp_path, inject):
    """The two cases of TORCHELASTIC_NOTES.md where torchrun names a rank that was only waiting."""
    plain = launch(plain_torchrun(*COMMON, *script_args(inject)), tmp_path / "plain")
    assert plain.returncode == 1
    torchrun_says = _torchrun_root_cause(plain.stderr)
    diag = launch(torchrun_diag(*COMMON, "--diag-dir", str(tmp_path / "diag"), *script_args(inject)), tmp_path / "diag")
    assert torchrun_says != CULPRIT, f"plain torchrun named the culprit {CULPRIT} this time"
    assert diag.report["diagnosis"]["initiating_rank"] == CULPRIT
    assert _torchrun_root_cause(diag.stderr) == CULPRIT
