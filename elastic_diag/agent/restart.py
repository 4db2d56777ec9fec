"""RestartGate: what the agent does when torch would restart the group.

torch restarts whatever killed the group while ``--max-restarts`` lasts. The gate asks the restart
policy first (:mod:`elastic_diag.gate.policy`: the failure, and every failure before it, in; a
Decision out), runs the verification controls the policy asks for (:mod:`elastic_diag.gate.controls`,
their output kept in ``attempt_N/gate/``), and returns one record of the decision. With several nodes,
the agent of group rank 0 decides and publishes the record through the rendezvous store; the others
follow it (bounded by the controls' worst case, then they decide alone). On a restart the next
attempt's ranks find ``ELASTIC_DIAG_RESUME_FROM`` (the newest checkpoint) and
``ELASTIC_DIAG_PREVIOUS_DIAGNOSIS`` in their environment (:func:`resume_env`).
"""

from __future__ import annotations

import json
import logging
from datetime import timedelta
from pathlib import Path
from typing import Protocol

from elastic_diag.core.evidence import AttemptEvidence
from elastic_diag.core.findings import retryable_own_failure
from elastic_diag.core.taxonomy import load_taxonomy
from elastic_diag.core.verdict import Diagnosis
from elastic_diag.gate import controls, policy
from elastic_diag.gate.policy import AttemptOutcome, GateRecord
from elastic_diag.layout import (
    ENV_PREVIOUS_DIAGNOSIS,
    ENV_RESUME_FROM,
    GATE_DIR,
    attempt_dir_name,
    latest_checkpoint,
    make_private_dir,
    write_atomic,
)
from elastic_diag.report.session import DiagSession

logger = logging.getLogger(__name__)


class Store(Protocol):
    """What the gate needs of torch's rendezvous store (``worker_group.store``)."""

    def set(self, key: str, value: str) -> None: ...

    def get(self, key: str) -> bytes: ...

    def wait(self, keys: list[str], timeout: timedelta) -> None: ...


class RestartGate:
    """The restart decisions of one run: the history of its failed attempts, and the session they go to."""

    def __init__(self, session: DiagSession) -> None:
        self.session = session
        self.history: list[AttemptOutcome] = []

    def decide(self, attempt: int, *, nproc: int, nodes: int = 1, group_rank: int = 0,
               store: Store | None = None) -> tuple[GateRecord, Diagnosis]:  # fmt: skip
        """The decision on a restart after ``attempt`` failed, and the verdict it was taken on."""
        if nodes > 1 and group_rank != 0 and store is not None:
            followed = self._follow(store, attempt)
            if followed is not None:
                return followed, Diagnosis(failure_class="unknown")
        record = self.session.attempts.get(attempt)
        diagnosis = record.diagnosis if record is not None else Diagnosis(failure_class="unknown")
        evidence = record.evidence if record is not None else None
        config = self.session.config
        outcome = outcome_of(attempt, diagnosis, evidence, config.checkpoint_dir)
        self.history.append(outcome)
        decision = policy.ask_policy(self.session.policy or policy.verified, self.history)
        gate = GateRecord(attempt=attempt, policy=config.restart_policy, failure=outcome.describe(),
                          reason=decision.reason)  # fmt: skip
        if decision.restart and decision.verify:
            failed = self._verify(attempt, nproc, diagnosis, outcome, gate)
            if failed is not None:
                gate.verification_failed = True
                decision = policy.Decision(False, f"verification failed: {failed.name}: {failed.summary}")
        gate.decision = "restart" if decision.restart else "refused"
        gate.reason = decision.reason
        if decision.restart:
            gate.resume_from = str(latest_checkpoint(config.checkpoint_dir) or "") or None
        if nodes > 1 and store is not None:
            with self.session.guard("publishing the restart decision to the other nodes"):
                store.set(self._key(attempt), json.dumps(gate.to_json()))
        return gate, diagnosis

    def _verify(self, attempt: int, nproc: int, diagnosis: Diagnosis, outcome: AttemptOutcome,
                gate: GateRecord) -> controls.ControlResult | None:  # fmt: skip
        """Run the controls, keep each one's output and record; the first that failed, or None."""
        config = self.session.config
        specs = list(config.verify) or controls.default_controls(config.checkpoint_dir)
        out_dir = config.diag_dir / attempt_dir_name(attempt) / GATE_DIR
        make_private_dir(out_dir)
        ctx = controls.ControlContext(nproc=nproc, out_dir=out_dir, checkpoint_dir=config.checkpoint_dir,
                                      timeout_s=config.verify_timeout_s, retries=config.verify_retries,
                                      signature_patterns=_signature_patterns(diagnosis.signature_id))  # fmt: skip
        logger.warning("elastic_diag: attempt %s failed (%s); verifying before restart: %s", attempt,
                       outcome.describe(), ", ".join(specs))  # fmt: skip
        results = controls.verify(specs, ctx)
        for i, r in enumerate(results):
            out_file = out_dir / f"control_{i}_{_slug(r.name)}.log"
            try:
                write_atomic(out_file, r.output)  # masked
                kept: str | None = str(out_file)
            except OSError:
                kept = None
            gate.controls.append(r.to_json(kept))
        return next((r for r in results if not r.passed), None)

    def _key(self, attempt: int) -> str:
        return f"elastic_diag/gate/{self.session.run_id}/{attempt}"

    def _follow(self, store: Store, attempt: int) -> GateRecord | None:
        """The decision of the agent of group rank 0, or None (then this agent decides alone) when it
        does not come within the controls' worst-case time, or is not a decision."""
        config = self.session.config
        wait_s = config.verify_timeout_s * (config.verify_retries + 1) * max(1, len(config.verify) or 3) + 60
        try:
            store.wait([self._key(attempt)], timedelta(seconds=wait_s))
            gate = GateRecord.from_json(json.loads(store.get(self._key(attempt))))
        except Exception as e:
            self.session.note(f"attempt {attempt}: no restart decision from group rank 0 ({e}); decided locally")
            return None
        gate.decided_by = "group rank 0"
        return gate


