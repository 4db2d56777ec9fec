"""The attribution rules one by one, on hand-built evidence (pure, no processes).

Each rule of elastic_diag.attribution.RULES has tests here that show it deciding, and the precedence
tests show the order: a rank's own failure beats every inference."""

from __future__ import annotations

import pytest
from helpers import ROOT

from elastic_diag.core.attribution import RULES
from elastic_diag.core.classify import classify_attempt
from elastic_diag.core.evidence import AttemptEvidence, ErrorLine, RankEvidence
from elastic_diag.core.exceptions import ExceptionRecord
from elastic_diag.core.flight_recorder import Collective, RankRecord
from elastic_diag.core.progress import NonFinite, Progress
from elastic_diag.core.stacks import parse_stack_dump
from elastic_diag.core.stall import StallRank, StallRecord

CLOSED = "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:4000"
TIMEOUT = "RuntimeError: [../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 8000ms for " \
          "recv operation to complete"  # fmt: skip
SIZE = ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:446] op.preamble.length <= op.nbytes. "
        "32 vs 16. Received data size doesn't match expected size. Is there a distributed collective mismatch in "
        "your code?")  # fmt: skip
OUTSIDE = """Current thread 0x00007f01 (most recent call first):
  File "/job/train.py", line 77 in fetch
  File "/job/train.py", line 92 in main
"""
IN_COLLECTIVE = """Current thread 0x00007f01 (most recent call first):
  File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 2800 in all_reduce
  File "/job/train.py", line 96 in main
"""


def rank(r: int, **kw) -> RankEvidence:
    return RankEvidence(rank=r, local_rank=r, node="host-a", **kw)


def exc(line: str, t: float | None, **kw) -> ExceptionRecord:
    etype, _, msg = line.partition(": ")
    tb = f'Traceback (most recent call last):\n  File "/job/train.py", line 60, in step\n{line}'
    return ExceptionRecord(type=etype, message=msg, traceback=tb, time=t, **kw)


def attempt(*ranks: RankEvidence, **kw) -> AttemptEvidence:
    return AttemptEvidence(attempt=0, ranks=ranks, **kw)


def waiting(r: int, t: float = 20.0, line: str = CLOSED) -> RankEvidence:
    return rank(r, exit_code=1, exit_time=t + 0.1, exception=exc(line, t))


def record(r: int, *ops: tuple[str, str]) -> RankRecord:
    """A flight record: collectives #1..#n with (op, sizes)."""
    entries = {i + 1: Collective(seq=i + 1, op=op, sizes=sizes, dtypes="Float", time_ns=None)
               for i, (op, sizes) in enumerate(ops)}  # fmt: skip
    return RankRecord(rank=r, groups={"0": entries}, status={})


def test_every_decision_is_named_documented_and_the_page_is_current():
    """docs/attribution.md's decisions are generated from the tuples of core/attribution.py and each function's
    docstring (tools/attribution_doc.py): every step, vote, rule, refinement and suspect has a name of its own
    and a docstring, and the page is what the generator writes today."""
    import sys

    from elastic_diag.core.attribution import REFINEMENTS, STEPS, VOTES
    from elastic_diag.core.suspects import SUSPECTS

    root = ROOT
    names = [fn.__name__ for group in (STEPS, VOTES, RULES, REFINEMENTS, SUSPECTS) for fn in group]
    assert len(set(names)) == len(names)
    assert RULES[-1].__name__ == "no_rank_named"
    assert all((fn.__doc__ or "").strip() for group in (STEPS, VOTES, RULES, REFINEMENTS, SUSPECTS) for fn in group)
    sys.path.insert(0, str(root / "tools"))
    try:
        import attribution_doc
    finally:
        sys.path.pop(0)
    page = (root / "docs" / "attribution.md").read_text()
    assert attribution_doc.render(page) == page, "run: python tools/attribution_doc.py"


def test_all_succeeded():
    d = classify_attempt(attempt(rank(0, exit_code=0), rank(1, exit_code=0)))
    assert (d.failure_class, d.rule, d.initiating_rank) == ("healthy", "all_succeeded", None)


def test_a_failed_job_is_never_healthy_even_with_no_line_at_all():
    d = classify_attempt(attempt(rank(0, exit_code=0), rank(1, exit_code=-15, alive_at_decision=True,
                                                             stopped_by_agent=True)))  # fmt: skip
    assert d.failure_class != "healthy"


