"""The NCCL watchdogs compared across ranks (core/watchdogs.py), the suspect (core/suspects.py) and the
DETAIL fingerprints (core/fingerprints.py): pure, on hand-built evidence, through the one entry point."""

from __future__ import annotations

from elastic_diag.core.attribution import judge
from elastic_diag.core.evidence import AttemptEvidence, LauncherExit, LogLine, RankEvidence
from elastic_diag.core.log_lines import evidence_line, signatures_of
from elastic_diag.core.taxonomy import load_taxonomy
from elastic_diag.core.verdict import Diagnosis

TAX = load_taxonomy()


def timed_out(rank: int, seq: int, op: str = "ALLREDUCE", numel: int = 4096) -> str:
    return (f"[Rank {rank}] Watchdog caught collective operation timeout: WorkNCCL(SeqNum={seq}, OpType={op}, "
            f"NumelIn={numel}, NumelOut={numel}, Timeout(ms)=600000) ran for 600031 milliseconds before timing "
            "out.")  # fmt: skip


def lines(*texts: str, order: int = 10, clock: str | None = None) -> tuple[LogLine, ...]:
    return tuple(evidence_line(t, order=order + i, clock=clock, signature=sig.id)
                 for i, t in enumerate(texts) for sig in signatures_of(t, TAX))  # fmt: skip


def rank(r: int, *texts: str, **kw: object) -> RankEvidence:
    return RankEvidence(rank=r, local_rank=r, node="", lines=lines(*texts, order=10 * r + 1), **kw)  # type: ignore[arg-type]


def verdict(*ranks: RankEvidence, **kw: object) -> Diagnosis:
    return judge(AttemptEvidence(attempt=0, ranks=ranks, source="logs", **kw))  # type: ignore[arg-type]


def test_a_minority_op_at_the_same_seqnum_is_named():
    d = verdict(*(rank(r, timed_out(r, 40)) for r in range(3)), rank(3, timed_out(3, 40, "BROADCAST")))
    assert (d.initiating_rank, d.rule) == (3, "named_by_peers")


def test_one_rank_out_of_step_with_a_majority_is_named():
    d = verdict(*(rank(r, timed_out(r, 12)) for r in range(3)), rank(3, timed_out(3, 11)))
    assert d.initiating_rank == 3 and "behind ranks [0, 1, 2]" in " ".join(d.evidence)


def test_two_against_two_parts_with_no_rank_named():
    d = verdict(rank(0, timed_out(0, 8)), rank(1, timed_out(1, 8)), rank(2, timed_out(2, 8, "ALLGATHER")),
                rank(3, timed_out(3, 8, "ALLGATHER")))  # fmt: skip
    assert (d.initiating_rank, d.failure_class, d.rule) == (None, "collective_desync", "watchdogs_part")
    same_op = verdict(rank(0, timed_out(0, 8, numel=4)), rank(1, timed_out(1, 8, numel=8)))
    assert (same_op.failure_class, same_op.rule) == ("collective_mismatch", "watchdogs_part")


def test_all_in_the_same_collective_is_a_plain_timeout_with_the_silent_rank_suspected():
    d = verdict(rank(0, timed_out(0, 5)), rank(2, timed_out(2, 5)), rank(3, timed_out(3, 5)))
    assert (d.initiating_rank, d.failure_class, d.rule) == (None, "collective_timeout", "no_rank_named")
    assert d.suspected_rank == 1 and "Suspected, not proven: rank 1" in d.summary


def test_the_odd_one_out_is_suspected_when_the_rest_are_not_a_majority_of_the_world():
    # six ranks (4 and 5 exited 0), rank 2 alone in #9: the other three are not more than half of six
    done = (RankEvidence(rank=r, local_rank=r, node="", exit_code=0) for r in (4, 5))
    d = verdict(rank(0, timed_out(0, 8)), rank(1, timed_out(1, 8)), rank(2, timed_out(2, 9)),
                rank(3, timed_out(3, 8)), *done)  # fmt: skip
    assert d.initiating_rank is None and d.suspected_rank == 2


