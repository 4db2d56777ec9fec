"""How a decision becomes a verdict (core/naming.py): every rank's role, the rank that leads a verdict naming
none and its class, and the words of a summary. Pure."""

from __future__ import annotations

from elastic_diag.core.context import build_context
from elastic_diag.core.evidence import AttemptEvidence, RankEvidence
from elastic_diag.core.exceptions import ExceptionRecord
from elastic_diag.core.naming import rank_verdict, roles_around, roles_of, unnamed_lead
from elastic_diag.core.stacks import parse_stack_dump
from elastic_diag.core.taxonomy import load_taxonomy

TAX = load_taxonomy()
TIMEOUT = ("RuntimeError: [../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 8000ms for recv operation "
           "to complete")  # fmt: skip
CLOSED = "RuntimeError: [../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:4000"
STACK = 'Current thread 0x1 (most recent call first):\n  File "/job/train.py", line 77 in fetch\n'


def rank(r: int, line: str | None = None, **kw: object) -> RankEvidence:
    exc = None
    if line:
        etype, _, msg = line.partition(": ")
        exc = ExceptionRecord(type=etype, message=msg, traceback="", time=10.0 + r)
    return RankEvidence(rank=r, local_rank=r, node="host-a", exception=exc, **kw)  # type: ignore[arg-type]


def context(*ranks: RankEvidence, **kw: object):  # type: ignore[no-untyped-def]
    return build_context(AttemptEvidence(attempt=0, ranks=ranks, **kw), TAX)  # type: ignore[arg-type]


def test_roles_collateral_stopped_healthy_and_initiating():
    ctx = context(rank(0, CLOSED, exit_code=1), rank(1, exit_code=0), rank(2, exit_code=-15, alive_at_decision=True,
                                                                          stopped_by_agent=True), rank(3))  # fmt: skip
    assert roles_of(ctx, 3) == {0: "collateral", 1: "healthy", 2: "stopped", 3: "initiating"}
    assert roles_around(3, ctx.findings) == {0: "collateral", 1: "healthy", 2: "stopped", 3: "initiating"}


def test_the_lead_of_a_verdict_naming_no_rank_is_a_rank_that_timed_out():
    ctx = context(rank(0, CLOSED, exit_code=1), rank(1, TIMEOUT, exit_code=1))
    lead, cls = unnamed_lead(ctx)
    assert lead is not None and lead.rank == 1 and cls == "collective_timeout"
    assert unnamed_lead(context(rank(0), rank(1)))[1] == "unknown"


def test_the_summary_names_the_rank_what_it_did_where_and_what_its_peers_did():
    stopped = rank(2, exit_code=-15, alive_at_decision=True, stopped_by_agent=True, stack=parse_stack_dump(STACK))
    ctx = context(rank(0, TIMEOUT, exit_code=1), rank(1, TIMEOUT, exit_code=1), stopped)
    d = rank_verdict(ctx, ctx.findings[2], "")
    assert d.initiating_rank == 2 and d.failure_class == "hang"
    assert d.summary.startswith("Rank 2 on host-a was stuck outside any collective at /job/train.py:77 in fetch")
    assert "Ranks 0, 1 then failed waiting for it." in d.summary
    assert d.collateral_ranks == (0, 1) and d.evidence[0] == "rank 2 alive, main thread at /job/train.py:77 in fetch"