# --- nonfinite_first -------------------------------------------------------------------------------


def test_nonfinite_first_names_the_rank_whose_own_loss_went_non_finite():
    nan = "RuntimeError: The total norm of order 2.0 for gradients from `parameters` is non-finite gradient"
    d = classify_attempt(attempt(
        rank(0, exit_code=1, exit_time=5.1, exception=exc(nan, 5.0)),
        rank(1, exit_code=1, exit_time=5.1, exception=exc(nan, 5.0), nonfinite=NonFinite(backward=4, time=4.0,
                                                                                      where="train.py:61")),
        rank(2, exit_code=1, exit_time=5.1, exception=exc(nan, 5.0)),
    ))  # fmt: skip
    assert (d.failure_class, d.initiating_rank, d.rule) == ("nan_inf", 1, "nonfinite_first")


def test_a_rank_that_failed_on_its_own_before_the_nonfinite_loss_wins():
    d = classify_attempt(attempt(
        rank(0, exit_code=1, exit_time=2.1, exception=exc("ValueError: bad batch", 2.0)),
        waiting(1, 3.0),
        rank(2, exit_code=1, exit_time=3.1, exception=exc(CLOSED, 3.0), nonfinite=NonFinite(backward=9, time=2.5)),
    ))  # fmt: skip
    assert (d.failure_class, d.initiating_rank, d.rule) == ("python_exception", 0, "own_failure_first")


# --- same_failure_everywhere -----------------------------------------------------------------------


@pytest.mark.parametrize("lines", [
    ["ModuleNotFoundError: No module named 'flash_attn'"] * 3,
    [f"FileNotFoundError: [Errno 2] No such file or directory: '/data/shard_{r}.bin'" for r in range(3)],
    ["KeyError: 'optimizer'"] * 3,
])  # fmt: skip
def test_every_rank_failing_the_same_way_names_no_rank(lines):
    d = classify_attempt(attempt(*(rank(r, exit_code=1, exit_time=1.0 + r / 100, exception=exc(line, 1.0 + r / 100))
                                   for r, line in enumerate(lines))))  # fmt: skip
    assert (d.initiating_rank, d.all_ranks, d.rule) == (None, True, "same_failure_everywhere")
    assert d.failure_class == "python_exception" and d.exception_type == lines[0].split(":")[0]
    assert d.summary.startswith("Every rank failed the same way")
    assert d.to_json()["all_ranks"] is True


def test_every_rank_segfaulting_names_no_rank():
    d = classify_attempt(
        attempt(
            *(
                rank(r, exit_code=-11, exit_time=1.0 + r, stderr_tail=("Fatal Python error: Segmentation fault",))
                for r in range(3)
            )
        )
    )
    assert (d.failure_class, d.initiating_rank, d.all_ranks) == ("segfault", None, True)


def test_two_different_own_failures_are_not_the_same_failure():
    d = classify_attempt(attempt(
        rank(0, exit_code=1, exit_time=1.1, exception=exc("KeyError: 'optimizer'", 1.0)),
        rank(1, exit_code=1, exit_time=1.3, exception=exc("ValueError: bad batch", 1.2)),
    ))  # fmt: skip
    assert (d.initiating_rank, d.all_ranks, d.rule) == (0, False, "own_failure_first")
    assert "Rank 1 also failed on its own, later" in d.summary


# --- own_failure_first: precedence over every inference -----------------------------------------------


def test_own_failure_beats_the_schedule_comparison():
    """The held-out case: a rank's own ConnectionError while fetching data; its flight recorder stops
    before its peers' (it died), which a comparison alone calls a desync."""
    records = {0: record(0, ("allreduce", "[[4]]"), ("allreduce", "[[4]]"), ("broadcast", "[[1]]")),
               1: record(1, ("allreduce", "[[4]]"), ("allreduce", "[[4]]"), ("allreduce", "[[4]]")),
               2: record(2, ("allreduce", "[[4]]"), ("allreduce", "[[4]]"), ("allreduce", "[[4]]"))}  # fmt: skip
    d = classify_attempt(attempt(
        rank(0, exit_code=1, exit_time=3.1, flight_record=records[0],
             exception=exc("ConnectionRefusedError: [Errno 111] Connection refused", 3.0,
                           mro=("ConnectionRefusedError", "ConnectionError", "OSError", "Exception"))),
        rank(1, exit_code=1, exit_time=3.3, exception=exc(CLOSED, 3.2), flight_record=records[1]),
        rank(2, exit_code=1, exit_time=3.3, exception=exc(CLOSED, 3.2), flight_record=records[2]),
    ))  # fmt: skip
    assert (d.failure_class, d.initiating_rank, d.exception_type) == ("python_exception", 0, "ConnectionRefusedError")
    assert d.rule == "own_failure_first" and d.signature_id == "transient-network-io" and d.retryable is True


