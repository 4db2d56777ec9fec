"""Requeue: the exit status that asks the scheduler for a fresh allocation.

A retryable failure that no restart can mend on this allocation (torch's ``--max-restarts`` used up,
the restart gate refused or a verification control failed, a node lost) exits with the user's
``--diag-requeue-exit-code`` so that Slurm's ``RequeueExit=`` (or a retry loop around the launch)
requeues the job. A deterministic failure (a desync, a plain exception of the training code) never
gets it: a new allocation would fail the same way. A job stopped from outside exits 128 + the
signal's number as before; the scheduler that stopped it decides on its own about requeueing.

Pure: the verdicts in, a :class:`RequeueDecision` out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from elastic_diag.core.verdict import Diagnosis

NODE_LOST = "node-lost"
# the same code takes the same branch again (the restart gate's own list: gate.policy, a test keeps them equal)
DETERMINISTIC_CLASSES = ("collective_desync", "collective_mismatch")


@dataclass(frozen=True, slots=True)
class RequeueDecision:
    requeue: bool
    reason: str
    exit_code: int | None  # the status the launcher exits with when ``requeue``

    def to_json(self) -> dict[str, Any]:
        return {"requeue": self.requeue, "exit_code": self.exit_code if self.requeue else None, "reason": self.reason}


def requeue_decision(
    status: str,
    final: Diagnosis | None,
    *,
    own_retryable: bool = False,
    gate: dict[str, Any] | None = None,
    exit_code: int | None,
) -> RequeueDecision:
    """``status``: the run's (report.json ``status``); ``final``: the verdict of its last attempt (or
    of its launch, when no attempt started); ``own_retryable``: the initiating rank's own exception is
    a retryable one; ``gate``: the restart gate's record after the last attempt, if it was asked."""
    if status == "succeeded":
        return RequeueDecision(False, "the job succeeded", exit_code)
    if status == "stopped":
        return RequeueDecision(False, "stopped from outside: the scheduler that sent the signal decides whether "
                                      "to requeue (exit 128 + the signal's number)", exit_code)  # fmt: skip
    if final is None:
        return RequeueDecision(False, "no verdict to judge by", exit_code)
    what = f"{final.failure_class}" + (f" ({final.signature_id})" if final.signature_id else "")
    after = _why_no_restart(gate)
    if final.signature_id == NODE_LOST:
        return RequeueDecision(True, f"a node was lost ({what}){after}: a new allocation can run it", exit_code)
    if final.failure_class in DETERMINISTIC_CLASSES and not own_retryable:
        return RequeueDecision(False, f"{what} is deterministic: a new allocation would fail the same way", exit_code)
    if final.retryable is True or own_retryable:
        return RequeueDecision(True, f"{what} is retryable{after}: a new allocation may not meet it", exit_code)
    return RequeueDecision(False, f"{what} is not known to be retryable: requeueing would likely repeat it",
                           exit_code)  # fmt: skip


def _why_no_restart(gate: dict[str, Any] | None) -> str:
    if gate is None:
        return " and no restart is left here"
    if gate.get("verification_failed"):
        return " and a verification control failed on this allocation"
    if gate.get("decision") != "restart":
        return f" and the restart gate refused a restart here ({gate.get('reason')})"
    return ""
