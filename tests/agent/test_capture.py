"""AttemptCapture's decisions, with fake worker processes and a fake clock: the grace ends as soon as it
can, a rank still alive after it is asked for its stacks and not waited for longer, and torch's failure
list is corrected to name the initiating rank. No test here sleeps: the fake sleep moves the fake clock.
(ExitWatcher is tested on a real child process: what it relies on is the kernel's.)
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from elastic_diag.agent.capture import AttemptCapture
from elastic_diag.agent.processes import ExitWatcher, Worker
from elastic_diag.config import DiagConfig
from elastic_diag.layout import (
    DUMP_REQUEST_FILE,
    EXCEPTION_FILE,
    REPORT_FILE,
    ROOT_CAUSE_FILE,
    AttemptLayout,
    RankLayout,
    read_json,
)
from elastic_diag.report.session import DiagSession

T0 = 1_764_432_000.0
# pids above the kernel's pid_max: no signal the capture sends can reach a real process
NO_PID = int(Path("/proc/sys/kernel/pid_max").read_text()) + 100


class FakeClock:
    def __init__(self) -> None:
        self.t = T0
        self.slept = 0.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.t += seconds
        self.slept += seconds


class FakeProcess:
    """Exits with ``code`` once the fake clock reaches ``exits_at`` (never, when None)."""

    def __init__(self, pid: int, clock: FakeClock, exits_at: float | None, code: int = 1) -> None:
        self.pid, self._clock, self.exits_at, self.code = pid, clock, exits_at, code

    def poll(self) -> int | None:
        return self.code if self.exits_at is not None and self._clock() >= self.exits_at else None


def capture_of(tmp_path: Path, clock: FakeClock, exits: list[tuple[float | None, int]],
               grace_s: float = 5.0, stack_timeout_s: float = 1.0) -> AttemptCapture:  # fmt: skip
    config = DiagConfig(
        diag_dir=tmp_path, grace_s=grace_s, stack_timeout_s=stack_timeout_s, hang_timeout_s=0, stall_timeout_s=0
    )
    attempt = AttemptLayout(attempt=0, dir=tmp_path / "attempt_0")
    workers = []
    for rank, (exits_at, code) in enumerate(exits):
        layout = RankLayout(rank=rank, local_rank=rank, dir=attempt.dir / f"rank_{rank}")
        layout.dir.mkdir(parents=True)
        attempt.ranks[rank] = layout
        proc = FakeProcess(NO_PID + rank, clock, None if exits_at is None else T0 + exits_at, code)
        workers.append(Worker(rank=rank, local_rank=rank, proc=proc, layout=layout))
    capture = AttemptCapture(attempt=attempt, workers=workers, node="node-a", config=config,
                             session=DiagSession(config, run_id="unit"), clock=clock, monotonic=clock,
                             sleep=clock.sleep).start()  # fmt: skip
    return capture


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def stop_threads():
    captures: list[AttemptCapture] = []
    yield captures.append
    for c in captures:
        c.tailer.stop()


def test_the_grace_ends_as_soon_as_every_rank_has_exited(tmp_path, clock, stop_threads, monkeypatch):
    capture = capture_of(tmp_path, clock, [(0.0, -signal.SIGSEGV), (0.5, 1), (0.7, 1)])
    stop_threads(capture)

    def real_sleep(seconds: float) -> None:
        raise AssertionError(f"the capture slept {seconds} s on the real clock, not the injected one")

    monkeypatch.setattr(time, "sleep", real_sleep)
    assert capture.has_failure()
    diagnosis = capture.decide()
    assert 0.7 <= clock.slept < 0.8  # not the 5 s grace: every rank had exited
    assert capture.alive_at_decision == set() and capture.stacks == {}
    assert not any((tmp_path / "attempt_0" / f"rank_{r}" / DUMP_REQUEST_FILE).exists() for r in range(3))
    assert (diagnosis.initiating_rank, diagnosis.failure_class) == (0, "segfault")
    on_disk = read_json(tmp_path / "attempt_0" / REPORT_FILE)
    assert on_disk is not None and on_disk["diagnosis"]["initiating_rank"] == 0


def test_a_rank_alive_after_the_grace_is_asked_for_its_stacks_and_not_waited_for(tmp_path, clock, stop_threads):
    capture = capture_of(tmp_path, clock, [(0.0, 1), (None, 0), (0.2, 1)], grace_s=3.0, stack_timeout_s=1.0)
    stop_threads(capture)
    capture.decide()
    # the grace, the beacon's answer (none comes), faulthandler's signal (no stack comes): each bounded
    assert 3.0 <= clock.slept <= 3.0 + 1.0 + 1.0 + 0.1
    assert capture.alive_at_decision == {1}
    assert (tmp_path / "attempt_0" / "rank_1" / DUMP_REQUEST_FILE).exists()
    assert not (tmp_path / "attempt_0" / "rank_0" / DUMP_REQUEST_FILE).exists()
    ev = capture.evidence(final=False)
    assert [r.alive_at_decision for r in ev.ranks] == [False, True, False]


def test_a_rank_that_recorded_its_own_exception_is_not_waited_for(tmp_path, clock, stop_threads):
    """Its excepthook wrote exception.json: it is on its way out (cleanup can take seconds), so it counts
    as a failure already, and it is neither waited for nor interrupted for a stack dump."""
    capture = capture_of(tmp_path, clock, [(None, 0), (None, 0)], grace_s=5.0)
    stop_threads(capture)
    assert not capture.has_failure()
    record = {"type": "ValueError", "message": "bad shard", "traceback": "Traceback ...", "time": T0 - 1}
    (tmp_path / "attempt_0" / "rank_1" / EXCEPTION_FILE).write_text(json.dumps(record))
    assert capture.has_failure()
    clock.t += 0.1
    lost_peer = {"type": "RuntimeError", "message": "[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection "
                 "closed by peer [127.0.0.1]:29500", "traceback": "Traceback ...", "time": T0}  # fmt: skip
    (tmp_path / "attempt_0" / "rank_0" / EXCEPTION_FILE).write_text(json.dumps(lost_peer))
    diagnosis = capture.decide()
    assert clock.slept == 0.0 and capture.alive_at_decision == {0, 1} and capture.stacks == {}
    assert (diagnosis.initiating_rank, diagnosis.exception_type) == (1, "ValueError")


def test_ranks_torch_stopped_before_the_capture_decided_count_as_stopped(tmp_path, clock, stop_threads):
    """torch's monitor saw the failure first (no decide): the SIGTERM exits after the first failure are
    the launcher's teardown, not failures of their own."""
    capture = capture_of(tmp_path, clock, [(1.0, -signal.SIGTERM), (0.0, 1), (1.0, -signal.SIGTERM)])
    stop_threads(capture)
    capture.evidence(final=False)  # the first poll: rank 1 has exited
    clock.t += 1.0
    ev = capture.evidence(final=True)
    assert [r.stopped_by_agent for r in ev.ranks] == [True, False, True]