def test_own_failure_beats_the_odd_location():
    d = classify_attempt(attempt(
        rank(0, exit_code=1, exit_time=9.0, exception=exc(CLOSED, 8.9)),
        rank(1, exit_code=1, exit_time=9.0, exception=exc(CLOSED, 8.9)),
        rank(2, exit_code=1, exit_time=3.0, exception=exc("ValueError: bad batch", 2.9)),
    ))  # fmt: skip
    assert (d.initiating_rank, d.rule, d.failure_class) == (2, "own_failure_first", "python_exception")


def test_the_receiver_of_mismatched_data_is_not_the_culprit():
    """gloo aborts the RECEIVER of wrong-sized data: its error is a symptom, the flight recorder names
    the sender."""
    records = {0: record(0, ("allreduce", "[[4]]"), ("allgather", "[[4]]")),
               1: record(1, ("allreduce", "[[4]]"), ("allgather", "[[4]]")),
               2: record(2, ("allreduce", "[[4]]"), ("allgather", "[[8]]"))}  # fmt: skip
    d = classify_attempt(attempt(
        rank(0, exit_code=1, exit_time=3.0, exception=exc(SIZE, 2.9), flight_record=records[0]),
        rank(1, exit_code=1, exit_time=3.3, exception=exc(CLOSED, 3.2), flight_record=records[1]),
        rank(2, exit_code=1, exit_time=3.3, exception=exc(CLOSED, 3.2), flight_record=records[2]),
    ))  # fmt: skip
    assert (d.failure_class, d.initiating_rank, d.rule) == ("collective_mismatch", 2, "schedule_parted")


def test_own_failure_is_ordered_by_the_error_it_printed_not_its_excepthook():
    """Rank 2 logged its ValueError at t=1, cleaned up and re-raised at t=16; rank 0 raised a different
    error of its own at t=9 (an error that is no symptom we know): rank 2 failed first."""
    printed = ErrorLine(time=1.0, text="ValueError: bad batch", exception=exc("ValueError: bad batch", 1.0))
    d = classify_attempt(attempt(
        rank(0, exit_code=1, exit_time=9.1, exception=exc("RuntimeError: stop_waiting response is expected", 9.0)),
        rank(1, exit_code=1, exit_time=9.2, exception=exc(TIMEOUT, 9.1)),
        rank(2, exit_code=1, exit_time=16.1, exception=exc("ValueError: bad batch", 16.0), error_line=printed),
    ))  # fmt: skip
    assert (d.initiating_rank, d.exception_type, d.rule) == (2, "ValueError", "own_failure_first")
    assert "It printed the error 8.0 s before the first of its peers failed" in d.summary


def test_a_rank_still_cleaning_up_at_the_verdict_failed_on_its_own():
    """Its cleanup outlived the grace: no excepthook yet, but the traceback it logged is there."""
    printed = ErrorLine(time=1.0, text="OSError: [Errno 5] Input/output error",
                        exception=exc("OSError: [Errno 5] Input/output error", 1.0))  # fmt: skip
    d = classify_attempt(attempt(
        waiting(0, 9.0, TIMEOUT), waiting(1, 9.0, TIMEOUT),
        rank(2, exit_code=-15, alive_at_decision=True, stopped_by_agent=True, error_line=printed,
             stack=parse_stack_dump(OUTSIDE)),
        decided_at=14.0,
    ))  # fmt: skip
    assert (d.initiating_rank, d.failure_class, d.exception_type) == (2, "io_error", "OSError")
    assert d.rule == "own_failure_first" and "still alive" in d.summary
    assert d.roles == {0: "collateral", 1: "collateral", 2: "initiating"}


def test_an_error_line_the_rank_recovered_from_is_not_its_failure():
    printed = ErrorLine(time=1.0, text="ValueError: retrying", exception=exc("ValueError: retrying", 1.0))
    d = classify_attempt(attempt(
        rank(0, exit_code=1, exit_time=5.1, exception=exc("KeyError: 'label'", 5.0)),
        rank(1, exit_code=1, exit_time=5.3, exception=exc(CLOSED, 5.2), error_line=printed,
             progress=Progress(progress_time=4.0)),
    ))  # fmt: skip
    assert (d.initiating_rank, d.rule) == (0, "own_failure_first")


