"""report.json (schema ``elastic_diag.report/1``, DESIGN.md section 5) and the terminal summary.

Pure functions from evidence and verdicts to JSON-ready dicts and text; writing is atomic
(a temporary file, then ``os.replace``), so a reader never sees half a report.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elastic_diag.core.classify import Diagnosis, format_ranks
from elastic_diag.core.evidence import AttemptEvidence, RankEvidence
from elastic_diag.core.verdict import AttemptStatus
from elastic_diag.layout import HTML_FILE, REPORT_SCHEMA
from elastic_diag.report.rank_story import group_rows, rank_rows, short_location
from elastic_diag.report.terminal import ROLE_STYLE, Paint, is_tty, table, wants_colour

SCHEMA = REPORT_SCHEMA
TABLE_PER_RANK = 8  # the terminal's table: a row a rank up to this many, then a row a story
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


def rank_entry(ev: RankEvidence, role: str) -> dict[str, Any]:
    stack = None
    if ev.stack is not None:
        stack = ev.stack.text[:STACK_CHARS]
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
    }


def attempt_entry(record: AttemptRecord) -> dict[str, Any]:
    roles = record.diagnosis.roles
    return {
        "attempt": record.evidence.attempt,
        "status": record.status,
        "diagnosis": record.diagnosis.to_json(),
        "ranks": [rank_entry(ev, roles.get(ev.rank, "unknown")) for ev in record.evidence.ranks],
        "final": record.final,
        **({"hang": record.evidence.hang} if record.evidence.hang else {}),
        **({"gate": record.gate} if record.gate else {}),
        "came_up": record.evidence.came_up,
        "decided_at": record.evidence.decided_at,
        **({"nodes": record.cluster} if record.cluster else {}),
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
) -> dict[str, Any]:
    entries = [attempt_entry(a) for a in attempts]
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
    elif launch_diagnosis is not None and (last is None or last["status"] != "failed"):
        diagnosis = launch_diagnosis.to_json()
    elif last is not None:
        diagnosis = dict(last["diagnosis"])
    else:
        diagnosis = Diagnosis(failure_class="unknown", summary="The run ended before any worker started.").to_json()
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
    }


def write_text_atomic(path: Path, text: str) -> None:
    """A temporary file, then ``os.replace``: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    write_text_atomic(path, json.dumps(data, indent=2, default=str) + "\n")


def format_summary(report: dict[str, Any], report_path: str, *, paint: Paint | None = None,
                   compact_table: bool = False) -> str:  # fmt: skip
    """The few lines a person reads first, at the end of the run. On a terminal (``compact_table``,
    ``paint`` with colour) the ranks come as a table of stories instead of one line of roles."""
    paint = paint or Paint(False)
    d = report["diagnosis"]
    n = len(report["attempts"])
    lines = []
    if report["status"] == "succeeded":
        extra = f" after {n - 1} failed attempt(s)" if n > 1 else ""
        lines.append(paint(f"elastic_diag: job succeeded{extra}.", "bold", "green"))
        for a in report["attempts"][:-1]:
            ad = a["diagnosis"]
            lines.append(
                f"  attempt {a['attempt']}: {ad['failure_class']}, rank {ad['initiating_rank']}: {ad['summary']}"
            )
    else:
        who = "no rank could be named"
        if d["initiating_rank"] is not None:
            who = f"initiating rank {d['initiating_rank']} on {d['initiating_node']}"
        elif d.get("all_ranks"):
            who = "every rank failed the same way"
        exc = f" ({d['exception_type']})" if d.get("exception_type") else ""
        lines.append(
            paint("elastic_diag: job FAILED: ", "bold", "red") + paint(f"{who}: {d['failure_class']}{exc}", "bold")
        )
        lines.append(f"  {d['summary']}")
        if d["evidence"]:
            lines.append("  decisive lines:")
            lines.extend(f"    {e}" for e in d["evidence"])
        if compact_table and report["ranks"]:
            groups = group_rows(rank_rows(report["ranks"]), per_rank=TABLE_PER_RANK)
            rows = [[g.label, g.first.role, g.first.how, short_location(g.first.location) or g.first.exception]
                    for g in groups]  # fmt: skip
            styles = [ROLE_STYLE.get(g.first.role, ()) for g in groups]
            lines.extend("  " + t for t in table(["ranks", "role", "ended", "where / error"], rows, paint, styles))
        else:
            roles: dict[str, list[int]] = {}
            for r in report["ranks"]:
                roles.setdefault(r["role"], []).append(r["rank"])
            if roles:
                lines.append("  roles: " + "; ".join(f"{k} {format_ranks(v)}" for k, v in sorted(roles.items())))
        if d.get("fix"):
            lines.append(paint("  fix: ", "bold") + " ".join(str(d["fix"]).split()))
        if d.get("verify"):
            lines.append(paint("  verify: ", "bold") + str(d["verify"]))
        if d.get("rule"):
            lines.append(f"  decided by: {d['rule']} (the order of the rules: docs/attribution.md)")
        if n > 1:
            lines.append(f"  attempts: {n} (each has its own verdict in the report)")
            if report["attempts"][-1].get("came_up") is False:
                lines.append(f"  attempt {n - 1} never came up (no collective completed on any rank): the RESTART "
                             "failed, not the job; attempt 0 has the job's own failure")  # fmt: skip
        gate = report["attempts"][-1].get("gate") if report["attempts"] else None
        if gate and gate.get("decision") != "restart":
            lines.append(f"  restart gate: no restart: {gate.get('reason')}")
            for c in gate.get("controls", []):
                lines.append(f"    control {c['name']}: {'passed' if c['passed'] else 'FAILED'}: {c['summary']}"
                             + (f" (output: {c['output_file']})" if c.get("output_file") else ""))  # fmt: skip
    for w in report.get("warnings", []):
        lines.append(paint(f"  warning ({w.get('class')}): {w.get('summary')}", "yellow"))
    for err in report.get("internal_errors", []):
        lines.append(f"  elastic_diag internal error (the job was not affected): {err}")
    page = os.path.join(os.path.dirname(report_path), HTML_FILE)
    lines.append(f"  evidence: {report['diag_dir']}  (report: {report_path}; page: {page})")
    return "\n".join(lines)


def print_summary(report: dict[str, Any], report_path: str, stream: Any = None) -> None:
    """The summary on ``stream`` (stderr), with colour and a table when it is a terminal."""
    import sys

    stream = stream if stream is not None else sys.stderr
    text = format_summary(report, report_path, paint=Paint(wants_colour(stream)), compact_table=is_tty(stream))
    print(text, file=stream)
