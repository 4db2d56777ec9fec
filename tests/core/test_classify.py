"""Attribution on hand-built evidence: pure, no processes."""

from __future__ import annotations

from elastic_diag.core.classify import classify_attempt, classify_launch_error
from elastic_diag.core.evidence import AttemptEvidence, RankEvidence
from elastic_diag.core.exceptions import ExceptionRecord
from elastic_diag.core.stacks import parse_stack_dump

CLOSED = "RuntimeError: [../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:4000"
TIMEOUT = (
    "RuntimeError: [../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 8000ms for recv operation to complete"
)
IN_COLLECTIVE = """Thread 0x00007f01 (most recent call first):
  File "/venv/lib/python3.11/site-packages/torch/autograd/graph.py", line 979 in _engine_run_backward
  File "/job/train.py", line 96 in main
"""
OUTSIDE = """Thread 0x00007f02 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 320 in wait
  File "/job/train.py", line 20 in worker_loop
Current thread 0x00007f01 (most recent call first):
  File "/job/train.py", line 77 in inject
  File "/job/train.py", line 92 in main
"""


def rank(r: int, **kw) -> RankEvidence:
    return RankEvidence(rank=r, local_rank=r, node="host-a", **kw)


def exc(line: str, t: float) -> ExceptionRecord:
    etype, _, msg = line.partition(": ")
    tb = f'  File "/job/train.py", line 60, in inject\n{line}'
    return ExceptionRecord(type=etype, message=msg, traceback=tb, time=t)


def attempt(*ranks: RankEvidence) -> AttemptEvidence:
    return AttemptEvidence(attempt=0, ranks=ranks)


def test_exception_on_rank_2_others_collateral():
    d = classify_attempt(attempt(
        rank(0, exit_code=1, exit_time=10.5, exception=exc(CLOSED, 10.4)),
        rank(1, exit_code=1, exit_time=10.6, exception=exc(CLOSED, 10.5)),
        rank(2, exit_code=1, exit_time=10.3, exception=exc("ValueError: bad batch", 10.2)),
        rank(3, exit_code=1, exit_time=10.5, exception=exc(CLOSED, 10.45)),
    ))  # fmt: skip
    assert (d.failure_class, d.initiating_rank, d.exception_type) == ("python_exception", 2, "ValueError")
    assert d.collateral_ranks == (0, 1, 3)
    assert d.roles == {0: "collateral", 1: "collateral", 2: "initiating", 3: "collateral"}
    assert "ValueError: bad batch" in d.evidence
    assert d.fix and d.verify


def test_exception_after_cleanup_is_initiating_even_when_later():
    """The culprit's exception is LATER than its peers' peer-closed errors: evidence beats time."""
    d = classify_attempt(attempt(
        rank(0, exit_code=1, exit_time=10.5, exception=exc(CLOSED, 10.4)),
        rank(1, exit_code=1, exit_time=13.6, exception=exc("ValueError: bad batch", 13.5)),
    ))  # fmt: skip
    assert (d.failure_class, d.initiating_rank) == ("python_exception", 1)


def test_signals_and_silent_exit():
    for code, cls, tail in [(-11, "segfault", ("Fatal Python error: Segmentation fault",)),
                            (-9, "killed", ()), (-6, "abort", ()), (3, "silent_exit", ("last words",))]:  # fmt: skip
        d = classify_attempt(attempt(
            rank(0, exit_code=1, exit_time=5.2, exception=exc(CLOSED, 5.1)),
            rank(1, exit_code=code, exit_time=5.0, stderr_tail=tail),
        ))  # fmt: skip
        assert (d.failure_class, d.initiating_rank) == (cls, 1), (code, d)


def test_oom_kill_needs_kernel_evidence():
    bare = classify_attempt(attempt(rank(1, exit_code=-9, exit_time=1.0, stderr_tail=("Killed",))))
    proven = classify_attempt(attempt(rank(1, exit_code=-9, exit_time=1.0,
                                            stderr_tail=("Out of memory: Killed process 4242 (python)",))))  # fmt: skip
    assert bare.failure_class == "killed"
    assert proven.failure_class == "host_oom"


def test_memory_error_is_host_oom():
    d = classify_attempt(attempt(rank(3, exit_code=1, exit_time=2.0, exception=exc("MemoryError: ", 1.9))))
    assert (d.failure_class, d.initiating_rank, d.exception_type) == ("host_oom", 3, "MemoryError")


def test_hang_outside_collective_named_from_its_stack():
    d = classify_attempt(attempt(
        rank(0, exit_code=1, exit_time=20.0, exception=exc(TIMEOUT, 19.9)),
        rank(1, exit_code=1, exit_time=20.1, exception=exc(TIMEOUT, 20.0)),
        rank(2, exit_code=-15, alive_at_decision=True, stopped_by_agent=True, stack=parse_stack_dump(OUTSIDE)),
        rank(3, exit_code=-15, alive_at_decision=True, stopped_by_agent=True, stack=parse_stack_dump(IN_COLLECTIVE)),
    ))  # fmt: skip
    assert (d.failure_class, d.initiating_rank) == ("hang", 2)
    assert d.roles == {0: "collateral", 1: "collateral", 2: "initiating", 3: "stopped"}
    assert "/job/train.py:77 in inject" in d.summary


