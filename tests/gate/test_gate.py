"""The restart gate: policies (pure), controls (real subprocesses), settings, and real restarts."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
from helpers import EXAMPLE, launch, torchrun_diag

from elastic_diag.config import DiagConfig
from elastic_diag.errors import EXIT_OK, EXIT_RESTART_REFUSED, EXIT_USAGE, EXIT_VERIFY_FAILED, UsageError
from elastic_diag.gate import controls, policy
from elastic_diag.gate.controls import ControlContext
from elastic_diag.gate.policy import AttemptOutcome, Decision


def failure(attempt: int, cls: str = "python_exception", retryable: bool | None = False, ckpt: str | None = None,
            where: str = "train.py:10 in step") -> AttemptOutcome:  # fmt: skip
    return AttemptOutcome(attempt=attempt, failure_class=cls, signature_id=cls, exception_type="ValueError",
                          location=where, retryable=retryable, checkpoint=ckpt)  # fmt: skip


def test_verified_policy():
    v = policy.verified
    assert v([failure(0)]).restart  # one retry for a failure not known to be retryable
    assert not v([failure(0), failure(1)]).restart  # the same failure again, no checkpoint progress
    assert "did not advance" in v([failure(0, ckpt="a"), failure(1, ckpt="a")]).reason
    assert v([failure(0, ckpt="a"), failure(1, ckpt="b")]).restart  # the same, but the checkpoint advanced
    assert not v([failure(0), failure(1, where="train.py:99 in eval")]).restart  # a second non-retryable one
    assert v([failure(0, cls="killed", retryable=True), failure(1, cls="network_error", retryable=True)]).restart
    desync = v([failure(0, cls="collective_desync")])
    assert not desync.restart and "deterministic" in desync.reason
    assert not policy.never([failure(0)]).restart
    # the initiating rank's own ConnectionError beats a schedule inference, and keeps restarting
    own = AttemptOutcome(attempt=0, failure_class="collective_desync", exception_type="ConnectionError",
                         own_retryable=True)  # fmt: skip
    assert v([own]).restart and "own exception is retryable" in v([own]).reason
    assert v(
        [
            failure(0, retryable=True),
            AttemptOutcome(attempt=1, failure_class="python_exception", own_retryable=True, location="loader.py:3"),
        ]
    ).restart
    assert policy.always([failure(0), failure(1)]) == Decision(True, policy.always([]).reason, verify=False)


def test_policies_from_a_module_and_bad_ones(tmp_path, monkeypatch):
    (tmp_path / "my_policy.py").write_text(
        "from elastic_diag.gate.policy import Decision\n"
        "def only_twice(history):\n"
        "    return Decision(len(history) < 2, f'{len(history)} failure(s) so far')\n"
        "def broken(history):\n"
        "    raise RuntimeError('boom')\n"
        "NOT_CALLABLE = 3\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    only_twice = policy.load_policy("my_policy:only_twice")
    assert policy.ask_policy(only_twice, [failure(0)]).restart
    assert not policy.ask_policy(only_twice, [failure(0), failure(1)]).restart
    refused = policy.ask_policy(policy.load_policy("my_policy:broken"), [failure(0)])
    assert not refused.restart and "RuntimeError: boom" in refused.reason
    assert not policy.ask_policy(lambda h: "yes", [failure(0)]).restart  # type: ignore[arg-type,return-value]
    for bad, words in [("no_such_module_xyz:f", "cannot import"), ("my_policy:missing", "no attribute"),
                       ("my_policy:NOT_CALLABLE", "not callable"), ("sometimes", "expected never")]:  # fmt: skip
        with pytest.raises(UsageError, match=words):
            policy.load_policy(bad)


def ctx(tmp_path: Path, **kw) -> ControlContext:
    return ControlContext(nproc=2, out_dir=tmp_path, **{"timeout_s": 30.0, "retries": 0, **kw})


def test_a_command_control_that_hangs_is_bounded_and_one_not_found_is_clear(tmp_path):
    t0 = time.monotonic()
    hung = controls.run_control("sleep 60", ctx(tmp_path, timeout_s=1.0, retries=3))
    assert not hung.passed and "did not finish within 1 s" in hung.summary
    assert time.monotonic() - t0 < 5  # retries stop at the deadline
    missing = controls.run_control("no-such-command-xyz --check", ctx(tmp_path))
    assert not missing.passed and "not found" in missing.summary
    flaky = tmp_path / "flaky.sh"
    flaky.write_text(f"test -e {tmp_path}/second || {{ touch {tmp_path}/second; exit 1; }}\necho ok\n")
    retried = controls.run_control(f"sh {flaky}", ctx(tmp_path, retries=2))
    assert retried.passed and retried.tries == 2


def test_checkpoint_and_disk_controls(tmp_path):
    import torch

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    assert not controls.run_control("checkpoint", ctx(tmp_path, checkpoint_dir=ckpt)).passed  # empty folder
    torch.save({"w": torch.ones(3)}, ckpt / "step_10.pt")
    time.sleep(0.01)
    (ckpt / "step_20.pt").write_bytes(b"")  # a partial write, the newest
    bad = controls.run_control("checkpoint", ctx(tmp_path, checkpoint_dir=ckpt))
    assert not bad.passed and "empty" in bad.summary
    (ckpt / "step_20.pt").write_bytes(b"garbage, not a torch.save file")
    assert not controls.run_control("checkpoint", ctx(tmp_path, checkpoint_dir=ckpt)).passed
    torch.save({"w": torch.ones(3)}, ckpt / "step_20.pt")
    good = controls.run_control("checkpoint", ctx(tmp_path, checkpoint_dir=ckpt))
    assert good.passed, good.output
    assert controls.run_control("disk", ctx(tmp_path, checkpoint_dir=ckpt)).passed


def test_the_collective_control_runs_real_ranks(tmp_path):
    result = controls.run_control("collective", ctx(tmp_path, timeout_s=60.0))
    assert result.passed, result.output
    assert "rank 1: all_reduce and barrier ok" in result.output


def test_the_signature_control_needs_the_signature_absent(tmp_path):
    c = ctx(tmp_path, signature_patterns=("injected failure",))
    present = controls.verify([f"{sys.executable} -c \"print('ValueError: injected failure')\"", "signature"], c)
    assert [r.passed for r in present] == [True, False]
    absent = controls.verify([f"{sys.executable} -c \"print('fine')\"", "signature"], c)
    assert all(r.passed for r in absent)


def test_settings_from_a_toml_table_lose_to_env_and_command_line(tmp_path, monkeypatch):
    cfg = tmp_path / "job.toml"
    cfg.write_text('[tool.elastic_diag]\nrestart_policy = "never"\nverify = ["disk", "true"]\ngrace = 7\n'
                   'verify_timeout = 30\n')  # fmt: skip
    c = DiagConfig.resolve(config_file=str(cfg))
    assert (c.restart_policy, c.verify, c.grace_s, c.verify_timeout_s) == ("never", ("disk", "true"), 7.0, 30.0)
    monkeypatch.setenv("ELASTIC_DIAG_RESTART_POLICY", "always")
    assert DiagConfig.resolve(config_file=str(cfg)).restart_policy == "always"
    assert DiagConfig.resolve(config_file=str(cfg), restart_policy="verified").restart_policy == "verified"
    cfg.write_text("[tool.elastic_diag]\nrestart_polcy = 'never'\n")
    with pytest.raises(UsageError, match="unknown"):
        DiagConfig.resolve(config_file=str(cfg))
    with pytest.raises(UsageError, match="does not exist"):
        DiagConfig.resolve(config_file=str(tmp_path / "missing.toml"))


# -- real restarts: 2 CPU ranks on gloo, the culprit is rank 1 ----------------------------------------

COMMON = ["--standalone", "--nproc-per-node", "2"]


def script(inject: str) -> list[str]:
    return [str(EXAMPLE), "--inject", inject, "--culprit-rank", "1", "--steps", "6", "--pg-timeout", "20"]


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_transient_failure_is_verified_then_restarted(tmp_path):
    run = launch(torchrun_diag(*COMMON, "--max-restarts", "3", "--diag-dir", str(tmp_path), *script("transient")),
                 tmp_path, timeout=200)  # fmt: skip
    assert run.returncode == EXIT_OK, run.stderr[-3000:]
    rep = run.report
    assert rep["status"] == "succeeded" and len(rep["attempts"]) == 2
    g = rep["attempts"][0]["gate"]
    assert g["decision"] == "restart" and [c["name"] for c in g["controls"]] == ["collective"]
    assert all(c["passed"] for c in g["controls"])
    assert Path(g["controls"][0]["output_file"]).read_text().count("all_reduce and barrier ok") == 2
    assert rep["diagnosis"]["failure_class"] == "healthy"
    first = rep["attempts"][0]["diagnosis"]
    assert (first["initiating_rank"], first["failure_class"]) == (1, "python_exception")
    assert (tmp_path / "attempt_0" / "report.json").exists() and (tmp_path / "attempt_1" / "report.json").exists()
    code, v, out = run.verify()  # the run succeeded (after the restart): nothing left to verify
    assert code == 0 and "nothing to verify" in v["summary"], out
    # the resumed attempt was told it is one, and what failed before
    assert rep["attempts"][1]["came_up"] is True


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_deterministic_exception_is_not_restarted_into_again(tmp_path):
    run = launch(torchrun_diag(*COMMON, "--max-restarts", "3", "--diag-dir", str(tmp_path), "--diag-verify", "true",
                               *script("exception")), tmp_path, timeout=200)  # fmt: skip
    assert run.returncode == EXIT_RESTART_REFUSED, run.stderr[-3000:]
    rep = run.report
    assert len(rep["attempts"]) == 2  # one retry for a failure not known to be retryable, then no more
    assert rep["attempts"][0]["gate"]["decision"] == "restart"
    last = rep["attempts"][1]["gate"]
    assert last["decision"] == "refused" and "same failure as attempt 0" in last["reason"]
    assert "restart gate: no restart" in run.stderr
    assert rep["diagnosis"]["initiating_rank"] == 1


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_failing_control_stops_the_restart_and_its_output_is_kept(tmp_path):
    check = f"{sys.executable} -c \"import sys; print('checkpoint step_40 is corrupt'); sys.exit(3)\""
    run = launch(torchrun_diag(*COMMON, "--max-restarts", "2", "--diag-dir", str(tmp_path), "--diag-verify", check,
                               "--diag-verify-retries", "0", *script("transient")), tmp_path, timeout=200)  # fmt: skip
    assert run.returncode == EXIT_VERIFY_FAILED, run.stderr[-3000:]
    rep = run.report
    assert len(rep["attempts"]) == 1
    g = rep["attempts"][0]["gate"]
    assert g["decision"] == "refused" and g["verification_failed"]
    assert "checkpoint step_40 is corrupt" in g["controls"][0]["output_tail"]
    assert "exit status 3" in g["reason"]


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_user_policy_from_a_module_decides(tmp_path):
    (tmp_path / "pol.py").write_text(
        "from elastic_diag.gate.policy import Decision\n"
        "def no_python_errors(history):\n"
        "    last = history[-1]\n"
        "    return Decision(last.failure_class != 'python_exception', f'policy saw {last.describe()}')\n"
    )
    diag = tmp_path / "d"
    run = launch(torchrun_diag(*COMMON, "--max-restarts", "3", "--diag-dir", str(diag), "--diag-restart-policy",
                               "pol:no_python_errors", *script("transient")), diag, timeout=200,
                 env={"PYTHONPATH": str(tmp_path)})  # fmt: skip
    assert run.returncode == EXIT_RESTART_REFUSED, run.stderr[-3000:]
    g = run.report["attempts"][0]["gate"]
    assert g["policy"] == "pol:no_python_errors" and g["reason"].startswith("policy saw python_exception")


def test_a_policy_that_does_not_import_is_a_usage_error_before_any_worker(tmp_path):
    run = launch(torchrun_diag(*COMMON, "--diag-dir", str(tmp_path), "--diag-restart-policy", "nope_xyz:f",
                               *script("none")), tmp_path, timeout=60)  # fmt: skip
    assert run.returncode == EXIT_USAGE
    assert "cannot import 'nope_xyz'" in run.stderr
    assert not (tmp_path / "attempt_0").exists()


def test_report_json_of_the_gate_is_plain_json(tmp_path):
    r = controls.run_control("disk", ctx(tmp_path))
    record = json.loads(json.dumps(r.to_json("x.log")))
    assert record["name"] == "disk" and record["output_file"] == "x.log" and isinstance(record["passed"], bool)


NEVER_COMES_UP = """
import os, sys
from datetime import timedelta
import torch, torch.distributed as dist
if os.environ["TORCHELASTIC_RESTART_COUNT"] != "0" and os.environ["RANK"] == "1":
    # the restart dies before its process group exists, as when torch's shared rendezvous store hands
    # it the previous round's keys (gloo connectFullMesh) or a node lost its mount
    raise RuntimeError("Gloo connectFullMesh failed with [pair.cc:446] stale address of rank 0")