def test_a_cleanup_collective_that_failed_while_handling_the_ranks_own_error():
    """The rank's final exception is a peer-closed error from a collective in its ``except`` block;
    its chain starts with the ValueError that began it."""
    final = exc(CLOSED, 9.5, chain=(("ValueError", "bad batch 7"),))
    d = classify_attempt(attempt(
        waiting(0, 9.0, TIMEOUT), waiting(1, 9.0, TIMEOUT),
        rank(2, exit_code=1, exit_time=9.6, exception=final),
    ))  # fmt: skip
    assert (d.initiating_rank, d.failure_class, d.exception_type) == (2, "python_exception", "ValueError")


def test_a_thread_that_died_leaves_its_rank_waiting():
    dead = ExceptionRecord(
        type="ValueError",
        message="corrupt shard 17",
        time=2.0,
        thread="prefetch",
        traceback='  File "/job/loader.py", line 30, in run\nValueError: corrupt shard 17',
    )
    d = classify_attempt(attempt(
        waiting(0, 9.0, TIMEOUT), waiting(1, 9.0, TIMEOUT),
        rank(2, exit_code=-15, alive_at_decision=True, stopped_by_agent=True, thread_exception=dead,
             stack=parse_stack_dump(OUTSIDE)),
        decided_at=14.0,
    ))  # fmt: skip
    assert (d.initiating_rank, d.failure_class, d.exception_type) == (2, "python_exception", "ValueError")
    assert "thread 'prefetch'" in d.summary


@pytest.mark.parametrize("etype, mro, message", [
    ("numpy._core._exceptions._ArrayMemoryError", ("numpy._core._exceptions._ArrayMemoryError", "MemoryError",
                                                   "Exception"), "Unable to allocate 8.00 TiB for an array"),
    ("RuntimeError", ("RuntimeError", "Exception"),
     "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you tried to allocate "
     "35184372088832 bytes."),
    ("MyLoaderMemoryError", ("MyLoaderMemoryError", "MemoryError", "Exception"), "batch too big"),
])  # fmt: skip
def test_host_memory_errors_are_host_oom(etype, mro, message):
    d = classify_attempt(attempt(
        waiting(0, 5.0),
        rank(1, exit_code=1, exit_time=4.1, exception=ExceptionRecord(type=etype, message=message, traceback="",
                                                                       time=4.0, mro=mro)),
    ))  # fmt: skip
    assert (d.initiating_rank, d.failure_class) == (1, "host_oom")


def test_ddp_unused_parameters_are_a_desync_on_the_rank_that_skipped_them():
    ddp = ("RuntimeError: Expected to have finished reduction in the prior iteration before starting a new one. "
           "This error indicates that your module has parameters that were not used in producing loss.\n"
           "Parameters which did not receive grad for rank 2: head.weight, head.bias")  # fmt: skip
    d = classify_attempt(attempt(waiting(0, 9.0, TIMEOUT), waiting(1, 9.0, TIMEOUT),
                                 rank(2, exit_code=1, exit_time=3.1, exception=exc(ddp, 3.0))))  # fmt: skip
    assert (d.initiating_rank, d.failure_class, d.signature_id) == (2, "collective_desync", "ddp-unfinished-reduction")
    assert "head.weight, head.bias" in d.summary


def test_keyboard_interrupt_is_a_signal_from_outside():
    d = classify_attempt(
        attempt(waiting(0, 5.0), rank(1, exit_code=1, exit_time=4.1, exception=exc("KeyboardInterrupt", 4.0)))
    )
    assert (d.initiating_rank, d.failure_class) == (1, "killed")


def test_rendezvous_failures_name_no_rank():
    line = "torch.distributed.elastic.rendezvous.api.RendezvousTimeoutError: timed out"
    d = classify_attempt(attempt(rank(0, exit_code=1, exit_time=1.0, exception=exc(line, 1.0)), rank(1, exit_code=0)))
    assert (d.failure_class, d.initiating_rank, d.rule) == ("rendezvous_timeout", None, "own_failure_first")


# --- named_in_exception --------------------------------------------------------------------------------

