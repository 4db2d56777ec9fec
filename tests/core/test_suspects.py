"""The suspect (core/suspects.py): a rank that stands out when no rank is proven, on live verdicts too;
never a named rank. Pure."""

from __future__ import annotations

from elastic_diag.core.attribution import judge
from elastic_diag.core.evidence import AttemptEvidence, LogLine, RankEvidence
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
    # gradients, not a flag: the save does not point at rank 0 (it is suspected only as the one rank left silent)
    assert "Saving checkpoint" not in (big.suspected_reason or "") and "reported nothing" in (
        big.suspected_reason or ""
    )


def test_the_live_verdict_carries_a_suspect_too():
    """A live attempt (exits seen) where every rank timed out in a broadcast but rank 0 exited 0."""
    ranks = tuple(RankEvidence(rank=r, local_rank=r, node="a", exit_code=1, exit_time=5.0,
                               lines=lines(timed_out(r, 30, "BROADCAST"))) for r in (1, 2))  # fmt: skip
    d = judge(AttemptEvidence(attempt=0, ranks=(*ranks, RankEvidence(rank=3, local_rank=3, node="a", exit_code=1))))
    assert d.initiating_rank is None or d.suspected_rank is None  # a named rank is never also a suspect
    live = judge(AttemptEvidence(attempt=0, ranks=ranks))
    assert (live.initiating_rank, live.suspected_rank) == (None, 0)
