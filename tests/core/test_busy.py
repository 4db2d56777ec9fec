"""A rank slow, not dead (core/busy.py): every rank but one timed out in the same collective and the missing
one was busy on its own. Named only with the proof; otherwise it stays a suspect. Pure."""

from __future__ import annotations

from core.test_suspects import lines, rank, timed_out, verdict  # type: ignore[import-not-found]

from elastic_diag.core.evidence import RankEvidence
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


def _main_first_waiter(r: int) -> RankEvidence:
    return rank(r, '    with training_args.main_process_first(desc="dataset map pre-processing"):',
                "RuntimeError: [1] is setting up NCCL communicator and retrieving ncclUniqueId from [0] via c10d "
                "key-value store by key '0', but store->get('0') got error: Socket Timeout")  # fmt: skip


def test_ranks_that_timed_out_inside_main_process_first_waited_for_rank_zero():
    bar = evidence_line("Running tokenizer on dataset:  47%|####7     | 3169000/6811963 [30:11<38:27]", order=1)
    d = verdict(_main_first_waiter(1), _main_first_waiter(2), phases=(bar,))
    assert (d.initiating_rank, d.failure_class, d.rule) == (0, "hang", "waited_for_main_process")
    assert d.signature_id == "main-process-first-wait" and d.roles[1] == d.roles[2] == "collateral"
    assert "Running tokenizer on dataset" in d.summary


def test_an_error_of_its_own_inside_the_block_is_that_ranks_failure():
    crashed = rank(0, '  File "/lib/transformers/training_args.py", line 2283, in main_process_first',
                   "KeyError: 'text'", exit_code=1)  # fmt: skip
    d = verdict(crashed, _main_first_waiter(1))
    assert (d.initiating_rank, d.failure_class) == (0, "python_exception")


def test_a_wait_beside_rank_zeros_moving_progress_bar():
    bar = evidence_line("Tokenizing Prompts (num_proc=64):  92%|#########2| 328986/359152 [29:58<12:05, 41.59 "
                        "examples/s]", order=30)  # fmt: skip
    wait = ("[c10d] waitForInput: socket SocketImpl(fd=79, addr=[localhost]:41170, remote=[localhost]:29500) timed "
            "out after 1800000ms")  # fmt: skip
    waiter = RankEvidence(rank=1, local_rank=1, node="", lines=lines(wait, order=31))
    d = verdict(waiter, phases=(bar,))
    assert (d.initiating_rank, d.failure_class) == (0, "hang")
    long_before = evidence_line(bar.text, order=3)
    d = verdict(waiter, phases=(long_before,))
    assert d.initiating_rank is None  # the bar had stopped long before: no proof rank 0 was still at it