def test_finish_points_torchs_root_cause_at_the_initiating_rank(tmp_path, clock, stop_threads):
    capture = capture_of(tmp_path, clock, [(None, -signal.SIGTERM), (0.0, 1)], grace_s=1.0)
    stop_threads(capture)
    record = {"type": "ValueError", "message": "bad shard", "traceback": "Traceback ...\nValueError: bad shard",
              "time": T0 - 0.5}  # fmt: skip
    (tmp_path / "attempt_0" / "rank_1" / EXCEPTION_FILE).write_text(json.dumps(record))
    capture.decide()
    capture.workers[0].proc.exits_at = clock.t  # type: ignore[attr-defined]  (torch's teardown)
    failures = {r: ProcessFailure(local_rank=r, pid=NO_PID + r, exitcode=code, error_file=str(tmp_path / "none"))
                for r, code in ((0, -signal.SIGTERM), (1, 1))}  # fmt: skip
    result = capture.finish(RunResult(state=WorkerState.FAILED, failures=failures))
    first_rank, first = next(iter(result.failures.items()))
    assert first_rank == 1 and first.error_file == str(tmp_path / "attempt_0" / "rank_1" / ROOT_CAUSE_FILE)
    root = json.loads(Path(first.error_file).read_text())["message"]
    assert "rank 1 is the initiating rank (python_exception)" in root["extraInfo"]["py_callstack"]
    assert capture.session.report()["ranks"][0]["role"] == "stopped"


def test_exit_watcher_stamps_the_exit_with_the_injected_clock_and_does_not_reap(tmp_path):
    proc = subprocess.Popen(["sh", "-c", "exit 3"])
    watcher = ExitWatcher({0: proc.pid}, clock=lambda: 42.0).start()
    deadline = time.monotonic() + 10
    while watcher.time_of(0) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert watcher.time_of(0) == 42.0 and watcher.exited() == {0}
    assert proc.wait(timeout=5) == 3  # the status is still there for Popen (and torch) to read