dist.init_process_group("gloo", timeout=timedelta(seconds=20))
t = torch.ones(1)
dist.all_reduce(t)
if dist.get_rank() == 1:
    raise ValueError("bad batch at step 0")
dist.barrier()
"""


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_restart_that_never_came_up_is_told_apart_from_the_jobs_failure(tmp_path):
    """Attempt 0 completes a collective, then rank 1 raises; the restart dies before any collective.
    The report says the restart failed, and attempt 0 keeps the job's own failure. (On torch 2.13 with
    the shared rendezvous store, a gloo restart dies this way by itself, in a race: the launcher turns
    the sharing off, docs/how-it-works.md.)"""
    job = tmp_path / "job.py"
    job.write_text(NEVER_COMES_UP)
    diag = tmp_path / "diag"
    run = launch(torchrun_diag(*COMMON, "--max-restarts", "1", "--diag-restart-policy", "always", "--diag-dir",
                               str(diag), str(job)), diag, timeout=100)  # fmt: skip
    rep = run.report
    assert [a["came_up"] for a in rep["attempts"]] == [True, False]
    assert rep["attempts"][0]["diagnosis"]["initiating_rank"] == 1
    assert rep["attempts"][0]["diagnosis"]["exception_type"] == "ValueError"
    assert rep["status"] == "failed" and run.returncode == 1
    assert "attempt 1 never came up" in run.stderr and "the RESTART failed, not the job" in run.stderr
    page = (diag / "report.html").read_text()
    assert "never came up" in page and "Attempt 0" in page and "Attempt 1" in page