def test_rank_zero_is_suspected_behind_a_broadcast_and_after_a_save_it_runs_alone():
    d = verdict(rank(1, timed_out(1, 30, "BROADCAST")), rank(2, timed_out(2, 30, "BROADCAST")))
    assert (d.initiating_rank, d.suspected_rank) == (None, 0)
    save = evidence_line("Saving checkpoint to /ckpt/step_500", order=1)
    d = verdict(rank(1, timed_out(1, 31, numel=1)), phases=(save,))
    assert d.suspected_rank == 0 and "Saving checkpoint" in (d.suspected_reason or "")
    big = verdict(rank(1, timed_out(1, 31, numel=10**6)), phases=(save,))
    assert big.suspected_rank is None  # gradients, not a flag: nothing points at rank 0


def test_heartbeats_stuck_together_name_no_rank_and_apart_name_the_first():
    stuck = ("[PG ID 0 PG GUID 0(default_pg) Rank 0] ProcessGroupNCCL's watchdog got stuck for 480 seconds without "
             "making progress in monitoring enqueued collectives.",
             "[PG 0 Rank 1] Heartbeat monitor timed out! Process will be terminated after dumping debug "
             "info.")  # fmt: skip

    def two(clocks: tuple[str, str]) -> Diagnosis:
        return verdict(*(RankEvidence(rank=r, local_rank=r, node="", lines=lines(stuck[r], order=r + 1,
                                      clock=clocks[r])) for r in range(2)))  # fmt: skip

    together = two(("0704 13:56:50.000", "0704 13:56:52.500"))
    assert (together.initiating_rank, together.failure_class, together.rule) == (None, "hang", "stuck_together")
    apart = two(("0704 13:50:00.000", "0704 13:56:00.000"))
    assert (apart.initiating_rank, apart.failure_class) == (0, "hang")


DETAIL = ("RuntimeError: Detected mismatch between collectives on ranks. Rank {me} is running collective: "
          "CollectiveFingerPrint(SequenceNumber={seq}, OpType=ALLREDUCE, TensorShape=[8], TensorDtypes=Float), but "
          "Rank {other} is running collective: CollectiveFingerPrint(SequenceNumber={other_seq}, OpType=BROADCAST, "
          "TensorShape=[8], TensorDtypes=Float).")  # fmt: skip


def test_detail_fingerprints_name_the_rank_behind_the_others():
    d = verdict(rank(0, DETAIL.format(me=0, seq=12, other=3, other_seq=11)),
                rank(1, DETAIL.format(me=1, seq=12, other=3, other_seq=11)),
                rank(2, DETAIL.format(me=2, seq=12, other=3, other_seq=11)))  # fmt: skip
    assert (d.initiating_rank, d.failure_class, d.rule) == (3, "collective_desync", "detail_fingerprints")


def test_detail_fingerprints_that_name_each_other_name_no_rank():
    d = verdict(rank(0, DETAIL.format(me=0, seq=5, other=1, other_seq=5)),
                rank(1, DETAIL.format(me=1, seq=5, other=0, other_seq=5)))  # fmt: skip
    assert (d.initiating_rank, d.failure_class) == (None, "collective_desync")


def test_detail_fingerprints_do_not_replace_a_rank_s_own_oom():
    oom = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    d = verdict(rank(0, DETAIL.format(me=0, seq=12, other=3, other_seq=11)), rank(2, oom))
    assert (d.initiating_rank, d.failure_class) == (2, "cuda_oom")


def test_the_live_verdict_carries_a_suspect_too():
    """A live attempt (exits seen) where every rank timed out in a broadcast but rank 0 exited 0."""
    ranks = tuple(RankEvidence(rank=r, local_rank=r, node="a", exit_code=1, exit_time=5.0,
                               lines=lines(timed_out(r, 30, "BROADCAST"))) for r in (1, 2))  # fmt: skip
    d = judge(AttemptEvidence(attempt=0, ranks=(*ranks, RankEvidence(rank=3, local_rank=3, node="a", exit_code=1))))
    assert d.initiating_rank is None or d.suspected_rank is None  # a named rank is never also a suspect
    live = judge(AttemptEvidence(attempt=0, ranks=ranks))
    assert (live.initiating_rank, live.suspected_rank) == (None, 0)


def test_an_exit_the_logs_do_not_show_is_not_a_failure_of_its_own():
    exits = (LauncherExit(exit_code=-6, rank=1), LauncherExit(exit_code=1, rank=0))
    d = verdict(rank(0, timed_out(0, 3)), RankEvidence(rank=1, local_rank=1, node=""), launcher_exits=exits)
    assert d.initiating_rank is None and d.roles[1] != "initiating"  # the watchdog's abort, not its own