DCP = (
    "torch.distributed.checkpoint.api.CheckpointException: CheckpointException ranks:dict_keys([2])\n"
    "Traceback (most recent call last): (RANK 2)\n"
    '  File "/venv/lib/python3.11/site-packages/torch/distributed/checkpoint/filesystem.py", line 188, in _write\n'
    "    stream.write(data)\n"
    "OSError: [Errno 28] No space left on device\n"
)


def test_a_wrapper_exception_naming_the_failing_rank():
    d = classify_attempt(attempt(*(rank(r, exit_code=1, exit_time=2.0 + r / 10,
                                        exception=ExceptionRecord(type="torch.distributed.checkpoint.api."
                                                                  "CheckpointException", message=DCP.split(": ", 1)[1],
                                                                  traceback=DCP, time=2.0 + r / 10))
                                   for r in range(3))))  # fmt: skip
    assert (d.initiating_rank, d.failure_class, d.rule) == (2, "io_error", "named_in_exception")
    assert d.signature_id == "disk-full" and d.exception_type == "OSError"
    assert not d.all_ranks


def test_a_wrapper_exception_with_no_specific_inner_error_keeps_its_own_class():
    text = DCP.replace("OSError: [Errno 28] No space left on device", "AssertionError")
    d = classify_attempt(
        attempt(
            *(
                rank(
                    r,
                    exit_code=1,
                    exit_time=2.0,
                    exception=ExceptionRecord(
                        type="CheckpointException", message=text.split(": ", 1)[1], traceback=text, time=2.0
                    ),
                )
                for r in range(3)
            )
        )
    )
    assert (d.initiating_rank, d.failure_class, d.exception_type) == (2, "io_error", "AssertionError")


# --- schedule_parted, missing_from_collective ---------------------------------------------------------


def test_schedule_parted_names_the_rank_that_issued_another_collective():
    ops = [("allreduce", "[[4]]"), ("allreduce", "[[4]]"), ("allgather", "[[4]]")]
    records = {r: record(r, *(ops[:1] + ops[2:] if r == 1 else ops)) for r in range(3)}  # rank 1 skipped #2
    d = classify_attempt(attempt(*(rank(r, exit_code=1, exit_time=9.1, exception=exc(TIMEOUT, 9.0),
                                        flight_record=records[r]) for r in range(3))))  # fmt: skip
    assert (d.initiating_rank, d.failure_class, d.rule) == (1, "collective_desync", "schedule_parted")


def test_missing_from_collective():
    rec = {0: record(0, ("allreduce", "[[4]]"), ("allreduce", "[[4]]")),
           1: record(1, ("allreduce", "[[4]]"), ("allreduce", "[[4]]")),
           2: record(2, ("allreduce", "[[4]]"))}  # fmt: skip
    d = classify_attempt(attempt(
        rank(0, exit_code=1, exit_time=9.1, exception=exc(TIMEOUT, 9.0), flight_record=rec[0]),
        rank(1, exit_code=1, exit_time=9.1, exception=exc(TIMEOUT, 9.0), flight_record=rec[1]),
        rank(2, exit_code=-15, alive_at_decision=True, stopped_by_agent=True, flight_record=rec[2]),
    ))  # fmt: skip
    assert (d.initiating_rank, d.rule) == (2, "missing_from_collective")


# --- named_by_peers (tests/core/test_classify.py: monitoredBarrier, NCCL's desync report), hang_alarm,
# alive_outside_collective, odd_location, the last resorts ----------------


def test_hang_alarm_names_the_watched_rank():
    d = classify_attempt(attempt(
        rank(0, exit_code=-15, alive_at_decision=True, stopped_by_agent=True, stack=parse_stack_dump(IN_COLLECTIVE)),
        rank(1, exit_code=-15, alive_at_decision=True, stopped_by_agent=True, stack=parse_stack_dump(IN_COLLECTIVE)),
        hang={"rank": 1, "threshold_s": 5, "stalled_s": 6, "reason": "watch 'eval' past its 5 s timeout"},
    ))  # fmt: skip
    assert (d.initiating_rank, d.rule) == (1, "hang_alarm")


def test_alive_outside_collective():
    d = classify_attempt(attempt(
        waiting(0, 9.0, TIMEOUT), waiting(1, 9.0, TIMEOUT),
        rank(2, exit_code=-15, alive_at_decision=True, stopped_by_agent=True, stack=parse_stack_dump(OUTSIDE)),
    ))  # fmt: skip
    assert (d.initiating_rank, d.failure_class, d.rule) == (2, "hang", "alive_outside_collective")


