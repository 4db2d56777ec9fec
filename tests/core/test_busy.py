"""A rank slow, not dead (core/busy.py): every rank but one timed out in the same collective and the missing
one was busy on its own. Named only with the proof; otherwise it stays a suspect. Pure."""

from __future__ import annotations

from core.test_suspects import rank, timed_out, verdict  # type: ignore[import-not-found]

from elastic_diag.core.log_lines import evidence_line


def test_rank_zero_missing_from_three_timeouts_in_one_collective_is_the_culprit():
    d = verdict(*(rank(r, timed_out(r, 2, numel=1)) for r in (1, 2, 3)))
    assert (d.initiating_rank, d.failure_class, d.rule) == (0, "hang", "busy_while_peers_waited")
    assert d.roles == {0: "initiating", 1: "collateral", 2: "collateral", 3: "collateral"}
    assert "slow, not dead" in d.summary and d.signature_id == "rank-outlasted-collective-timeout"


def test_its_last_line_of_work_is_the_evidence():
    bar = evidence_line("Running tokenizer on dataset:   9%|#         | 280000/2969526 [29:55<4:48:08]", order=50)
    d = verdict(*(rank(r, timed_out(r, 2, numel=1)) for r in (1, 2, 3)), phases=(bar,))
    assert d.initiating_rank == 0 and d.evidence[0].startswith("Running tokenizer on dataset")


def test_two_waiters_or_another_collective_leave_a_suspect():
    two = verdict(rank(1, timed_out(1, 7, "BROADCAST")), rank(2, timed_out(2, 7, "BROADCAST")))
    assert (two.initiating_rank, two.suspected_rank) == (None, 0)  # a paste of two ranks out of eight looks so
    parted = verdict(rank(1, timed_out(1, 7)), rank(2, timed_out(2, 7)), rank(3, timed_out(3, 8)))
    assert parted.rule != "busy_while_peers_waited"


def test_a_missing_rank_other_than_zero_needs_a_line_of_its_own_work():
    d = verdict(*(rank(r, timed_out(r, 4, numel=1)) for r in (0, 2, 3)))
    assert (d.initiating_rank, d.suspected_rank) == (None, 1)
    saving = evidence_line("Saving model checkpoint to /out/checkpoint-500", order=5, rank=1)
    d = verdict(*(rank(r, timed_out(r, 4, numel=1)) for r in (0, 2, 3)), phases=(saving,))
    assert (d.initiating_rank, d.failure_class) == (1, "hang")


def test_a_missing_rank_that_failed_on_its_own_is_not_called_busy():
    d = verdict(rank(0, "ValueError: bad shard"), *(rank(r, timed_out(r, 2, numel=1)) for r in (1, 2, 3)))
    assert (d.initiating_rank, d.failure_class) == (0, "python_exception")
