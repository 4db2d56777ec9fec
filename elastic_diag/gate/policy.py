"""The restart gate: restart from the checkpoint only after a verification control passed, and never
into the same deterministic failure again.

torchrun's ``--max-restarts`` restarts whatever killed the group. Here, after an attempt failed and
torch still has restarts left, the agent asks a **policy** (the diagnosis and the history of attempts
in, a :class:`Decision` out). When the policy allows a restart and asks for verification, the
**controls** run (``--diag-verify``: built-ins or the user's command), with retries, backoff and a
deadline (tenacity). The restart happens only if every control passed; otherwise the agent sets
torch's remaining restarts to 0 and the run ends with a distinct exit status (errors.py).

Built-in policies: ``never``, ``always`` (torchrun's behaviour, no verification), ``verified``
(the default, :func:`verified`). A user policy is ``module:callable`` (:func:`load_policy`).

The policies are pure (this module); the controls are effects at the edge (:mod:`elastic_diag.gate.controls`).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from elastic_diag.errors import UsageError

DETERMINISTIC_CLASSES = ("collective_desync", "collective_mismatch")


@dataclass(frozen=True, slots=True)
class AttemptOutcome:
    """What the gate knows of one failed attempt."""

    attempt: int
    failure_class: str
    signature_id: str | None = None
    initiating_rank: int | None = None
    exception_type: str | None = None
    location: str | None = None  # file:line of the initiating rank's failure
    retryable: bool | None = None
    checkpoint: str | None = None  # the latest checkpoint (path and mtime) when the attempt ended
    # the initiating rank's own exception is retryable (a ConnectionError, a TimeoutError, an I/O error):
    # stronger than what the verdict's class says when that class was inferred from the other ranks
    own_retryable: bool = False

    @property
    def identity(self) -> tuple[object, ...]:
        """Two failures with the same identity are the same failure."""
        return (self.failure_class, self.signature_id, self.exception_type, self.location)

    def describe(self) -> str:
        what = self.exception_type or self.signature_id or self.failure_class
        where = f" at {self.location}" if self.location else ""
        rank = f" on rank {self.initiating_rank}" if self.initiating_rank is not None else ""
        return f"{self.failure_class} ({what}){rank}{where}"


@dataclass(frozen=True, slots=True)
class Decision:
    restart: bool
    reason: str
    verify: bool = True  # run the verification controls before restarting


class RestartPolicy(Protocol):
    """``history`` holds every failed attempt so far, the one just failed last."""

    def __call__(self, history: Sequence[AttemptOutcome]) -> Decision: ...


def never(history: Sequence[AttemptOutcome]) -> Decision:
    return Decision(False, "the restart policy is 'never'")


def always(history: Sequence[AttemptOutcome]) -> Decision:
    return Decision(True, "the restart policy is 'always' (torchrun's own behaviour, no verification)", verify=False)


def verified(history: Sequence[AttemptOutcome]) -> Decision:
    """The default policy.

    * a collective desync or mismatch is deterministic (the same code takes the same branch): no
      restart, unless the initiating rank's own exception is a retryable one (its own evidence is
      stronger than an inference from the others' schedules);
    * a failure that repeats the previous attempt's (same class, signature, exception type and
      place) is not restarted into again unless the checkpoint advanced in between;
    * a failure whose signature is not known to be retryable gets one retry at most;
    * otherwise restart, once the verification controls pass.
    """
    last = history[-1]
    if last.failure_class in DETERMINISTIC_CLASSES and not last.own_retryable:
        return Decision(False, f"{last.describe()} is deterministic: the same code would part the same way again")
    if len(history) >= 2:
        prev = history[-2]
        if prev.identity == last.identity:
            if last.checkpoint is None or last.checkpoint == prev.checkpoint:
                return Decision(False, f"the same failure as attempt {prev.attempt} ({last.describe()}) and the "
                                       "checkpoint did not advance in between: restarting would repeat it")  # fmt: skip
            return Decision(True, f"the same failure as attempt {prev.attempt}, but the checkpoint advanced")
    if last.retryable is not True and not last.own_retryable:
        earlier = [h for h in history[:-1] if h.retryable is not True and not h.own_retryable]
        if earlier:
            return Decision(False, f"{last.describe()} is not known to be retryable and attempt {earlier[-1].attempt} "
                                   "already used the one retry such failures get")  # fmt: skip
        return Decision(True, f"{last.describe()} is not known to be retryable: one retry, after verification")
    if last.own_retryable and last.retryable is not True:
        return Decision(True, f"{last.describe()}: the initiating rank's own exception is retryable: restart after "
                              "verification")  # fmt: skip
    return Decision(True, f"{last.describe()} is retryable: restart after verification")


BUILTIN_POLICIES: dict[str, RestartPolicy] = {"never": never, "always": always, "verified": verified}


def load_policy(spec: str) -> RestartPolicy:
    """A built-in name or ``module:callable``; a UsageError names what is wrong."""
    if spec in BUILTIN_POLICIES:
        return BUILTIN_POLICIES[spec]
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise UsageError(f"--diag-restart-policy {spec!r}: expected never, always, verified or module:callable")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        why = f"{type(e).__name__}: {e}"
        raise UsageError(f"--diag-restart-policy {spec!r}: cannot import {module_name!r}: {why}") from e
    obj: Any = module
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise UsageError(f"--diag-restart-policy {spec!r}: {module_name!r} has no attribute {attr!r}")
    if not callable(obj):
        raise UsageError(f"--diag-restart-policy {spec!r}: {attr!r} is not callable")
    policy: RestartPolicy = obj
    return policy


def ask_policy(policy: RestartPolicy, history: Sequence[AttemptOutcome]) -> Decision:
    """The policy's decision; a policy that raises or returns something else refuses the restart."""
    try:
        decision = policy(history)
    except Exception as e:
        return Decision(False, f"the restart policy raised {type(e).__name__}: {e} (no restart)")
    if not isinstance(decision, Decision):
        return Decision(False, f"the restart policy returned {type(decision).__name__}, not a Decision (no restart)")
    return decision


