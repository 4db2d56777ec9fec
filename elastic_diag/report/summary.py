"""The terminal summary a run ends with: the verdict, the decisive lines, the ranks (a row a rank up to
eight, then a row a story), the fix, the verify command, and where the evidence and the page are.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from elastic_diag.core.verdict import format_ranks
from elastic_diag.layout import HTML_FILE
from elastic_diag.report.rank_story import group_rows, rank_rows, short_location
from elastic_diag.report.terminal import ROLE_STYLE, Paint, is_tty, shown, shown_data, table, wants_colour

TABLE_PER_RANK = 8  # the terminal's table: a row a rank up to this many, then a row a story


def format_summary(report: dict[str, Any], report_path: str, *, paint: Paint | None = None,
                   compact_table: bool = False, unwritten: Mapping[str, str] | None = None) -> str:  # fmt: skip
    """The few lines a person reads first, at the end of the run. On a terminal (``compact_table``,
    ``paint`` with colour) the ranks come as a table of stories instead of one line of roles. Every text in
    it is what the ranks printed, or made from it: secrets masked and control characters escaped first.
    ``unwritten``: the report files whose last write failed, and why (a full disk): named only where one is on disk."""
    paint = paint or Paint(False)
    report, report_path = shown_data(report), shown(report_path)
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
        if report["status"] == "stopped":  # signalled from outside: no rank failed
            stopped = paint("elastic_diag: job STOPPED from outside: ", "bold", "yellow")
            lines.append(stopped + paint("no rank failed", "bold"))
        else:
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
        checklist = report.get("checklist") or {}
        first = checklist.get("first_occurrence") or {}
        if first.get("found"):
            where = str(first.get("file")) + (f":{first['line_number']}" if first.get("line_number") else "")
            lines.append(f"  first occurrence: rank {first.get('rank')}, {where} (with the lines before it)")
        if d.get("verify"):
            lines.append(paint("  verify: ", "bold") + str(d["verify"]))
            lines.append(
                "    (exit 0 once the fix works; `elastic-diag verify DIAG_DIR` runs it and records the outcome)"
            )
        resume = checklist.get("resume") or {}
        if resume.get("found") and resume.get("command"):
            lines.append(paint("  resume (after the verification passes): ", "bold") + str(resume["command"]))
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
    named, failed = [], []
    for label, path in (("report", report_path), ("page", page)):
        why = (unwritten or {}).get(path)
        if why is None:
            named.append(f"{label}: {path}")
        elif os.path.isfile(path):
            named.append(f"{label}: {path}, an earlier state")
            failed.append(f"{path}: its last update ({why})")
        else:
            failed.append(f"{path} ({why})")
    lines.append(f"  evidence: {report['diag_dir']}" + (f"  ({'; '.join(named)})" if named else ""))
    if failed:
        lines.append(paint("  not written: ", "bold", "yellow") + "; ".join(failed))
    return "\n".join(lines)


def print_summary(
    report: dict[str, Any], report_path: str, stream: Any = None, unwritten: Mapping[str, str] | None = None
) -> None:
    """The summary on ``stream`` (stderr), with colour and a table when it is a terminal."""
    import sys

    stream = stream if stream is not None else sys.stderr
    text = format_summary(report, report_path, paint=Paint(wants_colour(stream)), compact_table=is_tty(stream),
                          unwritten=unwritten)  # fmt: skip
    print(text, file=stream)
