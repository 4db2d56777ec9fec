"""What every attribution rule sees of one attempt: the evidence, every rank's finding, the comparison
of the flight recorders, the ranks named by their peers' lines, and the ranks sorted into those that
failed on their own, those that failed of a symptom and those still alive. Pure.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from elastic_diag.core.evidence import AttemptEvidence, RankEvidence
from elastic_diag.core.findings import RankFinding
from elastic_diag.core.flight_recorder import Finding
from elastic_diag.core.taxonomy import Signature, Taxonomy
from elastic_diag.core.verdict import Diagnosis


@dataclass(frozen=True, slots=True, kw_only=True)
class Context:
    """What every rule sees of one attempt."""

    evidence: AttemptEvidence
    findings: dict[int, RankFinding]
    taxonomy: Taxonomy
    schedule: Finding | None  # where the flight recorders' schedules part, if they do
    votes: dict[int, list[tuple[Signature, str]]]  # ranks named by their peers' lines (and extra checks)
    own: tuple[RankFinding, ...]  # ranks that failed on their own, the earliest first
    symptoms: tuple[RankFinding, ...]  # ranks that failed with a peer's symptom, the earliest first
    alive: tuple[RankFinding, ...]  # alive or stopped at the verdict, with no failure of their own
    failing: bool  # a rank failed, the health monitor raised an alarm, or offline records compare

    def ev(self, rank: int) -> RankEvidence:
        return next(e for e in self.evidence.ranks if e.rank == rank)


Rule = Callable[[Context], Diagnosis | None]


def _order(f: RankFinding) -> tuple[float, int]:
    return (f.time if f.time is not None else float("inf"), f.rank)


def build_context(
    evidence: AttemptEvidence,
    findings: dict[int, RankFinding],
    taxonomy: Taxonomy,
    schedule: Finding | None,
    extra_votes: list[tuple[int, Signature, str]] | None = None,
) -> Context:
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
            f for f in findings.values() if f.state in ("alive", "stopped") and not f.own and f.hint != "collateral"
        ),  # fmt: skip
        failing=bool(failed) or evidence.hang is not None or offline_records or any(f.own for f in findings.values()),
    )