def stall_at(since: float, outside: dict[int, str | None], waiting: tuple[int, ...], **kw) -> StallRecord:
    ranks = [StallRank(rank=r, local_rank=r, in_collective=False, where=w, beacon=True) for r, w in outside.items()]
    ranks += [StallRank(rank=r, local_rank=r, in_collective=True, where="/job/train.py:96 in main",
                        collective="barrier #13 (process group 0)", beacon=True) for r in waiting]  # fmt: skip
    return StallRecord(number=1, node="host-a", since=since, detected_at=since + 5.2, threshold_s=5.0,
                       ranks=tuple(sorted(ranks, key=lambda r: r.rank)), **kw)  # fmt: skip


def test_outside_collective_at_stall_names_the_rank_that_held_its_peers_past_the_timeout():
    """Rank 0's checkpoint save outlasted the collective timeout: ranks 1 and 2 timed out in the barrier, then
    rank 0 entered it and found them gone. Every failure is a symptom and no rank is alive any more; the stall
    snapshot, taken while rank 0 was still saving, names it and where."""
    where = "/job/checkpoint.py:88 in save"
    d = classify_attempt(attempt(
        waiting(0, 14.0, CLOSED), waiting(1, 8.0, TIMEOUT), waiting(2, 8.0, TIMEOUT),
        stalls=(stall_at(0.5, {0: where}, (1, 2), outcome="failed"),),
    ))  # fmt: skip
    assert (d.initiating_rank, d.failure_class, d.rule) == (0, "hang", "outside_collective_at_stall")
    assert d.signature_id == "rank-outlasted-collective-timeout"
    assert d.summary.startswith(f"Rank 0 on host-a was busy outside any collective at {where}, while its peers "
                                "waited in the next collective (seen there by the stall snapshot); it reached the "
                                "collective only after their timeout had expired")  # fmt: skip
    assert d.collateral_ranks == (1, 2)
    assert any(line.startswith("elastic_diag stall snapshot 5.2 s after the last progress: rank 0 outside") and
               "waited in barrier #13" in line for line in d.evidence), d.evidence  # fmt: skip


def test_a_rank_the_stall_saw_stuck_and_the_teardown_stopped_there_is_stuck_outside_any_collective():
    """Stopped by the launcher with no stack of its own taken later (its dump was lost): the stall's stack."""
    where = "/job/train.py:77 in fetch"
    d = classify_attempt(attempt(
        waiting(0, 8.0, TIMEOUT), waiting(1, 8.0, TIMEOUT),
        rank(2, exit_code=-15, alive_at_decision=True, stopped_by_agent=True),
        stalls=(stall_at(0.5, {2: where}, (0, 1), outcome="failed"),),
    ))  # fmt: skip
    assert (d.initiating_rank, d.signature_id, d.rule) == (2, "hang-outside-collective", "outside_collective_at_stall")
    assert d.summary.startswith(f"Rank 2 on host-a was stuck outside any collective at {where}, while its peers "
                                "waited (seen there by the stall snapshot, before any teardown).")  # fmt: skip


def test_a_stall_the_job_got_over_or_a_later_own_failure_decides_nothing_here():
    """A stall that ended (progress resumed) says nothing of a later failure; a rank's own failure beats the
    stall's inference."""
    over = stall_at(0.5, {0: "/job/train.py:77 in fetch"}, (1, 2), ended_at=12.0, outcome="resumed")
    d = classify_attempt(attempt(waiting(0, 30.0, CLOSED), waiting(1, 30.0, TIMEOUT), waiting(2, 30.0, TIMEOUT),
                                 stalls=(over,)))  # fmt: skip
    assert d.rule != "outside_collective_at_stall"
    stuck = stall_at(0.5, {0: "/job/train.py:77 in fetch"}, (1, 2), outcome="failed")
    own = rank(2, exit_code=1, exit_time=9.0, exception=exc("ValueError: bad batch", 8.9))
    d = classify_attempt(attempt(waiting(0, 10.0, CLOSED), waiting(1, 10.0, CLOSED), own, stalls=(stuck,)))
    assert (d.initiating_rank, d.rule) == (2, "own_failure_first")