def test_waiting_ranks_alone_name_nobody():
    d = classify_attempt(attempt(
        rank(0, exit_code=1, exit_time=20.0, exception=exc(TIMEOUT, 19.9)),
        rank(1, exit_code=1, exit_time=20.1, exception=exc(TIMEOUT, 20.0)),
        rank(2, exit_code=-15, alive_at_decision=True, stopped_by_agent=True, stack=parse_stack_dump(IN_COLLECTIVE)),
        rank(3, exit_code=-15, alive_at_decision=True, stopped_by_agent=True, stack=parse_stack_dump(IN_COLLECTIVE)),
    ))  # fmt: skip
    assert d.initiating_rank is None
    assert d.failure_class == "collective_timeout"
    assert "names no rank" in d.summary


def test_the_only_silent_rank_among_timeouts_is_named():
    d = classify_attempt(attempt(
        rank(0, exit_code=1, exit_time=20.0, exception=exc(TIMEOUT, 19.9)),
        rank(1, exit_code=-15, alive_at_decision=True, stopped_by_agent=True),
        rank(2, exit_code=1, exit_time=20.1, exception=exc(TIMEOUT, 20.0)),
    ))  # fmt: skip
    assert (d.failure_class, d.initiating_rank) == ("hang", 1)


def test_healthy():
    d = classify_attempt(attempt(rank(0, exit_code=0), rank(1, exit_code=0)))
    assert d.failure_class == "healthy" and d.initiating_rank is None
    assert set(d.roles.values()) == {"healthy"}


def test_launch_errors():
    assert classify_launch_error("DistNetworkError: ... EADDRINUSE, message: address already in use").failure_class \
        == "port_conflict"  # fmt: skip
    assert classify_launch_error("torch.distributed.elastic.rendezvous.api.RendezvousTimeoutError").failure_class \
        == "rendezvous_timeout"  # fmt: skip
    assert classify_launch_error("something odd").failure_class == "unknown"


def test_rank_dying_of_its_exception_at_the_verdict_is_initiating():
    """Its excepthook ran before the verdict, but interpreter teardown outlived the grace."""
    d = classify_attempt(AttemptEvidence(attempt=0, decided_at=30.0, ranks=(
        rank(0, exit_code=1, exit_time=20.0, exception=exc(TIMEOUT, 19.9)),
        rank(2, exit_code=-15, alive_at_decision=True, stopped_by_agent=True,
             exception=exc("ValueError: bad batch", 29.0), stack=parse_stack_dump(OUTSIDE)),
    )))  # fmt: skip
    assert (d.failure_class, d.initiating_rank, d.exception_type) == ("python_exception", 2, "ValueError")


def test_exception_raised_by_the_teardown_itself_is_not_a_cause():
    """A script whose SIGTERM handler raises records an exception AFTER the verdict: still stopped."""
    d = classify_attempt(AttemptEvidence(attempt=0, decided_at=30.0, ranks=(
        rank(0, exit_code=-11, exit_time=20.0),
        rank(1, exit_code=1, alive_at_decision=True, stopped_by_agent=True,
             exception=exc("KeyboardInterrupt: ", 30.5), stack=parse_stack_dump(IN_COLLECTIVE)),
    )))  # fmt: skip
    assert d.initiating_rank == 0 and d.roles[1] == "stopped"


def test_rank_named_by_its_peers_desync_report():
    report = "    [3] finished collective #182, but didn't join collective #183 (count from 1)"
    watchdog = (
        "[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=183, OpType=ALLREDUCE, "
        "NumelIn=6, NumelOut=6, Timeout(ms)=600000) ran for 600086 milliseconds before timing out."
    )
    d = classify_attempt(attempt(
        rank(0, exit_code=-6, exit_time=600.0, stderr_tail=(watchdog, report)),
        rank(1, exit_code=-6, exit_time=600.1, stderr_tail=(watchdog.replace("Rank 0", "Rank 1"),)),
        rank(2, exit_code=-6, exit_time=600.2, stderr_tail=(watchdog.replace("Rank 0", "Rank 2"),)),
        rank(3, exit_code=-15, alive_at_decision=True, stopped_by_agent=True),
    ))  # fmt: skip
    assert (d.failure_class, d.initiating_rank) == ("collective_desync", 3)
    assert report.strip() in d.evidence


def test_monitored_barrier_names_the_missing_rank():
    line = "RuntimeError: [Rank 0]: Rank 2 failed to pass monitoredBarrier in 2000 ms"
    d = classify_attempt(attempt(
        rank(0, exit_code=1, exit_time=5.0, exception=exc(line, 5.0)),
        rank(1, exit_code=-15, alive_at_decision=True, stopped_by_agent=True),
        rank(2, exit_code=-15, alive_at_decision=True, stopped_by_agent=True),
    ))  # fmt: skip
    assert (d.failure_class, d.initiating_rank) == ("hang", 2)
    assert d.rule == "named_by_peers"
