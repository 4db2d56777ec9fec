"""The health monitor: its thresholds with a fake clock, then on real runs: 3 CPU ranks on gloo, the
culprit is rank 2, the process-group timeout 5 minutes (far away), the hang timeout 3 s. Each live case
must name rank 2 with the right class and the culprit's source line, well before any collective times
out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import EXAMPLE, ROOT, launch, torchrun_diag

from elastic_diag.agent.dumps import find_py_spy
from elastic_diag.agent.health import AUTO_FLOOR_S, AUTO_START_S, STALL_FLOOR_S, STALL_START_S, HealthMonitor

live = pytest.mark.multiprocess  # with the suite's timeout raised to 150 s below

CULPRIT = 2
HANG_TIMEOUT = 3.0
COMMON = ["--standalone", "--nproc-per-node", "3", "--diag-hang-timeout", str(HANG_TIMEOUT)]
FSDP2 = ROOT / "examples" / "train_fsdp2.py"


def args(script: Path, inject: str, *extra: str) -> list[str]:
    return [str(script), "--inject", inject, "--culprit-rank", str(CULPRIT), "--pg-timeout", "300", *extra]


@live
@pytest.mark.timeout(150)
@pytest.mark.parametrize("inject, function", [("deadlock", "deadlocked_loader"), ("infinite-loop", "spin")])
def test_hang_outside_collectives_is_detected_before_the_collective_timeout(tmp_path, inject, function):
    mark = tmp_path / "mark"
    argv = torchrun_diag(*COMMON, "--diag-dir", str(tmp_path / "d"), *args(EXAMPLE, inject, "--mark-file", str(mark)))
    run = launch(argv, tmp_path / "d")
    d = run.report["diagnosis"]
    assert run.returncode == 1, run.stderr[-3000:]
    assert (d["failure_class"], d["initiating_rank"]) == ("hang", CULPRIT), d
    assert f"in {function}" in d["summary"]
    assert d["collateral_ranks"] == [0, 1]
    hang = run.report["attempts"][-1]["hang"]
    latency = hang["detected_at"] - float(mark.read_text())
    # the culprit stops at its injection; its peers block in their next collective within one step
    assert latency <= HANG_TIMEOUT + 2.0, latency
    assert run.seconds < 120  # the process-group timeout (300 s) never came into play
    stack = run.rank(CULPRIT)["stack"]
    assert stack and function in stack
    # every rank's flight recorder was pulled before the group was stopped
    for r in range(3):
        fr = json.loads((tmp_path / "d" / "attempt_0" / f"rank_{r}" / "fr_trace.json").read_text())
        assert fr["reason"] == "hang-request"
    run.assert_verify_reproduces()


@live
@pytest.mark.timeout(150)
@pytest.mark.parametrize("inject", ["skip-collective", "extra-collective", "unused-layer"])
def test_a_rank_that_leaves_the_collective_schedule_is_named(tmp_path, inject):
    run = launch(torchrun_diag(*COMMON, "--diag-dir", str(tmp_path), *args(EXAMPLE, inject)), tmp_path)
    d = run.report["diagnosis"]
    assert (d["failure_class"], d["initiating_rank"]) == ("collective_desync", CULPRIT), d
    assert d["signature_id"] == "collective-schedule-diverged"
    assert "train_ddp.py:" in d["summary"]  # the culprit's source line
    assert any(line.startswith("ranks 0, 1 were at") or line.startswith("rank 0:") for line in d["evidence"])
    if inject == "unused-layer":  # skip- and extra-collective: their verification runs in test_examples (FSDP2)
        run.assert_verify_reproduces()


@live
@pytest.mark.timeout(150)
def test_shape_mismatch_names_the_rank_and_both_sides(tmp_path):
    run = launch(torchrun_diag(*COMMON, "--diag-dir", str(tmp_path), *args(EXAMPLE, "shape-mismatch")), tmp_path)
    d = run.report["diagnosis"]
    assert (d["failure_class"], d["initiating_rank"]) == ("collective_mismatch", CULPRIT), d
    sides = d["collective"]["sides"]
    assert sides[str(CULPRIT)] == "all_reduce sizes [[2]] Float"
    assert {sides[str(r)] for r in (0, 1)} == {"all_reduce sizes [[1]] Float"}
    assert "train_ddp.py" in d["collective"]["source"][str(CULPRIT)]
    assert run.seconds < 120  # its verification runs in test_examples (FSDP2's shape-mismatch)


@live
@pytest.mark.timeout(150)
def test_fsdp2_nan_names_the_rank_whose_loss_went_non_finite_first(tmp_path):
    run = launch(torchrun_diag(*COMMON, "--diag-dir", str(tmp_path), *args(FSDP2, "nan")), tmp_path)
    d = run.report["diagnosis"]
    assert (d["failure_class"], d["initiating_rank"]) == ("nan_inf", CULPRIT), d
    assert "train_fsdp2.py" in d["summary"]
    # every rank raised the same error; the others are collateral
    assert d["collateral_ranks"] == [0, 1]
    # each rank raised on its own (some are SIGTERMed by the teardown while their interpreter exits)
    assert all("non-finite" in (run.rank(r)["exception"] or {}).get("message", "") for r in range(3))
    # its verification runs in test_examples (DDP's nan)


@live
@pytest.mark.timeout(150)
def test_a_straggler_is_a_warning_not_a_hang(tmp_path):
    run = launch(torchrun_diag(*COMMON, "--diag-dir", str(tmp_path), *args(EXAMPLE, "straggler")), tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    rep = run.report
    assert rep["status"] == "succeeded"
    assert "hang" not in rep["attempts"][-1]
    stragglers = [w for w in rep["warnings"] if w["class"] == "straggler"]
    assert [w["rank"] for w in stragglers] == [CULPRIT], rep["warnings"]
    assert "warning (straggler): rank 2" in run.stderr
    code, v, out = run.verify()
    assert code == 0 and "nothing to verify" in v["summary"], out


@live
@pytest.mark.timeout(150)
def test_a_slow_first_step_raises_nothing_with_the_automatic_threshold(tmp_path):
    argv = ["--standalone", "--nproc-per-node", "2", "--diag-dir", str(tmp_path), str(EXAMPLE), "--inject",
            "slow-first-step", "--straggle-seconds", "4", "--steps", "6"]  # fmt: skip
    run = launch(torchrun_diag(*argv), tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    rep = run.report
    assert rep["status"] == "succeeded" and rep["warnings"] == []
    assert "hang" not in rep["attempts"][-1]
    code, v, out = run.verify()
    assert code == 0 and "nothing to verify" in v["summary"], out


@live
@pytest.mark.timeout(150)
def test_a_rank_holding_the_gil_is_dumped_by_signal_and_the_missing_evidence_is_reported(tmp_path):
    """Catastrophic regex backtracking holds the GIL: the rank's beacon thread never runs, so its
    dump request is never answered. The faulthandler signal (C) still gives its stack, within the
    stack timeout, and the report says what is missing. The stall snapshot 1.5 s into the hang (the GIL held
    since before it) says the same, and stops nothing: the hang verdict at 3 s does."""
    argv = torchrun_diag(*COMMON, "--diag-stall-timeout", "1.5", "--diag-dir", str(tmp_path),
                         *args(EXAMPLE, "regex-hang"))  # fmt: skip
    run = launch(argv, tmp_path)
    d = run.report["diagnosis"]
    assert (d["failure_class"], d["initiating_rank"]) == ("hang", CULPRIT), d
    assert "faults.py" in d["summary"] and "in inject" in d["summary"]
    assert "re/__init__.py" in run.rank(CULPRIT)["stack"]
    assert any("rank 2: its beacon did not answer" in n for n in run.report["notes"]), run.report["notes"]
    assert run.seconds < 120
    if find_py_spy() is not None:  # native frames too (py-spy is in the test extra)
        native = (tmp_path / "attempt_0" / f"rank_{CULPRIT}" / "pyspy.txt").read_text()
        assert "sre" in native.lower() or "match" in native, native[:2000]
    (stall,) = run.report["attempts"][-1]["stalls"]
    assert stall["outside"] == [CULPRIT] and stall["waiting"] == [0, 1] and stall["outcome"] == "failed", stall
    culprit = next(r for r in stall["ranks"] if r["rank"] == CULPRIT)
    assert culprit["beacon"] is False and "in inject_now" in (culprit["where"] or ""), culprit
    at_stall = tmp_path / "attempt_0" / "stall_1" / f"rank_{CULPRIT}"
    assert "re/__init__.py" in (at_stall / "stacks.txt").read_text()
    assert any(line.startswith("elastic_diag stall snapshot") for line in d["evidence"]), d["evidence"]
    run.assert_verify_reproduces()


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def write(path: Path, **data) -> None:
    base = {"steps": 0, "backward": 0, "heartbeats": 0, "watch": None, "pg_status": {}, "step_durations": []}
    path.write_text(json.dumps({**base, **data}))


def test_fixed_threshold_fires_only_when_no_rank_progresses(tmp_path: Path):
    clock = Clock()
    files = {r: tmp_path / f"p{r}.json" for r in range(2)}
    mon = HealthMonitor(files, 5.0, clock=clock, wall=clock)
    waiting = {"0": {"last_enqueued_collective": "5", "last_completed_collective": "4"}}
    for r in files:
        write(files[r], steps=1, pg_status=waiting if r == 1 else {})  # rank 1 waits in a collective
    assert mon.check() is None
    clock.t += 4
    write(files[0], steps=2)  # rank 0 progresses: no alarm
    assert mon.check() is None
    clock.t += 4.9
    assert mon.check() is None
    clock.t += 0.2
    alarm = mon.check()
    assert alarm is not None and alarm.stalled_s == pytest.approx(5.1) and alarm.reason == "--diag-hang-timeout"


def test_automatic_threshold_grows_with_the_step_time_and_waits_for_warmup(tmp_path: Path):
    clock = Clock()
    f = {0: tmp_path / "p.json"}
    mon = HealthMonitor(f, None, clock=clock, wall=clock)
    write(f[0], steps=1, step_durations=[])
    mon.check()
    assert mon.threshold() == AUTO_START_S  # before warm-up: slow first steps raise nothing
    write(f[0], steps=10, step_durations=[0.5] * 9)
    mon.check()
    assert mon.threshold() == AUTO_FLOOR_S
    write(f[0], steps=20, step_durations=[30.0] * 19)
    mon.check()
    assert mon.threshold() == 300.0


def test_no_rank_waiting_in_a_collective_or_only_exited_ranks_is_never_a_hang(tmp_path: Path):
    """Every rank busy outside collectives (a long checkpoint save, an evaluation) is not a hang; nor are
    ranks whose process already exited (the end of a healthy run)."""
    clock = Clock()
    files = {r: tmp_path / f"q{r}.json" for r in range(2)}
    exited: set[int] = set()
    mon = HealthMonitor(files, 5.0, clock=clock, wall=clock, exited=lambda: exited)
    for r in files:
        write(files[r], steps=3)
    mon.check()
    clock.t += 60
    assert mon.check() is None
    waiting = {"0": {"last_enqueued_collective": "9", "last_completed_collective": "8"}}
    write(files[1], steps=3, pg_status=waiting)
    exited.update({0, 1})
    clock.t += 60
    assert mon.check() is None
    exited.discard(1)
    clock.t += 10
    assert mon.check() is not None


def test_no_training_activity_is_never_a_hang(tmp_path: Path):
    clock = Clock()
    f = {0: tmp_path / "p.json"}
    mon = HealthMonitor(f, 1.0, clock=clock, wall=clock)
    write(f[0])  # a script with no process group, no optimizer, no heartbeat
    mon.check()
    clock.t += 3600
    assert mon.check() is None
    (f[0]).write_text("{garbled")
    assert mon.check() is None


def test_a_watch_past_its_timeout_names_its_rank(tmp_path: Path):
    clock = Clock()
    files = {r: tmp_path / f"p{r}.json" for r in range(2)}
    mon = HealthMonitor(files, 600.0, clock=clock, wall=clock)
    write(files[0], heartbeats=1)
    write(files[1], heartbeats=1, watch=["eval", clock.t, 2.0])
    assert mon.check() is None
    clock.t += 2.5
    alarm = mon.check()
    assert alarm is not None and alarm.rank == 1 and "watch('eval')" in alarm.reason


def test_the_public_api_is_a_no_op_outside_elastic_diag(tmp_path, monkeypatch):
    """A script that calls heartbeat() and watch() runs unchanged without elastic_diag's launcher: no
    beacon starts, nothing is written."""
    import elastic_diag
    from elastic_diag.worker import beacon

    monkeypatch.chdir(tmp_path)
    assert beacon.current() is None
    elastic_diag.heartbeat()
    with elastic_diag.watch("step", timeout=1.0):
        ran = True
    assert ran and beacon.current() is None and list(tmp_path.iterdir()) == []


# -- stalls: the same condition, held for a shorter time; nothing is stopped --------------------------------
WAITING = {"0": {"last_enqueued_collective": "9", "last_completed_collective": "8"}}


def stall_monitor(tmp_path: Path, clock: Clock, hang: float | None = 60.0, stall: float | None = 5.0,
                  ranks: int = 3) -> tuple[HealthMonitor, dict[int, Path], list, list]:  # fmt: skip
    files = {r: tmp_path / f"s{r}.json" for r in range(ranks)}
    started: list = []
    ended: list = []
    mon = HealthMonitor(files, hang, clock=clock, wall=clock, stall_timeout_s=stall, on_stall=started.append,
                        on_stall_end=ended.append)  # fmt: skip
    return mon, files, started, ended


def test_a_stall_is_recorded_once_with_who_waits_and_who_holds_them_and_ends_when_progress_resumes(tmp_path):
    clock = Clock()
    mon, files, started, ended = stall_monitor(tmp_path, clock)
    for r in files:  # rank 0 saves a checkpoint (no collective), ranks 1 and 2 wait in the barrier after it
        write(files[r], steps=4, pg_status=WAITING if r else {})
    assert mon.check() is None
    clock.t += 4.9
    assert mon.check() is None and started == []
    clock.t += 0.2
    assert mon.check() is None  # a stall, not a hang: nothing to stop
    assert len(started) == 1
    stall = started[0]
    assert (stall.number, stall.outside, stall.waiting, stall.snapshot) == (1, (0,), (1, 2), True)
    assert stall.since == 1000.0 and stall.stalled_s == pytest.approx(5.1) and stall.threshold_s == 5.0
    for _ in range(5):  # the same stall, seen again and again: one record
        clock.t += 1
        mon.check()
    assert len(started) == 1 and ended == []
    write(files[0], steps=5)  # the save is over: rank 0 steps again
    clock.t += 1
    mon.check()
    assert ended == [stall] and stall.ended_at == clock.t and stall.duration_s == pytest.approx(11.1)
    assert mon.stall is None and mon.stalls == [stall]


def test_at_most_one_snapshot_a_minute_and_every_stall_recorded(tmp_path):
    clock = Clock()
    mon, files, started, _ = stall_monitor(tmp_path, clock)
    steps = 4
    for when in (0.0, 20.0, 70.0):  # three stalls: the second within a minute of the first snapshot
        clock.t = 1000.0 + when
        steps += 1
        for r in files:
            write(files[r], steps=steps, pg_status=WAITING if r else {})
        mon.check()
        clock.t += 6
        mon.check()
    assert [s.snapshot for s in started] == [True, False, True]
    assert [s.number for s in started] == [1, 2, 3]


def test_a_late_monitor_records_one_stall_and_stops_nothing(tmp_path):
    """The agent starved of CPU (the job saturates both cores): its checks come seconds late. The stall
    is still recorded once, with how long it had lasted, and no alarm is raised below the hang threshold."""
    clock = Clock()
    mon, files, started, _ = stall_monitor(tmp_path, clock, hang=60.0)
    for r in files:
        write(files[r], steps=4, pg_status=WAITING if r else {})
    mon.check()
    clock.t += 25  # the next check, 25 s later
    assert mon.check() is None
    clock.t += 25
    assert mon.check() is None
    assert len(started) == 1 and started[0].stalled_s == pytest.approx(25.0)
    clock.t += 11
    alarm = mon.check()  # the configured hang threshold still decides when the group is stopped
    assert alarm is not None and alarm.threshold_s == 60.0


def test_the_automatic_stall_threshold(tmp_path):
    clock = Clock()
    mon, files, _, _ = stall_monitor(tmp_path, clock, hang=None, stall=None, ranks=1)
    write(files[0], steps=2, step_durations=[0.1])
    mon.check()
    assert mon.stall_threshold() == STALL_START_S  # before the warm-up (a slow first step is no stall)
    write(files[0], steps=3, step_durations=[0.1, 0.1])
    mon.check()
    assert mon.stall_threshold() == STALL_FLOOR_S and mon.threshold() == AUTO_START_S  # 3 steps seen: a stall's
    write(files[0], steps=10, step_durations=[0.1] * 9)
    mon.check()
    assert mon.stall_threshold() == STALL_FLOOR_S
    write(files[0], steps=20, step_durations=[4.0] * 19)
    mon.check()
    assert mon.stall_threshold() == 12.0 and mon.threshold() == 60.0


@pytest.mark.parametrize("hang, stall, expect", [(3.0, None, 0), (5.0, 5.0, 0), (60.0, 0, 0), (0, 5.0, 1)])
def test_no_stall_at_or_above_the_hang_threshold_or_when_off(tmp_path, hang, stall, expect):
    """The hang verdict takes its own evidence when it comes first; `--diag-stall-timeout off` records none;
    `--diag-hang-timeout off` keeps the stall snapshots and never stops the group."""
    clock = Clock()
    mon, files, started, _ = stall_monitor(tmp_path, clock, hang=hang, stall=stall)
    for r in files:
        write(files[r], steps=4, pg_status=WAITING if r else {})
    mon.check()
    clock.t += 3600
    alarm = mon.check()
    assert len(started) == expect
    assert (alarm is None) == (hang == 0)


def test_every_rank_busy_outside_collectives_is_no_stall(tmp_path):
    clock = Clock()
    mon, files, started, _ = stall_monitor(tmp_path, clock)
    for r in files:  # a final evaluation on every rank, no collective
        write(files[r], steps=4)
    mon.check()
    clock.t += 100
    mon.check()
    assert started == []