def resume_env(session: DiagSession, attempt: int, diagnosis: Diagnosis) -> dict[str, str]:
    """What the next attempt's ranks find in their environment (DiagLogsSpecs adds it)."""
    latest = latest_checkpoint(session.config.checkpoint_dir)
    return {
        ENV_RESUME_FROM: str(latest) if latest is not None else "",
        ENV_PREVIOUS_DIAGNOSIS: diagnosis_id(session.run_id, attempt, diagnosis),
    }


def _signature_patterns(signature_id: str | None) -> tuple[str, ...]:
    if not signature_id:
        return ()
    try:
        return tuple(p.pattern for p in load_taxonomy().get(signature_id).patterns)
    except Exception:
        return ()


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in text)[:40] or "control"


def diagnosis_id(run_id: str, attempt: int, diagnosis: Diagnosis) -> str:
    """``<run>/attempt_0/python-exception/rank2``: names a verdict in the previous attempt's report."""
    what = diagnosis.signature_id or diagnosis.failure_class
    rank = f"rank{diagnosis.initiating_rank}" if diagnosis.initiating_rank is not None else "rank?"
    return f"{run_id or 'run'}/attempt_{attempt}/{what}/{rank}"


def outcome_of(
    attempt: int, diagnosis: Diagnosis, evidence: AttemptEvidence | None, ckpt: Path | None
) -> AttemptOutcome:
    """What the policy sees of one failed attempt."""
    location = None
    own_retryable = False
    if evidence is not None and diagnosis.initiating_rank is not None:
        ev = next((r for r in evidence.ranks if r.rank == diagnosis.initiating_rank), None)
        location = ev.location() if ev is not None else None
        own_retryable = ev is not None and retryable_own_failure(ev, load_taxonomy()) is not None
    return AttemptOutcome(
        attempt=attempt,
        failure_class=diagnosis.failure_class,
        signature_id=diagnosis.signature_id,
        initiating_rank=diagnosis.initiating_rank,
        exception_type=diagnosis.exception_type,
        location=location,
        retryable=diagnosis.retryable,
        checkpoint=controls.checkpoint_identity(ckpt),
        own_retryable=own_retryable,
    )
