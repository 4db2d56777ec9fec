"""What the launcher gives the schedulers around it (issue 15), tested in this process: the requeue
decision and its exit status, the Kubernetes termination message, the Slurm-aware defaults (diag dir,
node name), and the bad values of their settings. The real Slurm runs are in test_slurm.py."""

from __future__ import annotations

import pytest
from helpers import EXAMPLE
from test_cli import in_process

from elastic_diag.config import DiagConfig, default_diag_dir, host_name, parse_requeue_exit_code
from elastic_diag.errors import UsageError
from elastic_diag.report.termination import MAX_BYTES, termination_log_problem, termination_message


@pytest.mark.parametrize("raw", ["0", "256", "-1", "abc", "2", "3", "4"])
def test_a_requeue_code_out_of_range_names_the_setting(raw, capsys, monkeypatch, tmp_path):
    with pytest.raises(UsageError, match="ELASTIC_DIAG_REQUEUE_EXIT_CODE"):
        parse_requeue_exit_code(raw, "ELASTIC_DIAG_REQUEUE_EXIT_CODE")
    code, err = in_process(["--diag-dir", str(tmp_path), "--diag-requeue-exit-code", raw, str(EXAMPLE)], capsys,
                           monkeypatch)  # fmt: skip
    assert code == 2 and "--diag-requeue-exit-code" in err
    assert parse_requeue_exit_code("75") == 75 and parse_requeue_exit_code("off") is None


def test_the_default_diag_dir_inside_slurm(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    step = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0"}
    assert default_diag_dir(environ=step).name == "slurm-4242.0"  # every node of the step: the same name
    assert default_diag_dir(environ={**step, "SLURM_RESTART_COUNT": "2"}).name == "slurm-4242.0-r2"
    batch = default_diag_dir(environ={"SLURM_JOB_ID": "4242"}).name  # the batch script itself: unique
    assert batch.startswith("slurm-4242-") and batch != default_diag_dir(environ={"SLURM_JOB_ID": "4242"}).name
    assert not default_diag_dir(environ={}).name.startswith("slurm")
    assert default_diag_dir(environ={}).parent == tmp_path / "elastic_diag_runs"
    assert host_name({"SLURMD_NODENAME": "gpu-017"}) == "gpu-017" and host_name({}) != ""


def _report(**diagnosis):
    base = {"failure_class": "python_exception", "initiating_rank": 2, "initiating_node": "trainer-worker-1",
            "exception_type": "ValueError", "signature_id": "python-exception", "summary": "Rank 2 raised.",
            "fix": "Fix the code."}  # fmt: skip
    return {"status": "failed", "node": "trainer-worker-0", "diagnosis": {**base, **diagnosis}}


def test_the_termination_message():
    text = termination_message(_report(), "/diag/report.json")
    assert text.startswith("elastic_diag: job FAILED: initiating rank 2 on trainer-worker-1: python_exception "
                           "(ValueError, signature python-exception). Rank 2 raised.")  # fmt: skip
    assert text.endswith("Report: /diag/report.json")
    huge = termination_message(_report(summary="é" * 10_000), "/diag/report.json")  # two bytes a character
    assert len(huge.encode("utf-8")) <= MAX_BYTES and huge.endswith("Report: /diag/report.json") and " ..." in huge
    none = termination_message(_report(initiating_rank=None, suspected_rank=0), "/r.json")
    assert "no rank could be named" in none and "Suspected, not proven: rank 0" in none
    ok = termination_message({"status": "succeeded", "node": "n", "diagnosis": {}}, "/r.json")
    assert ok == "elastic_diag: job succeeded on n. Report: /r.json"


def test_an_unwritable_termination_log_is_said_and_the_run_goes_on(tmp_path, caplog):
    from elastic_diag.launch.setup import open_session

    assert termination_log_problem(tmp_path / "termination-log") is None
    assert "does not exist" in (termination_log_problem(tmp_path / "no" / "file") or "")
    assert "is a folder" in (termination_log_problem(tmp_path) or "")
    config = DiagConfig(diag_dir=tmp_path / "d", termination_log=tmp_path / "missing" / "termination-log")
    session, _ = open_session(config, run_id="r", logs_specs=None)
    assert session.termination_log is None
    assert any("ELASTIC_DIAG_TERMINATION_LOG" in n and "cannot be written" in n for n in session.notes)
    assert "cannot be written" in caplog.text
