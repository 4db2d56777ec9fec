"""One rank's evidence against the taxonomy (core/findings.py): its state at the verdict, whether it failed on
its own or shows a peer's symptom, the signature and when its failure began. Pure."""

from __future__ import annotations

from elastic_diag.core.evidence import ErrorLine, LogLine, RankEvidence
from elastic_diag.core.exceptions import ExceptionRecord
from elastic_diag.core.findings import examine_rank, retryable_own_failure
from elastic_diag.core.taxonomy import load_taxonomy

TAX = load_taxonomy()
CLOSED = "Connection closed by peer [127.0.0.1]:4000"


def rank(**kw: object) -> RankEvidence:
    return RankEvidence(rank=0, local_rank=0, node="a", **kw)  # type: ignore[arg-type]


def test_states():
    assert examine_rank(rank(exit_code=0), TAX).state == "succeeded"
    assert examine_rank(rank(), TAX).state == "alive"
    assert examine_rank(rank(exit_code=-15, alive_at_decision=True, stopped_by_agent=True), TAX).state == "alive"
    dying = rank(exit_code=-15, alive_at_decision=True, exception=ExceptionRecord("ValueError", "x", "", time=1.0))
    assert examine_rank(dying, TAX, decided_at=2.0).state == "failed"  # its exception was recorded before


def test_a_symptom_is_no_failure_of_its_own_but_its_chains_cause_is():
    symptom = examine_rank(rank(exit_code=1, exception=ExceptionRecord("RuntimeError", CLOSED, "")), TAX)
    assert not symptom.own and symptom.hint == "collateral"
    cleanup = ExceptionRecord("RuntimeError", CLOSED, "", chain=(("ValueError", "bad shard 3"),))
    cause = examine_rank(rank(exit_code=1, exception=cleanup), TAX)
    assert cause.own and cause.exception is not None and cause.exception.type == "ValueError"


def test_its_own_signal_is_its_class_but_the_launchers_is_not():
    assert examine_rank(rank(exit_code=-11), TAX).failure_class == "segfault"
    stopped = rank(exit_code=-15, stopped_by_agent=True, exception=ExceptionRecord("ValueError", "x", ""))
    assert examine_rank(stopped, TAX).failure_class == "python_exception"  # SIGTERM was the launcher's


def test_a_sigabrt_after_waiting_is_the_watchdogs_not_its_own():
    waited = rank(exit_code=-6, lines=(LogLine(text="[Rank 0] Watchdog caught collective operation timeout: "
                                                     "WorkNCCL(SeqNum=3, OpType=ALLREDUCE)"),))  # fmt: skip
    assert not examine_rank(waited, TAX).own
    assert examine_rank(rank(exit_code=-6), TAX).failure_class == "abort"


def test_a_printed_error_begins_its_failure_and_a_silent_exit_is_said():
    printed = ErrorLine(time=3.0, text="terminate called after throwing an instance of 'std::bad_alloc'")
    f = examine_rank(rank(exit_code=1, exit_time=9.0, error_line=printed), TAX)
    assert f.own and f.time == 3.0 and f.printed
    silent = examine_rank(rank(exit_code=3, stderr_tail=("step 4",)), TAX)
    assert silent.own and silent.failure_class == "silent_exit"


def test_a_retryable_error_of_its_own():
    refused = ExceptionRecord(
        "ConnectionRefusedError", "[Errno 111] refused", "", mro=("builtins.ConnectionError", "builtins.OSError")
    )
    fetch = rank(exit_code=1, exception=refused)
    assert retryable_own_failure(fetch, TAX) is not None
    assert retryable_own_failure(rank(exit_code=1, exception=ExceptionRecord("KeyError", "k", "")), TAX) is None
