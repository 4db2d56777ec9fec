"""The config flag for existing jobs (plain torchrun --rdzv-backend diag+c10d, PET_RDZV_BACKEND) and
the Python API: the same verdict as torchrun-diag on the same failure."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import pytest
from helpers import COMPARED, EXAMPLE, ROOT, kill_leftovers, launch, plain_torchrun, script_args

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(200)]

# the fault matrix's case, culprit rank 2, its cleanup outlasting the collective timeout; grace 10 s
SCRIPT = [*script_args("exception-after-cleanup"), *COMPARED["exception-after-cleanup"][0]]
GRACE = {"ELASTIC_DIAG_GRACE": "10"}
TORCHRUN_DIAG_SAYS = ("python_exception", 2, "ValueError", "python-exception")
NODE = ["--nnodes", "1", "--nproc-per-node", "3", "--rdzv-endpoint", "127.0.0.1:0"]


def verdict(report: dict) -> tuple:
    d = report["diagnosis"]
    return d["failure_class"], d["initiating_rank"], d["exception_type"], d["signature_id"]


def test_plain_torchrun_with_the_diag_backend_gives_the_same_verdict(tmp_path):
    """The failure and command line of test_launcher_matrix's exception-after-cleanup case, where
    torchrun-diag's verdict is asserted to be TORCHRUN_DIAG_SAYS (not run twice, to keep the suite short)."""
    plain = launch(plain_torchrun(*NODE, "--rdzv-backend", "diag+c10d", *SCRIPT), tmp_path,
                   env={"ELASTIC_DIAG_DIR": str(tmp_path), **GRACE})  # fmt: skip
    assert verdict(plain.report) == TORCHRUN_DIAG_SAYS
    assert plain.returncode == 1
    assert "elastic_diag: job FAILED: initiating rank 2" in plain.stderr
    assert "started by torchrun --rdzv-backend diag+c10d" in plain.report["notes"][0]
    # torchrun's own "Root Cause" names the initiating rank too (a waiting rank without elastic_diag)
    root = plain.stderr[plain.stderr.index("Root Cause") :]
    assert "rank      : 2" in root[:600], root[:600]


def test_the_switch_under_torchrun_standalone_gives_the_same_verdict(tmp_path):
    """ELASTIC_DIAG=1 with torchrun's own backends: --standalone (which forces c10d) names what
    torchrun-diag names on the same failure, and the backend keeps its name (torch's branches on it
    behave as before)."""
    termination_log = tmp_path / "termination-log"  # what a pod's /dev/termination-log would get
    run = launch(plain_torchrun("--standalone", "--nproc-per-node", "3", *SCRIPT), tmp_path,
                 env={"ELASTIC_DIAG": "1", "ELASTIC_DIAG_DIR": str(tmp_path), **GRACE,
                      "ELASTIC_DIAG_TERMINATION_LOG": str(termination_log)})  # fmt: skip
    assert verdict(run.report) == TORCHRUN_DIAG_SAYS
    assert run.returncode == 1 and "elastic_diag: job FAILED: initiating rank 2" in run.stderr
    assert "started by ELASTIC_DIAG=1 (torchrun --rdzv-backend c10d)" in run.report["notes"][0]
    message = termination_log.read_text()
    assert message.startswith("elastic_diag: job FAILED: initiating rank 2 on ") and len(message.encode()) <= 4096
    assert "python_exception (ValueError, signature python-exception)" in message
    assert message.endswith(f"Report: {tmp_path / 'report.json'}")
    # the verification relaunches plain torchrun with the switch, its settings and a diag dir of its own
    relaunch = run.report["launch"]["relaunch"]
    assert (
        relaunch.startswith("ELASTIC_DIAG=1 ELASTIC_DIAG_GRACE=10 ")
        and f"ELASTIC_DIAG_DIR={tmp_path}.verify " in relaunch
    )
    assert (
        "/torchrun --standalone --nproc-per-node 3 --max-restarts 0 " in relaunch or "torch.distributed.run" in relaunch
    )
    v = run.assert_verify_reproduces()
    assert v["rerun_report"] == f"{tmp_path}.verify/report.json"


