"""The verdict on one attempt (:class:`Diagnosis`, report.json's ``diagnosis``) and the phrases its
summaries are written with. Pure data and text: no torch, no I/O."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, get_args

# a rank's part in one failed attempt (report.json ranks[].role)
Role = Literal["initiating", "collateral", "stopped", "healthy", "unknown"]
ROLES: tuple[Role, ...] = get_args(Role)
# an attempt's end (report.json attempts[].status), and the run's (report.json status; "running" until it ends)
AttemptStatus = Literal["succeeded", "failed"]
RunStatus = Literal["running", "succeeded", "failed", "stopped"]


def as_role(value: object) -> Role:
    """A role read back from JSON (another node's record): one of :data:`ROLES`, else ``unknown``."""
    for role in ROLES:
        if value == role:
            return role
    return "unknown"


MAX_EVIDENCE_LINES = 8


@dataclass(frozen=True, slots=True, kw_only=True)
class Diagnosis:
    failure_class: str
    initiating_rank: int | None = None
    initiating_node: str | None = None
    exception_type: str | None = None
    signature_id: str | None = None
    summary: str = ""
    evidence: tuple[str, ...] = ()
    fix: str | None = None
    verify: str | None = None
    collateral_ranks: tuple[int, ...] = ()
    roles: dict[int, Role] = field(default_factory=dict)
    retryable: bool | None = None
    collective: dict[str, object] | None = None  # where the schedules part (desync / mismatch / missing)
    rule: str | None = None  # the attribution rule that decided (docs/attribution.md)
    all_ranks: bool = False  # every rank failed the same way: no rank is named
    # no rank is proven but one stands out (initiating_rank stays None): the odd one out of a desync
    # with no majority, the only rank missing among the waiters; with the reason, in words
    suspected_rank: int | None = None
    suspected_reason: str | None = None

    def to_json(self) -> dict[str, object]:
        extra: dict[str, object] = {"collective": self.collective} if self.collective else {}
        if self.suspected_rank is not None:
            extra |= {"suspected_rank": self.suspected_rank, "suspected_reason": self.suspected_reason}
        return {
            "failure_class": self.failure_class,
            "initiating_rank": self.initiating_rank,
            "initiating_node": self.initiating_node,
            "exception_type": self.exception_type,
            "signature_id": self.signature_id,
            "summary": self.summary,
            "evidence": list(self.evidence),
            "fix": self.fix,
            "verify": self.verify,
            "collateral_ranks": list(self.collateral_ranks),
            "rule": self.rule,
            "all_ranks": self.all_ranks,
            **extra,
        }


HEALTHY = Diagnosis(failure_class="healthy", summary="All ranks finished successfully.")


def stopped_from_outside(
    signal_name: str,
    step: int | None,
    ranks: list[int],
    *,
    holdouts: Sequence[tuple[int, str | None]] = (),
    grace_s: float = 5.0,
) -> Diagnosis:
    """The launcher itself got SIGTERM or SIGINT (scancel, a time limit, preemption, an eviction, Ctrl-C)
    and passed it on to every rank: no rank failed, nobody in the job is to blame. ``holdouts``: the
    ranks still alive when the grace ended, with where their stacks were (a save that blocked)."""
    at = f" at step {step}" if step is not None else ""
    who = f"ranks {format_ranks(ranks)}" if ranks else "the ranks"
    held = ""
    evidence = [f"the launcher received {signal_name}"]
    if holdouts:
        subject = ranks_phrase([r for r, _ in holdouts])
        places = "; ".join(
            (f"rank {r} " if len(holdouts) > 1 else "") + f"in {where}" for r, where in holdouts if where
        )
        held = (
            f" {subject} did not exit within {grace_s:g} s of it"
            + (f" ({places})" if places else "")
            + ": its stack is in the report; torch then killed it (SIGKILL after its shutdown timeout)."
        )
        evidence += [f"rank {r}: still running {grace_s:g} s after {signal_name}" + (f", in {w}" if w else "")
                     for r, w in holdouts]  # fmt: skip
    return Diagnosis(
        failure_class="killed",
        summary=(
            f"Stopped from outside by {signal_name}{at}: the launcher received it and passed it on to {who}, "
            "as torchrun does. No rank failed on its own. If nobody stopped the job by hand, the scheduler did "
            "(scancel, a time limit, preemption, a Kubernetes eviction): its log says which." + held
        ),
        evidence=tuple(evidence[:MAX_EVIDENCE_LINES]),
        fix="Resume from the last checkpoint; if a time limit stopped it, ask for more time or checkpoint more often."
        + (
            " A rank that does not exit on SIGTERM loses its work at SIGKILL: make its signal handler finish "
            "(or skip) the save within the scheduler's kill wait (Slurm KillWait, Kubernetes "
            "terminationGracePeriodSeconds)."
            if holdouts
            else ""
        ),
        verify="<relaunch>  # with nothing stopping it, the job must pass the step it had reached",
        rule="stopped_from_outside",
        retryable=True,
    )


def format_ranks(ranks: list[int]) -> str:
    """``0-736, 738-1023``: runs of three or more consecutive ranks as ranges (summaries of big jobs)."""
    if not ranks:
        return "none"
    parts: list[str] = []
    values = sorted(set(ranks))
    start = prev = values[0]
    for r in [*values[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        parts.append(f"{start}-{prev}" if prev - start >= 2 else ", ".join(str(x) for x in range(start, prev + 1)))
        if r is not None:
            start = prev = r
    return ", ".join(parts)


def ranks_phrase(ranks: list[int]) -> str:
    """``Rank 3`` or ``Ranks 0, 1, 3``: the subject of a summary's sentence; a scattered set (one local
    rank of every node) as ``895 ranks (0-6, 8-14, ...)``, so a summary stays a few lines long."""
    if len(ranks) == 1:
        return f"Rank {ranks[0]}"
    listed = format_ranks(ranks)
    if len(listed) > 60:
        return f"{len(ranks)} ranks ({listed[:60].rsplit(',', 1)[0]}, ...)"
    return f"Ranks {listed}"


def were(ranks: list[int]) -> str:
    return "was" if len(ranks) == 1 else "were"
