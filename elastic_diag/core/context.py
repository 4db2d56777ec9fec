"""What every attribution rule sees of one attempt: the evidence, every rank's finding, the comparison of
the flight recorders, the ranks named by their peers' lines (the votes), and the ranks sorted into those
that failed on their own, those that failed of a symptom and those still alive. Pure.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from elastic_diag.core.evidence import AttemptEvidence, RankEvidence
from elastic_diag.core.findings import RankFinding, examine_rank
from elastic_diag.core.flight_recorder import Divergence, compare
from elastic_diag.core.taxonomy import Signature, Taxonomy
from elastic_diag.core.verdict import Diagnosis

# gloo aborts the rank that RECEIVED more than its tensor holds, before any dump: its smaller side
RECEIVED_TOO_MUCH = "gloo-received-size-mismatch"

Vote = tuple[int, Signature, str]  # (the rank named, the signature of the line naming it, the line)


@dataclass(frozen=True, slots=True, kw_only=True)
class Context:
    """What every rule sees of one attempt."""

    evidence: AttemptEvidence
    findings: dict[int, RankFinding]
    taxonomy: Taxonomy
    schedule: Divergence | None  # where the flight recorders' schedules part, if they do
    votes: dict[int, list[tuple[Signature, str]]]  # ranks named by their peers' lines (and the VOTES' checks)
    own: tuple[RankFinding, ...]  # ranks that failed on their own, the earliest first
    symptoms: tuple[RankFinding, ...]  # ranks that failed with a peer's symptom, the earliest first
    alive: tuple[RankFinding, ...]  # alive or stopped at the verdict, with no failure of their own
    failing: bool  # a rank failed, the health monitor raised an alarm, or offline records compare
    extra_votes: tuple[Vote, ...] = ()  # the votes of checks across ranks (kept to rebuild the context)

    def ev(self, rank: int) -> RankEvidence:
        return next(e for e in self.evidence.ranks if e.rank == rank)


Rule = Callable[[Context], Diagnosis | None]


def _order(f: RankFinding) -> tuple[float, float, int]:
    """Earliest first: by the time its failure began, else (lines of a log with no times) by where its first
    error line was read."""
    return (f.time if f.time is not None else float("inf"), f.order if f.order is not None else float("inf"), f.rank)


def build_context(evidence: AttemptEvidence, taxonomy: Taxonomy, extra_votes: list[Vote] | None = None) -> Context:
    """Every rank's finding, the flight recorders compared, and the votes: the peers' lines naming a rank,
    and ``extra_votes`` (checks across ranks that no single line shows)."""
    findings = {ev.rank: examine_rank(ev, taxonomy, evidence.decided_at) for ev in evidence.ranks}
    records = {ev.rank: ev.flight_record for ev in evidence.ranks if ev.flight_record is not None}
    receivers = [r for r, f in findings.items() if f.signature is not None and f.signature.id == RECEIVED_TOO_MUCH]
    schedule = compare(records, sorted(findings), receivers).divergence if records else None
    failed = [f for f in findings.values() if f.state == "failed"]
    offline_records = schedule is not None and all(f.state != "succeeded" for f in findings.values())
    votes: dict[int, list[tuple[Signature, str]]] = {}
    for f in findings.values():
        for r, vote_sig, line in f.named:
            if r != f.rank and r in findings and not vote_sig.wraps:
                votes.setdefault(r, []).append((vote_sig, line))
    for r, vote_sig, line in extra_votes or ():
        if r in findings:
            votes.setdefault(r, []).append((vote_sig, line))
    return Context(
        evidence=evidence,
        findings=findings,
        taxonomy=taxonomy,
        schedule=schedule,
        votes=votes,
        own=tuple(sorted((f for f in findings.values() if f.own), key=_order)),
        symptoms=tuple(sorted((f for f in failed if not f.own and f.hint == "collateral"), key=_order)),
        alive=tuple(
            f for f in findings.values() if f.state == "alive" and not f.own and f.hint != "collateral"
        ),  # fmt: skip
        failing=bool(failed) or evidence.hang is not None or offline_records or any(f.own for f in findings.values()),
        extra_votes=tuple(extra_votes or ()),
    )


def with_vote(ctx: Context, rank: int, sig: Signature, line: str) -> Context:
    """The context with one more vote naming ``rank`` (among the ranks, with no evidence of its own, if it
    was not): what the rules conclude once a check across ranks names it."""
    evidence = ctx.evidence
    if evidence.rank(rank) is None:
        ranks = (*evidence.ranks, RankEvidence(rank=rank, local_rank=rank, node=""))
        evidence = replace(evidence, ranks=tuple(sorted(ranks, key=lambda ev: ev.rank)))
    return build_context(evidence, ctx.taxonomy, [*ctx.extra_votes, (rank, sig, line)])