def test_the_switch_under_the_static_backend_and_not_under_an_invalid_value(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    static = ["--rdzv-backend", "static", "--master-addr", "127.0.0.1", "--master-port", str(port),
              "--nnodes", "1", "--node-rank", "0", "--nproc-per-node", "2"]  # fmt: skip
    failing = [*SCRIPT[:1], "--inject", "segfault", "--culprit-rank", "1", "--steps", "8"]
    # with a requeue code: a segfault is retryable, so plain torchrun leaves with it (Slurm's RequeueExit=)
    run = launch(plain_torchrun(*static, *failing), tmp_path / "on", env={"ELASTIC_DIAG": "1",
                 "ELASTIC_DIAG_DIR": str(tmp_path / "on"), "ELASTIC_DIAG_REQUEUE_EXIT_CODE": "75"})  # fmt: skip
    assert verdict(run.report)[:2] == ("segfault", 1)
    assert run.returncode == 75 and run.report["requeue"]["requeue"] is True, run.stderr[-2000:]
    assert "elastic_diag: exit 75 (ELASTIC_DIAG_REQUEUE_EXIT_CODE): segfault (segfault) is retryable" in run.stderr
    assert "started by ELASTIC_DIAG=1 (torchrun --rdzv-backend static)" in run.report["notes"][0]
    off = tmp_path / "invalid"
    plain = launch(plain_torchrun("--standalone", "--nproc-per-node", "2", *failing), off,
                   env={"ELASTIC_DIAG": "yes", "ELASTIC_DIAG_DIR": str(off)})  # fmt: skip
    assert plain.returncode == 1 and not (off / "report.json").exists()
    assert "ELASTIC_DIAG='yes' is not 1 or 0; diagnosis stays off" in plain.stderr


def test_the_switch_with_a_diag_dir_on_a_read_only_mount_runs_plain_torchrun_and_says_so(tmp_path):
    """Where the switch cannot work (here: the diag dir cannot be written), the job still runs, as
    plain torchrun would, and the launcher says why there is no diagnosis."""
    mount = tmp_path / "ro"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(mount)], capture_output=True,
                      check=False).returncode != 0:  # fmt: skip
        pytest.skip("cannot mount a read-only tmpfs here (needs root)")
    try:
        run = subprocess.run(plain_torchrun("--standalone", "--nproc-per-node", "2", *SCRIPT[:1], "--steps", "4"),
                             env={**os.environ, "OMP_NUM_THREADS": "1", "ELASTIC_DIAG": "1",
                                  "ELASTIC_DIAG_DIR": str(mount / "run")},
                             cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    finally:
        subprocess.run(["umount", str(mount)], check=False)
    assert run.returncode == 0, run.stderr[-3000:]  # the job ran and succeeded
    assert "is not writable (Read-only file system)" in run.stderr and "ELASTIC_DIAG_DIR" in run.stderr
    assert "the job runs WITHOUT diagnosis, as plain torchrun" in run.stderr


def test_the_switch_under_an_explicit_c10d_backend_that_beats_the_environment(tmp_path):
    """TorchTitan's run_train.sh passes --rdzv_backend c10d itself: the flag beats PET_RDZV_BACKEND (so
    diag+c10d there would be ignored), and the switch still turns the diagnosis on."""
    argv = plain_torchrun("--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", "--nnodes", "1",
                          "--nproc-per-node", "2", *SCRIPT[:1], "--inject", "segfault", "--culprit-rank", "1",
                          "--steps", "8")  # fmt: skip
    run = launch(argv, tmp_path, env={"ELASTIC_DIAG": "1", "PET_RDZV_BACKEND": "diag+c10d",
                                      "ELASTIC_DIAG_DIR": str(tmp_path)})  # fmt: skip
    assert verdict(run.report)[:2] == ("segfault", 1)
    assert "started by ELASTIC_DIAG=1 (torchrun --rdzv-backend c10d)" in run.report["notes"][0]


def test_the_backend_from_the_environment_as_with_every_torchrun_flag(tmp_path):
    run = launch(plain_torchrun(*NODE, *SCRIPT[:1], "--inject", "segfault", "--culprit-rank", "1"), tmp_path,
                 env={"PET_RDZV_BACKEND": "diag+c10d", "ELASTIC_DIAG_DIR": str(tmp_path)})  # fmt: skip
    assert verdict(run.report)[:2] == ("segfault", 1)


def test_the_python_api(tmp_path):
    code = f"""
import sys
from torch.distributed.launcher.api import LaunchConfig
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
import elastic_diag
from elastic_diag.config import DiagConfig
config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2, rdzv_backend="c10d",
                      rdzv_endpoint="127.0.0.1:0", max_restarts=0, monitor_interval=0.1)
try:
    elastic_diag.elastic_launch(config, sys.executable, DiagConfig(diag_dir={str(tmp_path)!r}))(
        "-u", {str(EXAMPLE)!r}, "--inject", "exit", "--culprit-rank", "1", "--steps", "5")
except ChildFailedError as e:
    print("ChildFailedError", e.get_first_failure()[0])
"""
    run = launch([sys.executable, "-c", code], tmp_path)
    assert "ChildFailedError 1" in run.stdout, run.stderr[-3000:]
    assert verdict(run.report)[:2] == ("silent_exit", 1)


def test_the_switch_values_and_the_wrapped_creators_keep_their_names(monkeypatch):
    from torch.distributed.elastic.rendezvous.api import rendezvous_handler_registry

    from elastic_diag.launch.rendezvous import WRAPPED, switch_setting, wrap_torch_backends

    assert [switch_setting({"ELASTIC_DIAG": v}) for v in ("1", " 1 ", "0", "")] == ["on", "on", "off", "off"]
    assert switch_setting({}) == "off" and switch_setting({"ELASTIC_DIAG": "2"}) == "invalid"
    table = rendezvous_handler_registry._registry
    before = {name: table[name] for name in WRAPPED}
    try:
        wrap_torch_backends()
        wrapped = {name: table[name] for name in WRAPPED}
        wrap_torch_backends()  # twice (the entry point and a second import): wrapped once
        assert {name: table[name] for name in WRAPPED} == wrapped
        assert all(getattr(c, "_elastic_diag_wrapped", False) for c in wrapped.values())
        assert set(WRAPPED) <= set(table)  # still registered under torch's own names
    finally:
        table.update(before)


def test_two_one_node_jobs_with_no_endpoint_do_not_join_each_other(tmp_path):
    """Without --rdzv-endpoint, torch's c10d binds localhost:29400 with run id "none": a second job on
    the host would join the first's rendezvous. diag+c10d gives each its own port and run id."""
    argv = plain_torchrun("--rdzv-backend", "diag+c10d", "--nnodes", "1", "--nproc-per-node", "2",
                          *SCRIPT[:1], "--steps", "12")  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen(argv, env={**env, "ELASTIC_DIAG_DIR": str(tmp_path / name)}, cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
             for name in ("a", "b")]  # fmt: skip
    try:
        outs = [p.communicate(timeout=150) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        for name in ("a", "b"):
            kill_leftovers(tmp_path / name)
    for p, (_out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    reports = [json.loads((tmp_path / name / "report.json").read_text()) for name in ("a", "b")]
    assert [r["status"] for r in reports] == ["succeeded", "succeeded"]
    assert [len(r["ranks"]) for r in reports] == [2, 2]  # each its own two ranks, not one job of four
    assert reports[0]["run_id"] != reports[1]["run_id"]