def test_odd_location():
    at = 'Traceback (most recent call last):\n  File "/job/train.py", line {}, in step\n' + CLOSED
    d = classify_attempt(attempt(*(rank(r, exit_code=1, exit_time=9.0, exception=ExceptionRecord(
        type="RuntimeError", message=CLOSED.split(": ", 1)[1], traceback=at.format(70 if r == 1 else 50), time=9.0))
        for r in range(3))))  # fmt: skip
    assert (d.initiating_rank, d.failure_class, d.rule) == (1, "collective_desync", "odd_location")


def test_only_rank_without_error():
    d = classify_attempt(attempt(waiting(0, 9.0, TIMEOUT),
                                 rank(1, exit_code=-15, alive_at_decision=True, stopped_by_agent=True),
                                 waiting(2, 9.0, TIMEOUT)))  # fmt: skip
    assert (d.initiating_rank, d.failure_class, d.rule) == (1, "hang", "only_rank_without_error")


def test_exited_while_peers_waited():
    d = classify_attempt(
        attempt(waiting(0, 9.0, TIMEOUT), waiting(1, 9.0, TIMEOUT), rank(2, exit_code=0, exit_time=1.0))
    )
    assert (d.initiating_rank, d.failure_class, d.rule) == (2, "collective_desync", "exited_while_peers_waited")


def test_no_rank_named_says_why():
    d = classify_attempt(attempt(waiting(0, 9.0, TIMEOUT), waiting(1, 9.0, TIMEOUT)))
    assert (d.initiating_rank, d.failure_class, d.rule) == (None, "collective_timeout", "no_rank_named")
    assert "names no rank" in d.summary


def test_the_gate_sees_the_initiating_ranks_own_retryable_exception():
    from elastic_diag.core.findings import retryable_own_failure
    from elastic_diag.core.taxonomy import load_taxonomy

    tax = load_taxonomy()
    fetch = rank(
        1,
        exit_code=1,
        exception=exc(
            "requests.exceptions.ConnectionError: HTTPSConnectionPool(host='data', "
            "port=443): Max retries exceeded with url: /shard-7",
            3.0,
        ),
    )
    io = rank(1, exit_code=1, exception=exc("OSError: [Errno 5] Input/output error", 3.0))
    bug = rank(1, exit_code=1, exception=exc("ValueError: bad batch", 3.0))
    full = rank(1, exit_code=1, exception=exc("OSError: [Errno 28] No space left on device", 3.0))
    assert retryable_own_failure(fetch, tax) is not None and retryable_own_failure(io, tax) is not None
    assert retryable_own_failure(bug, tax) is None and retryable_own_failure(full, tax) is None


def test_a_wrapper_exception_naming_every_rank_names_no_rank():
    text = ("CheckpointException ranks:dict_keys([0, 1, 2])\n" + "".join(
        f"Traceback (most recent call last): (RANK {r})\n  File \"/venv/torch/distributed/checkpoint/filesystem.py\", "
        f"line 871, in read_data\nFileNotFoundError: [Errno 2] No such file or directory: '/ckpt/__2_0.distcp'\n"
        for r in range(3)))  # fmt: skip
    d = classify_attempt(attempt(*(rank(r, exit_code=1, exit_time=2.0, exception=ExceptionRecord(
        type="torch.distributed.checkpoint.api.CheckpointException", message=text, traceback=text, time=2.0))
        for r in range(3))))  # fmt: skip
    assert (d.initiating_rank, d.all_ranks, d.failure_class) == (None, True, "io_error")
    assert d.exception_type == "FileNotFoundError" and "__2_0.distcp" in d.summary


def test_schedules_that_disagree_without_a_majority_name_no_rank():
    records = {r: record(r, ("allreduce", "[[4]]"), ("allreduce", "[[8]]" if r else "[[4]]")) for r in range(2)}
    d = classify_attempt(attempt(*(rank(r, exit_code=1, exit_time=9.0, exception=exc(TIMEOUT, 9.0),
                                        flight_record=records[r]) for r in range(2))))  # fmt: skip
    assert (d.initiating_rank, d.failure_class, d.rule) == (None, "collective_mismatch", "schedules_disagree")
    assert "rank 0: allreduce sizes [[4]] Float" in d.summary and "rank 1: allreduce sizes [[8]] Float" in d.summary