@dataclass(slots=True, kw_only=True)
class GateRecord:
    """The gate's decision on one failed attempt: report.json's ``attempts[].gate``, and what the agent of
    group rank 0 publishes for the other nodes to follow."""

    attempt: int
    policy: str  # the policy's name (--diag-restart-policy)
    failure: str  # AttemptOutcome.describe()
    reason: str
    decision: Literal["restart", "refused"] = "refused"
    controls: list[dict[str, Any]] = field(default_factory=list)  # ControlResult.to_json() of each control run
    verification_failed: bool = False
    resume_from: str | None = None  # the checkpoint the next attempt resumes from (a restart only)
    decided_by: str | None = None  # "group rank 0" when this node followed the leader's decision

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"attempt": self.attempt, "policy": self.policy, "failure": self.failure,
                               "reason": self.reason, "controls": self.controls, "decision": self.decision,
                               "verification_failed": self.verification_failed}  # fmt: skip
        if self.decision == "restart":
            out["resume_from"] = self.resume_from
        if self.decided_by is not None:
            out["decided_by"] = self.decided_by
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> GateRecord:
        """A record published by another node (raises KeyError / TypeError / ValueError on a bad one)."""
        decision = data["decision"]
        if decision not in ("restart", "refused"):
            raise ValueError(f"decision {decision!r}")
        return cls(attempt=int(data["attempt"]), policy=str(data["policy"]), failure=str(data["failure"]),
                   reason=str(data["reason"]), decision=decision, controls=list(data.get("controls") or []),
                   verification_failed=bool(data.get("verification_failed")), resume_from=data.get("resume_from"),
                   decided_by=data.get("decided_by"))  # fmt: skip


__all__ = ["BUILTIN_POLICIES", "DETERMINISTIC_CLASSES", "AttemptOutcome", "Decision", "GateRecord", "RestartPolicy",
           "always", "ask_policy", "load_policy", "never", "verified"]  # fmt: skip
