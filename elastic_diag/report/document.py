"""report.json (schema ``elastic_diag.report/1``: docs/report.md, ``schemas/report.schema.json``).

Pure functions from evidence and verdicts to JSON-ready dicts; writing is atomic
(a temporary file, then ``os.replace``), so a reader never sees half a report.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elastic_diag.core.evidence import AttemptEvidence, RankEvidence
from elastic_diag.core.schema_ids import REPORT_SCHEMA
from elastic_diag.core.stall import stall_to_json
from elastic_diag.core.verdict import AttemptStatus, Diagnosis
from elastic_diag.core.verification import JobFacts, render_diagnosis
from elastic_diag.layout import read_json, write_json_atomic

SCHEMA = REPORT_SCHEMA
MAX_REPORT_BYTES = 256 << 20
LAST_LINES = 20
STACK_CHARS = 20_000


@dataclass(slots=True)
class AttemptRecord:
    evidence: AttemptEvidence
    diagnosis: Diagnosis
    status: AttemptStatus
    final: bool  # False while the verdict was taken before teardown and not yet refined
    gate: dict[str, Any] | None = None  # the restart gate's decision after this attempt, if it was asked
    cluster: dict[str, Any] | None = None  # several nodes: who reported, clock offset, the local verdict
    environment: dict[str, Any] | None = None  # the snapshot at the first failure (attempt_N/environment.json)


def rank_entry(ev: RankEvidence, role: str) -> dict[str, Any]:
    stack = None
    if ev.stack is not None:
        stack = ev.stack.for_people()[:STACK_CHARS]  # the stuck thread first, the tool's own threads last
    return {
        "rank": ev.rank,
        "local_rank": ev.local_rank,
        "node": ev.node,
        "role": role,
        "exit_code": ev.exit_code,
        "signal": ev.signal,
        "first_error_time": ev.first_error_time if ev.failed or ev.alive_at_decision else None,
        "last_lines": list(ev.stderr_tail[-LAST_LINES:]),
        "stack": stack,
        "pid": ev.pid,
        "exit_time": ev.exit_time,
        "start_time": ev.start_time,
        "last_progress_time": ev.progress_time,
        "steps": ev.steps,
        "location": ev.location(),
        "exception": (
            {
                "type": ev.exception.type,
                "message": ev.exception.message,
                "time": ev.exception.time,
                **({"problems": list(ev.exception.problems)} if ev.exception.problems else {}),
            }
            if ev.exception
            else None
        ),
        "evidence_dir": ev.evidence_dir,
        **({"kernel": ev.kernel.to_json()} if ev.kernel is not None else {}),  # additive: a SIGKILL's kernel evidence
    }


def attempt_entry(record: AttemptRecord, job: JobFacts | None = None) -> dict[str, Any]:
    roles = record.diagnosis.roles
    return {
        "attempt": record.evidence.attempt,
        "status": record.status,
        "diagnosis": render_diagnosis(record.diagnosis.to_json(), job, live=True),
        "ranks": [rank_entry(ev, roles.get(ev.rank, "unknown")) for ev in record.evidence.ranks],
        "final": record.final,
        **({"hang": record.evidence.hang} if record.evidence.hang else {}),
        **({"gate": record.gate} if record.gate else {}),
        "came_up": record.evidence.came_up,
        "decided_at": record.evidence.decided_at,
        **({"nodes": record.cluster} if record.cluster else {}),
        **({"environment": record.environment} if record.environment else {}),
        # additive: the stalls the health monitor recorded, each with its snapshot (attempt_N/stall_K/)
        **({"stalls": [stall_to_json(r) for r in record.evidence.stalls]} if record.evidence.stalls else {}),
    }


def build_report(
    *,
    run_id: str,
    status: str,
    attempts: Sequence[AttemptRecord],
    diag_dir: str,
    node: str,
    launch_diagnosis: Diagnosis | None = None,
    warnings: Sequence[dict[str, Any]] = (),
    internal_errors: Sequence[str] = (),
    notes: Sequence[str] = (),
    job: JobFacts | None = None,
) -> dict[str, Any]:
    """report.json. ``job``: what the verification commands re-run; every ``verify`` is filled in with it
    (core/verification.py), with ``verify_plan`` beside it."""
    entries = [attempt_entry(a, job) for a in attempts]
    last = entries[-1] if entries else None
    if status == "succeeded":
        diagnosis: dict[str, Any] = Diagnosis(
            failure_class="healthy",
            summary=(
                "All ranks finished successfully"
                + (f" after {len(entries) - 1} restart(s)." if len(entries) > 1 else ".")
            ),
            rule="all_succeeded",
        ).to_json()
    elif launch_diagnosis is not None and (last is None or last["status"] != "failed" or status == "stopped"):
        diagnosis = render_diagnosis(launch_diagnosis.to_json(), job, live=True)
    elif last is not None:
        diagnosis = dict(last["diagnosis"])
    else:
        diagnosis = Diagnosis(failure_class="unknown", summary="The run ended before any worker started.").to_json()
    checklist = None
    if status != "succeeded" and attempts:  # the seed's checklist for the attempt that ended the run
        from elastic_diag.report.checklist import run_checklist

        checklist = run_checklist(attempts[-1].evidence, diagnosis, job)
    return {
        "schema": SCHEMA,
        "run_id": run_id,
        "status": status,
        "diagnosis": diagnosis,
        "ranks": last["ranks"] if last else [],
        "warnings": list(warnings),
        "attempts": entries,
        "node": node,
        "diag_dir": diag_dir,
        "internal_errors": list(internal_errors),
        "notes": list(notes),
        **({"launch": job.to_json()} if job is not None else {}),  # additive: what a verification re-runs
        **({"checklist": checklist} if checklist is not None else {}),  # additive: the seed's checklist
    }


def write_report(path: Path, report: dict[str, Any]) -> None:
    """The one writer of report.json (the run's and each attempt's): atomic, this process's secrets masked."""
    write_json_atomic(path, report)


def read_report(path: Path) -> dict[str, Any] | None:
    """A report.json as it is on disk now, for a writer that adds to it (None: missing or not an object)."""
    return read_json(path, MAX_REPORT_BYTES)
