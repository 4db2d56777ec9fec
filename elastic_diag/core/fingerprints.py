"""TORCH_DISTRIBUTED_DEBUG=DETAIL's collective fingerprints compared: "Detected mismatch between collectives
on ranks. Rank 4 is running collective: CollectiveFingerPrint(SequenceNumber=101, OpType=ALLGATHER ...),
but Rank 7 is running collective: CollectiveFingerPrint(SequenceNumber=0, OpType=REDUCE ...)".

The check raises that RuntimeError on every rank that compared (and the peers then time out or abort), so
the rules alone read it as a Python exception of every rank, or a timeout: :func:`detail_fingerprints` is a
REFINEMENT (:data:`elastic_diag.core.attribution.REFINEMENTS`) of such a verdict. Pure: no torch, no I/O.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from elastic_diag.core.context import Context, with_vote
from elastic_diag.core.evidence import FingerprintReport
from elastic_diag.core.naming import unattributed
from elastic_diag.core.verdict import Diagnosis, Role

# the verdicts a DETAIL check's own consequences give: its RuntimeError on every rank, the aborts and
# timeouts that follow, the ranks it leaves silent
REFINED_CLASSES = ("collective_mismatch", "collective_desync", "collective_timeout", "hang", "silent_exit",
                   "unknown", "python_exception", "abort")  # fmt: skip


def fingerprint_reports(ctx: Context) -> list[FingerprintReport]:
    lines = [*(line for ev in ctx.evidence.ranks for line in ev.lines), *ctx.evidence.unranked]
    return list(dict.fromkeys(line.fingerprint for line in lines if line.fingerprint is not None))


def detail_fingerprints(ctx: Context, verdict: Diagnosis, rules: Callable[[Context], Diagnosis]) -> Diagnosis | None:
    """``collective_desync`` / ``collective_mismatch`` from TORCH_DISTRIBUTED_DEBUG=DETAIL's reports, in place
    of a verdict the check's own consequences gave (its RuntimeError on every rank, the timeouts and aborts
    after it). Another op on the two sides of a report is a desync, the same op (other sequence numbers or
    sizes) a mismatch. The rank is the one behind all the others (the lowest sequence number, alone), else the one that
    two or more reporting ranks all name; it is named when the rules, told so as a vote of its peers, name it
    too. With no such rank (two ranks that name each other), no rank is named and both sides are said."""
    if verdict.failure_class not in REFINED_CLASSES:
        return None
    reports = fingerprint_reports(ctx)
    if not reports:
        return None
    seq: dict[int, int] = {}
    ops: dict[int, str] = {}
    for rep in reports:
        for rank, s, op in ((rep.rank, rep.seq, rep.op), (rep.other, rep.other_seq, rep.other_op)):
            if rank is not None and s is not None:
                seq.setdefault(rank, s)
            if rank is not None and op is not None:
                ops.setdefault(rank, op)
    # torch 1.x "running inconsistent collective" names one side only
    desync = any(r.other_op is not None and r.op != r.other_op for r in reports) or any(
        r.other is None for r in reports
    )
    cls = "collective_desync" if desync else "collective_mismatch"
    sig = ctx.taxonomy.get("collective-schedule-diverged" if desync else "collective-mismatch")
    culprit, why = None, ""
    lowest = min(seq.values()) if len(seq) >= 2 else None
    behind = [r for r, s in seq.items() if s == lowest]
    if lowest is not None and len(behind) == 1:
        culprit = behind[0]
        why = (f"rank {culprit} is at collective #{lowest} while ranks {sorted(r for r in seq if r != culprit)} are "
               f"at #{max(seq.values())}: it is behind them")  # fmt: skip
    else:
        named = {r.other for r in reports if r.other is not None}
        reporters = {r.rank for r in reports}
        if len(named) == 1 and len(reporters) >= 2 and not named & reporters:
            culprit = next(iter(named))
            why = f"ranks {sorted(reporters)} all found their collective differs from rank {culprit}'s"
    sides = [f"rank {r}: " + (f"#{seq[r]} " if r in seq else "") + ops.get(r, "?") for r in sorted(set(seq) | set(ops))]
    if culprit is None:
        summary = (
            "TORCH_DISTRIBUTED_DEBUG=DETAIL found the ranks calling different collectives ("
            + "; ".join(sides[:6])
            + "), but the reports do not tell which side left the schedule (the ranks name each other), so no "
            "rank is named: compare the code paths of the sides at that point (a collective on one rank's path "
            "only: a checkpoint save, an evaluation, a data-dependent branch)."
        )
        roles: dict[int, Role] = {r: "unknown" for r in ctx.findings}
        return unattributed(sig, cls, summary, tuple(sides), roles)
    if verdict.initiating_rank == culprit and verdict.failure_class == cls:
        return None
    line = f"TORCH_DISTRIBUTED_DEBUG=DETAIL: {why} (" + "; ".join(sides[:6]) + ")"
    named_verdict = rules(with_vote(ctx, culprit, sig, line))
    if named_verdict.initiating_rank != culprit:
        return None
    return replace(named_verdict, failure_class=cls, signature_id=sig.id, fix=sig.fix, verify=sig.verify)
