"""What every rule sees (core/context.py): the ranks sorted into those that failed on their own (earliest
first, by time, else by where their first error line was read), symptoms and those alive; the votes; a vote
added after the fact. Pure."""

from __future__ import annotations

from elastic_diag.core.context import build_context, with_vote
from elastic_diag.core.evidence import AttemptEvidence, RankEvidence
from elastic_diag.core.exceptions import ExceptionRecord
from elastic_diag.core.taxonomy import load_taxonomy

TAX = load_taxonomy()
LAGGING = "- To our best knowledge, ranks [3] are the lagging ranks that caused this timeout."


def failed(r: int, t: float | None, order: int | None = None, line: str = "ValueError: x") -> RankEvidence:
    etype, _, msg = line.partition(": ")
    return RankEvidence(rank=r, local_rank=r, node="", exit_code=1, order=order,
                        exception=ExceptionRecord(etype, msg, "", time=t))  # fmt: skip


def test_own_failures_earliest_first_by_time_then_by_order():
    ctx = build_context(AttemptEvidence(attempt=0, ranks=(failed(0, 9.0), failed(1, 4.0), failed(2, 4.0))), TAX)
    assert [f.rank for f in ctx.own] == [1, 2, 0]
    logs = build_context(AttemptEvidence(attempt=0, ranks=(failed(0, None, 30), failed(1, None, 12))), TAX)
    assert [f.rank for f in logs.own] == [1, 0]


def test_symptoms_alive_and_failing():
    closed = "RuntimeError: Connection closed by peer [127.0.0.1]:4000"
    ranks = (failed(0, 3.0, line=closed), RankEvidence(rank=1, local_rank=1, node="", alive_at_decision=True))
    ctx = build_context(AttemptEvidence(attempt=0, ranks=ranks), TAX)
    assert [f.rank for f in ctx.symptoms] == [0] and [f.rank for f in ctx.alive] == [1] and ctx.failing
    quiet = build_context(AttemptEvidence(attempt=0, ranks=(RankEvidence(rank=0, local_rank=0, node="", exit_code=0),)),
                          TAX)  # fmt: skip
    assert not quiet.failing


def test_votes_from_the_peers_lines_and_one_added_after_the_fact():
    peer = RankEvidence(rank=0, local_rank=0, node="", exit_code=1, stderr_tail=(LAGGING,))
    ctx = build_context(AttemptEvidence(attempt=0, ranks=(peer, RankEvidence(rank=3, local_rank=3, node=""))), TAX)
    assert list(ctx.votes) == [3]
    sig = TAX.get("nccl-desync-report")
    more = with_vote(ctx, 5, sig, "rank 5 is behind")
    assert set(more.votes) == {3, 5} and 5 in more.findings  # rank 5 joined the ranks with no evidence of its own