def test_the_aborted_receiver_at_another_call_than_its_peers_issued_another_collective():
    """No record of what the receiver issued; its stack (faulthandler's, in its stderr) was at another
    line than its agreeing peers': an extra collective, not the same one with other sizes."""
    rec = {r: record(r, ("all_reduce", "[[6337]]"), ("all_reduce", "[[1]]"), ("all_reduce", "[[6337]]"))
           for r in (0, 1)}  # fmt: skip
    aborted = ("Fatal Python error: Aborted", "", "Current thread 0x01 (most recent call first):",
               '  File "/job/train.py", line 127 in train')  # fmt: skip
    what = "  what():  [enforce fail at pair.cc:456] op.preamble.length <= op.nbytes. 25348 vs 4"
    at = 'Traceback (most recent call last):\n  File "/job/train.py", line 117, in train\n' + CLOSED
    d = classify_attempt(attempt(
        *(rank(r, exit_code=1, exit_time=3.0, flight_record=rec[r], exception=ExceptionRecord(
            type="RuntimeError", message=CLOSED.split(": ", 1)[1], traceback=at, time=3.0)) for r in (0, 1)),
        rank(2, exit_code=-6, exit_time=2.9, stderr_tail=(what, *aborted)),
    ))  # fmt: skip
    assert (d.initiating_rank, d.failure_class, d.rule) == (2, "collective_desync", "schedule_parted")
    same = classify_attempt(attempt(
        *(rank(r, exit_code=1, exit_time=3.0, flight_record=rec[r], exception=ExceptionRecord(
            type="RuntimeError", message=CLOSED.split(": ", 1)[1], traceback=at, time=3.0)) for r in (0, 1)),
        rank(2, exit_code=-6, exit_time=2.9,
             stderr_tail=(what, *aborted[:-1], '  File "/job/train.py", line 117 in train')),
    ))  # fmt: skip
    assert (same.initiating_rank, same.failure_class) == (2, "collective_mismatch")


def test_a_receiver_of_too_much_with_nothing_to_compare_is_a_mismatch_nobody_is_named_for():
    """send/recv leave no flight record on gloo: the receiver's abort proves a mismatch, not who sent it."""
    what = "  what():  [enforce fail at pair.cc:456] op.preamble.length <= op.nbytes. 20 vs 16"
    d = classify_attempt(attempt(rank(0, exit_code=-6, exit_time=2.0, stderr_tail=(what,)),
                                 rank(1, exit_code=1, exit_time=2.1, exception=exc(CLOSED, 2.05))))  # fmt: skip
    assert (d.initiating_rank, d.failure_class, d.rule) == (None, "collective_mismatch", "no_rank_named")


@pytest.mark.parametrize("code", [-1, -10, -12, -14, -24, -25])  # SIGHUP, SIGUSR1, SIGUSR2, SIGALRM, SIGXCPU, SIGXFSZ
def test_a_rank_ended_by_a_signal_from_outside_is_killed(code):
    d = classify_attempt(attempt(waiting(0, 5.0), rank(1, exit_code=code, exit_time=4.0)))
    assert (d.initiating_rank, d.failure_class) == (1, "killed"), d


def test_local_index_only_is_named_with_what_it_means_and_a_single_node_line_settles_it():
    from elastic_diag.core.attribution import judge
    from elastic_diag.core.evidence import AttemptEvidence, LauncherExit

    agent = LauncherExit(exit_code=-9, launcher="torch-agent", local_rank=2, pid=517203)
    d = judge(AttemptEvidence(attempt=0, ranks=(), source="logs", launcher_exits=(agent,)))
    assert (d.initiating_rank, d.failure_class) == (2, "killed")
    assert "only by its local index 2" in d.summary and "global rank 2 on one node" in d.summary
    one = judge(AttemptEvidence(attempt=0, ranks=(), source="logs", launcher_exits=(agent,),
                                single_node="torchrun --standalone --nproc-per-node 8 train.py"))  # fmt: skip
    assert "the job ran on one node (torchrun --standalone" in one.summary


def test_a_launcher_line_with_a_signal_and_no_rank_gives_the_signals_class_and_no_rank():
    from elastic_diag.core.attribution import judge
    from elastic_diag.core.evidence import AttemptEvidence, LauncherExit

    ds = LauncherExit(exit_code=-7, launcher="deepspeed", local_rank=7, text="... exits with return code = -7")
    d = judge(
        AttemptEvidence(
            attempt=0,
            ranks=(),
            source="logs",
            launcher_exits=(ds,),
            failure_lines=("['python', 'main.py', '--local_rank=7'] exits with return code = -7",),
        )
    )
    assert (d.initiating_rank, d.failure_class) == (None, "segfault") and "SIGBUS" in d.summary
