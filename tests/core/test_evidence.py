"""The evidence model (core/evidence.py): when a rank's own failure began, which error line it printed is
its own, where its code was, and what an attempt knows of its launchers. Pure."""

from __future__ import annotations

from elastic_diag.core.evidence import AttemptEvidence, ErrorLine, LauncherExit, LogLine, RankEvidence
from elastic_diag.core.exceptions import ExceptionRecord
from elastic_diag.core.progress import KernelEvidence, Progress
from elastic_diag.core.stall import StallRank, StallRecord

SEGV = """Fatal Python error: Segmentation fault

Current thread 0x00007f (most recent call first):
  File "/job/ops.py", line 12 in kernel
  File "/job/train.py", line 50 in main
"""


def rank(**kw: object) -> RankEvidence:
    return RankEvidence(rank=1, local_rank=1, node="a", **kw)  # type: ignore[arg-type]


def test_the_printed_error_is_its_own_until_it_recovers_or_dies_of_another():
    printed = ErrorLine(time=10.0, text="Traceback", exception=ExceptionRecord("ValueError", "x", ""))
    assert rank(error_line=printed).own_error_line() is printed
    recovered = rank(error_line=printed, progress=Progress(progress_time=12.0))  # progressed 2 s after it
    assert recovered.own_error_line() is None
    other = rank(error_line=printed, exception=ExceptionRecord("KeyError", "k", ""))
    assert other.own_error_line() is None  # it died of something else
    chained = rank(error_line=printed, exception=ExceptionRecord("RuntimeError", "closed", "",
                                                                  chain=(("builtins.ValueError", "x"),)))  # fmt: skip
    assert chained.own_error_line() is printed  # the cleanup's error was raised while handling it


def test_its_failure_began_at_the_earliest_of_its_own_records():
    ev = rank(exit_code=1, exit_time=20.0, exception=ExceptionRecord("ValueError", "x", "", time=15.0),
              error_line=ErrorLine(time=11.0, text="ValueError: x"))  # fmt: skip
    assert ev.first_error_time == 11.0 and ev.failed and ev.signal is None
    assert rank(exit_code=-9).signal == "SIGKILL"


def test_where_it_was_from_its_traceback_its_stack_or_a_dump_in_its_stderr():
    assert rank(stderr_tail=tuple(SEGV.splitlines())).location() == "/job/ops.py:12 in kernel"
    tb = 'Traceback (most recent call last):\n  File "/job/data.py", line 3, in load\nKeyError: 1'
    assert rank(exception=ExceptionRecord("KeyError", "1", tb)).location() == "/job/data.py:3 in load"
    assert rank().location() is None


def test_its_lines_for_the_rules():
    oom = KernelEvidence(proven=True, line="Out of memory: Killed process 7")
    ev = rank(exception=ExceptionRecord("ValueError", "x", ""), lines=(LogLine(text="NCCL WARN boom"),),
              stderr_tail=("tail",), kernel=oom)  # fmt: skip
    assert ev.texts() == ["Out of memory: Killed process 7", "ValueError: x", "NCCL WARN boom"]
    # a record with no lines of the front-end's (another node's, one built by hand): its tails
    assert rank(stderr_tail=("err",), stdout_tail=("out",)).texts() == ["err", "out"]


def test_an_attempt_knows_when_its_failure_began_and_the_stall_it_came_out_of():
    stall = StallRecord(number=1, node="a", since=5.0, detected_at=8.0, threshold_s=3.0,
                        ranks=(StallRank(rank=1, local_rank=1, in_collective=False),))  # fmt: skip
    over = StallRecord(number=0, node="a", since=1.0, detected_at=2.0, threshold_s=1.0, ranks=(), ended_at=3.0)
    stopped = RankEvidence(rank=2, local_rank=2, node="a", exit_code=-15, exit_time=9.0, stopped_by_agent=True)
    attempt = AttemptEvidence(attempt=0, ranks=(rank(exit_code=1, exit_time=12.0), stopped), stalls=(over, stall))
    assert attempt.failure_began == 12.0  # the launcher's stop of rank 2 is not a failure that began
    assert attempt.stall is stall and attempt.rank(2) is stopped and attempt.rank(7) is None


def test_torchruns_root_cause_is_only_torchruns():
    exits = (LauncherExit(exit_code=1, launcher="torchrun", rank=3, root=True),
             LauncherExit(exit_code=1, launcher="deepspeed", rank=4, root=True))  # fmt: skip
    assert AttemptEvidence(attempt=0, ranks=(), launcher_exits=exits).torchrun_root == 3
    assert AttemptEvidence(attempt=0, ranks=(), launcher_exits=exits[1:]).torchrun_root is None
