"""The NCCL watchdogs compared across ranks (core/watchdogs.py): the votes of a minority op or an out-of-step
SeqNum, the schedules that part with no majority, heartbeats stuck together. Pure, on hand-built evidence,
through the one entry point."""

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


def test_an_exit_the_logs_do_not_show_is_not_a_failure_of_its_own():
    exits = (LauncherExit(exit_code=-6, rank=1), LauncherExit(exit_code=1, rank=0))
    d = verdict(rank(0, timed_out(0, 3)), RankEvidence(rank=1, local_rank=1, node=""), launcher_exits=exits)
    assert d.initiating_rank is None and d.roles[1] != "initiating"  # the watchdog's abort, not its own
