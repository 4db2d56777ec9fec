"""report.html: the report a person looks at, rendered from report.json (pure, no torch).

One self-contained file: inline CSS and SVG, no script, no font, no image, nothing fetched. The
verdict comes first (initiating rank and node, class, fix, verify command), then one section per
attempt with a timeline of every rank (start, last progress, first error, exit, the launcher's
verdict and teardown), the ranks' table, and the evidence of the ranks that matter (their stderr and
the stack taken before teardown).

Readable at any size: up to ``PER_RANK_ROWS`` ranks get a row each; beyond that, ranks with the same
story (role, how they ended, exception, where their code was) share one row, drawn as the span of
their times, so a 1,024-rank job with one culprit is three or four rows. Evidence is shown in full
for the initiating rank and one rank of each story, at most ``EVIDENCE_RANKS``; the others are named
with their folder.

Bad input loses nothing: :func:`load_report_dir` salvages every complete top-level entry of a
truncated report.json, reconstructs the verdict with the offline analyzer when there is none, and
returns the list of what is missing, which the page shows at the top.
"""

from __future__ import annotations

import datetime
import html
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from elastic_diag import redaction
from elastic_diag.core.stall import stall_from_json, stall_summary
from elastic_diag.core.verdict import format_ranks
from elastic_diag.layout import HTML_FILE, REPORT_FILE, write_atomic
from elastic_diag.report.rank_story import Group, RankRow, group_rows, integer, num, rank_rows, text
from elastic_diag.report.reading import load_report_dir
from elastic_diag.report.terminal import printable
from elastic_diag.report.timeline import ROLE_COLOURS, clip, failure_window, timeline_svg

EVIDENCE_RANKS = 12


# -- loading ----------------------------------------------------------------------------------------


# -- the timeline -----------------------------------------------------------------------------------


# -- the page ---------------------------------------------------------------------------------------

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0;color:#1d1d1f;background:#fafafa}
main{max-width:1040px;margin:0 auto;padding:20px}
h1{font-size:20px;margin:0 0 12px}
h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #ddd}
h3{font-size:15px;margin:18px 0 6px}
.verdict{border-left:6px solid #c62828;background:#fff;padding:12px 16px;box-shadow:0 1px 2px #0002}
.verdict.ok{border-color:#2e7d32}
.verdict .who{font-size:18px;font-weight:600}
.cls{display:inline-block;background:#c62828;color:#fff;border-radius:3px;padding:0 6px;font-size:13px}
.verdict.ok .cls{background:#2e7d32}
dl{display:grid;grid-template-columns:110px 1fr;gap:4px 12px;margin:10px 0 0}
dt{color:#555}
dd{margin:0}
code,pre{font:12px/1.4 ui-monospace,SFMono-Regular,Menlo,Consolas,monospace}
pre{background:#f1f1f1;padding:8px;overflow-x:auto;white-space:pre-wrap;max-height:420px;overflow-y:auto}
.cmd{background:#1d1d1f;color:#f5f5f5;padding:6px 8px;display:block;border-radius:3px;white-space:pre-wrap}
table{border-collapse:collapse;width:100%;background:#fff}
th,td{text-align:left;padding:3px 8px;border-bottom:1px solid #e5e5e5;vertical-align:top}
th{background:#f0f0f0}
td code{word-break:break-word}
td.init{font-weight:600;color:#c62828}
.missing{background:#fff4e5;border:1px solid #f0b35b;padding:8px 12px}
.warn{background:#fffbe6;border:1px solid #e6d26a;padding:6px 12px;margin:6px 0}
svg.timeline{background:#fff;border:1px solid #ddd;max-width:100%;height:auto}
svg .grid{stroke:#e3e3e3}
svg .tick{font-size:11px;fill:#666;text-anchor:middle}
svg .stripe{fill:#f7f7f7}
svg .initiating-row{fill:#c6282814}
svg .label{font-size:12px;fill:#222}
svg .how{font-size:10px;fill:#444}
svg .exit{stroke:#111;stroke-width:2}
svg .progress{fill:#1565c0;stroke:#fff}
svg .progress-band{fill:#1565c066}
svg .error{fill:#111;stroke:#fff}
svg .error-band{fill:#1116}
svg .teardown{stroke:#6a1b9a;stroke-width:1.5;stroke-dasharray:5 3}
svg .teardown-label{font-size:11px;fill:#6a1b9a}
.legend span{margin-right:14px;font-size:12px}
.sw{display:inline-block;width:14px;height:8px;margin-right:4px;vertical-align:middle}
details{margin:6px 0;background:#fff;border:1px solid #e5e5e5;padding:4px 10px}
summary{cursor:pointer;font-weight:600}
.muted{color:#666}
"""


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _e(value: Any) -> str:
    return html.escape(printable(text(value)))  # a page can be `cat` to a terminal too


def _when(t: float | None) -> str:
    if t is None:
        return ""
    return datetime.datetime.fromtimestamp(t, tz=datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _verdict(report: dict[str, Any]) -> str:
    d = _dict(report.get("diagnosis"))
    status = text(report.get("status")) or "unknown"
    cls = text(d.get("failure_class")) or "unknown"
    ok = status == "succeeded"
    rank = integer(d.get("initiating_rank"))
    if ok:
        who = "The job succeeded"
    elif rank is not None:
        node = f" on {_e(d.get('initiating_node'))}" if d.get("initiating_node") else ""
        who = f"Initiating rank {rank}{node}"
    elif d.get("all_ranks") is True:
        who = "Every rank failed the same way"
    else:
        who = "No rank could be named"
    exc = f" ({_e(d.get('exception_type'))})" if d.get("exception_type") else ""
    rows = [f"<dt>summary</dt><dd>{_e(d.get('summary'))}</dd>"]
    if d.get("signature_id"):
        rows.append(
            f"<dt>signature</dt><dd><code>{_e(d['signature_id'])}</code> "
            f'<span class="muted">(<code>elastic-diag explain {_e(d["signature_id"])}</code>)</span></dd>'
        )
    if d.get("fix"):
        rows.append(f"<dt>fix</dt><dd>{_e(' '.join(str(d['fix']).split()))}</dd>")
    if d.get("verify"):
        plan = _dict(d.get("verify_plan"))
        extra = f'<br><span class="muted">{_e(plan["expect"])}</span>' if plan.get("expect") else ""
        extra += "".join(f"<br><code>{_e(k)}</code>: {_e(v)}" for k, v in _dict(plan.get("variables")).items())
        rows.append(f'<dt>verify</dt><dd><code class="cmd">{_e(d["verify"])}</code>{extra}</dd>')
    evidence = _list(d.get("evidence"))
    if evidence:
        items = "".join(f"<li><code>{_e(line)}</code></li>" for line in evidence[:20])
        rows.append(f"<dt>decisive lines</dt><dd><ul>{items}</ul></dd>")
    if d.get("rule"):
        rows.append(f'<dt>decided by</dt><dd><code>{_e(d["rule"])}</code> <span class="muted">(the attribution '
                    "rules and their order: docs/attribution.md)</span></dd>")  # fmt: skip
    return (
        f'<section class="verdict{" ok" if ok else ""}" id="verdict"><div class="who">{who}: '
        f'<span class="cls">{_e(cls)}</span>{exc}</div><dl>{"".join(rows)}</dl></section>'
    )


def _known_good(report: dict[str, Any]) -> str:
    """The comparison with a known-good run (report.json ``known_good`` and ``first_divergence``)."""
    kg = _dict(report.get("known_good"))
    if not kg:
        return ""
    good = ", ".join(str(g) for g in _list(_dict(kg.get("runs")).get("good")))
    out = ['<section class="known-good" id="known-good"><h2>First divergence from the known-good run</h2>',
           f'<p class="muted">compared with <code>{_e(good)}</code></p>']  # fmt: skip
    if kg.get("refused"):
        out.append(f"<p>{_e(kg['refused'])}</p>")
    rows = [r for r in _list(report.get("first_divergence")) if isinstance(r, dict)]
    if rows:
        body = "".join(
            f"<tr><td>{_e(r.get('rank') if r.get('rank') is not None else '?')}</td><td>{_e(r.get('level'))}</td>"
            f"<td>{_e(r.get('ranks_printing'))}</td><td><code>{_e(Path(str(r.get('file'))).name)}:{_e(r.get('line'))}"
            f"</code></td><td>{_e(r.get('seconds_before_error') if r.get('seconds_before_error') is not None else '')}"
            f"</td><td><code>{_e(r.get('text'))}</code></td></tr>"
            for r in rows[:20]
        )  # fmt: skip
        out.append("<table><tr><th>rank</th><th>level</th><th>ranks printing it</th><th>where</th>"
                   f"<th>s before its error</th><th>the line</th></tr>{body}</table>")  # fmt: skip
    elif not kg.get("refused"):
        out.append("<p>No line before an error differs from the known-good run.</p>")
    suspect = _dict(kg.get("suspect"))
    if suspect:
        out.append(f"<p><b>Suspect: rank {_e(suspect.get('rank'))}</b>: {_e(suspect.get('reason'))}</p>")
    for n in _list(kg.get("notes"))[:6]:
        out.append(f'<p class="muted">{_e(n)}</p>')
    out.append("</section>")
    return "".join(out)


def _checklist(report: dict[str, Any]) -> str:
    """The seed's checklist (report.json ``checklist``, report/checklist.py), in its order."""
    items = _dict(report.get("checklist"))
    if not items:
        return ""
    out = ['<section class="checklist" id="checklist"><h2>Checklist</h2><ol>']
    for key in ("first_occurrence", "first_error", "flight_recorder", "verify", "resume"):
        item = _dict(items.get(key))
        if not item:
            continue
        body = ""
        if not item.get("found"):
            body = f'<span class="muted">{_e(item.get("why"))}</span>'
        elif key == "first_occurrence":
            where = f"{_e(item.get('file'))}" + (f":{_e(item['line_number'])}" if item.get("line_number") else "")
            before = "\n".join(str(x) for x in _list(item.get("before")))
            body = (f"rank {_e(item.get('rank'))} on {_e(item.get('node'))}, <code>{where}</code>:<br>"
                    f"<code>{_e(item.get('line'))}</code><details><summary>the {len(_list(item.get('before')))} "
                    f"lines before it</summary><pre>{_e(before)}</pre></details>")  # fmt: skip
        elif key == "first_error":
            body = (f"rank {_e(item.get('rank'))} on {_e(item.get('node'))} ({_e(item.get('device') or '')}) at "
                    f"{_e(_when(item.get('time')))}: <code>{_e(item.get('line') or '')}</code> "
                    f'<span class="muted">({_e(item.get("how"))})</span>')  # fmt: skip
        elif key == "flight_recorder":
            rows = "".join(f"<tr><td>{_e(r.get('rank'))}</td><td>{_e(r.get('group'))}</td>"
                           f"<td>{_e(r.get('last_enqueued'))}</td><td>{_e(r.get('last_completed'))}</td>"
                           f"<td>{_e(r.get('op') or '')}</td><td>{'yes' if r.get('in_flight') else ''}</td></tr>"
                           for r in _list(item.get("ranks")) if isinstance(r, dict))  # fmt: skip
            body = ("<table><tr><th>rank</th><th>group</th><th>last enqueued</th><th>last completed</th>"
                    f"<th>that collective</th><th>in flight</th></tr>{rows}</table>")  # fmt: skip
        elif key == "verify":
            body = (f'<code class="cmd">{_e(item.get("command"))}</code><br>'
                    f'<span class="muted">{_e(item.get("expect"))}</span>')  # fmt: skip
            ran = _dict(report.get("verification"))
            if ran:
                body += (f"<br><b>{'passed' if ran.get('passed') else 'FAILED'}</b> "
                         f"({_e(ran.get('started_at'))}): {_e(ran.get('summary'))}")  # fmt: skip
        elif key == "resume":
            body = (f"<code class=\"cmd\">{_e(item.get('command') or '')}</code> "
                    f"<span class=\"muted\">{_e(item.get('checkpoint'))}; {_e(item.get('when'))}</span>")  # fmt: skip
        out.append(f"<li><b>{_e(item.get('title'))}</b><br>{body}</li>")
    out.append("</ol></section>")
    return "".join(out)


def _collective(d: dict[str, Any]) -> str:
    c = d.get("collective")
    if not isinstance(c, dict):
        return ""
    sides = _dict(c.get("sides"))
    source = _dict(c.get("source"))
    by_side: dict[tuple[str, str], list[int]] = {}
    for r, side in sides.items():
        try:
            by_side.setdefault((text(side), text(source.get(r))), []).append(int(r))
        except ValueError:
            continue
    rows = "".join(
        f"<tr><td>{_e(format_ranks(ranks))}</td><td><code>{_e(side)}</code></td><td><code>{_e(src)}</code></td></tr>"
        for (side, src), ranks in sorted(by_side.items(), key=lambda kv: min(kv[1]))
    )
    return (
        f"<h3>Where the collective schedules part</h3><p>{_e(c.get('kind'))} at process group "
        f"<code>{_e(c.get('process_group'))}</code>, collective #{_e(c.get('seq'))}</p>"
        f"<table><tr><th>ranks</th><th>what they issued</th><th>from</th></tr>{rows}</table>"
    )


def _rank_table(groups: Sequence[Group]) -> str:
    head = "<tr><th>rank(s)</th><th>role</th><th>ended</th><th>exception / error</th><th>where</th><th>steps</th></tr>"
    body = []
    for g in groups:
        r = g.first
        steps = {x.steps for x in g.rows if x.steps is not None}
        steps_text = "" if not steps else (str(min(steps)) if len(steps) == 1 else f"{min(steps)}-{max(steps)}")
        cls = ' class="init"' if r.role == "initiating" else ""
        body.append(
            f'<tr><td{cls} title="ranks {_e(g.members)}">{_e(g.label)}</td>'
            f"<td{cls}>{_e(r.role)}</td><td>{_e(r.how)}</td>"
            f"<td><code>{_e(clip(r.exception, 140))}</code></td><td><code>{_e(r.location)}</code></td>"
            f"<td>{steps_text}</td></tr>"
        )
    return f"<table>{head}{''.join(body)}</table>"


def _legend() -> str:
    roles = "".join(f'<span><i class="sw" style="background:{c}"></i>{r}</span>' for r, c in ROLE_COLOURS.items())
    return (
        f'<p class="legend">{roles}<span>&#9679; last progress</span><span>&#9670; first error</span>'
        "<span>| exit</span><span>- - verdict + teardown</span></p>"
    )


def _evidence(groups: Sequence[Group], initiating: int | None) -> str:
    chosen: list[RankRow] = []
    for g in groups:  # the initiating rank first, then one rank of each story
        for r in g.rows:
            if r.rank == initiating or r.role == "initiating":
                chosen.append(r)
    for g in groups:
        if len(chosen) >= EVIDENCE_RANKS:
            break
        if g.first not in chosen:
            chosen.append(g.first)
    out = []
    for r in chosen:
        e = r.entry
        parts = []
        if r.exception:
            parts.append(f"<p><b>exception</b> <code>{_e(r.exception)}</code></p>")
        if r.location:
            parts.append(f"<p><b>where</b> <code>{_e(r.location)}</code></p>")
        times = [
            (name, t)
            for name, t in (
                ("started", r.start),
                ("last progress", r.progress),
                ("first error", r.error),
                ("exited", r.exit),
            )
            if t is not None
        ]
        if times:
            parts.append('<p class="muted">' + " &middot; ".join(f"{n} {_when(t)}" for n, t in times) + "</p>")
        lines = _list(e.get("last_lines"))
        if lines:
            parts.append(f"<p><b>last lines of stderr</b></p><pre>{_e(chr(10).join(map(str, lines)))}</pre>")
        errors = _list(e.get("errors"))
        if errors and not lines:
            parts.append(f"<p><b>error lines</b></p><pre>{_e(chr(10).join(map(str, errors)))}</pre>")
        if isinstance(e.get("stack"), str) and e["stack"].strip():
            parts.append(f"<p><b>stack taken before teardown</b></p><pre>{_e(e['stack'].strip())}</pre>")
        if e.get("evidence_dir"):
            parts.append(f'<p class="muted">files: <code>{_e(e["evidence_dir"])}</code></p>')
        if not parts:
            parts.append('<p class="muted">no evidence was captured for this rank</p>')
        group_note = ""
        group = next((g for g in groups if r in g.rows), None)
        if group is not None and len(group.rows) > 1:
            group_note = f" (one of {group.label}, {len(group.rows)} ranks with the same story)"
        opened = " open" if r.role == "initiating" else ""
        out.append(
            f"<details{opened}><summary>rank {r.rank}{' on ' + _e(r.node) if r.node else ''}: "
            f"{_e(r.role)}{_e(group_note)}</summary>{''.join(parts)}</details>"
        )
    shown = {r.rank for r in chosen}
    rest = [r.rank for g in groups for r in g.rows if r.rank not in shown]
    if rest:
        out.append(
            f'<p class="muted">Not shown: ranks {_e(format_ranks(rest))}; each rank\'s stderr, stack and '
            "flight recorder are in its folder under the diag dir.</p>"
        )
    return "".join(out)


def _gate(gate: Any) -> str:
    if not isinstance(gate, dict):
        return ""
    controls = _list(gate.get("controls"))
    rows = "".join(
        f"<tr><td>{_e(c.get('name'))}</td><td>{'passed' if c.get('passed') else '<b>FAILED</b>'}</td>"
        f"<td>{_e(c.get('summary'))}</td><td><code>{_e(c.get('output_file'))}</code></td></tr>"
        for c in controls
        if isinstance(c, dict)
    )
    table = (
        f"<table><tr><th>control</th><th>result</th><th>summary</th><th>output</th></tr>{rows}</table>" if rows else ""
    )
    return f"<h3>Restart gate</h3><p><b>{_e(gate.get('decision'))}</b>: {_e(gate.get('reason'))}</p>{table}"


_STALL_BECAME = {"resumed": "The job went on", "ended": "It lasted until the ranks exited",
                 "failed": "The attempt failed in it: the verdict's evidence", "open": "Under way"}  # fmt: skip


def _stalls(a: dict[str, Any]) -> list[str]:
    """The attempt's stalls: who held whom, how long, what became of it, where the snapshot is."""
    out = []
    for data in _list(a.get("stalls")):
        record = stall_from_json(data)
        if record is None:
            continue
        out.append(
            f'<p class="warn">Stall {record.number} (nothing was stopped for it): {_e(stall_summary(record))}. '
            f"{_e(_STALL_BECAME.get(record.outcome, record.outcome))}; snapshot {_e(record.snapshot)}, in "
            f"<code>attempt_{_e(a.get('attempt'))}/stall_{record.number}/</code>.</p>"
        )
    return out


def _attempt(a: dict[str, Any], n_attempts: int, top_initiating: int | None) -> str:
    d = _dict(a.get("diagnosis"))
    rows = rank_rows(_list(a.get("ranks")), num(a.get("decided_at")))
    groups = group_rows(rows)
    initiating = integer(d.get("initiating_rank"))
    if initiating is None:
        initiating = top_initiating
    title = f"Attempt {_e(a.get('attempt'))}" if n_attempts > 1 or "attempt" in a else "Ranks"
    status = _e(a.get("status"))
    out = [
        f'<section class="attempt"><h2>{title}{": " + status if status else ""}'
        f"{' &middot; ' + _e(d.get('failure_class')) if d.get('failure_class') else ''}</h2>"
    ]
    if n_attempts > 1 and d.get("summary"):
        out.append(f"<p>{_e(d['summary'])}</p>")
    if a.get("came_up") is False:
        out.append(
            '<p class="warn">This attempt never came up (no collective completed on any rank): the restart '
            "failed, not the job.</p>"
        )
    hang = a.get("hang")
    if isinstance(hang, dict):
        out.append(
            f'<p class="warn">Health monitor: {_e(hang.get("reason"))} (no progress for '
            f"{_e(hang.get('stalled_s'))} s, threshold {_e(hang.get('threshold_s'))} s)</p>"
        )
    out.extend(_stalls(a))
    if rows:
        grouped = len(groups) < len(rows)
        out.append(f"<h3>Timeline{' (ranks with the same story share a row)' if grouped else ''}</h3>")
        out.append(_legend())
        decided_at = num(a.get("decided_at"))
        window = failure_window(groups, decided_at)
        if window is not None:
            out.append('<p class="muted">Around the failure (seconds since the first rank started):</p>')
            out.append(timeline_svg(groups, decided_at, initiating, window))
            out.append('<p class="muted">The whole attempt:</p>')
        out.append(timeline_svg(groups, decided_at, initiating))
        out.append(_collective(d))
        out.append(f"<h3>What every rank was doing ({len(rows)} ranks)</h3>")
        out.append(_rank_table(groups))
        out.append("<h3>Evidence</h3>")
        out.append(_evidence(groups, initiating))
    else:
        out.append('<p class="missing">No rank is recorded for this attempt.</p>')
    out.append(_gate(a.get("gate")))
    nodes = a.get("nodes")
    if isinstance(nodes, dict):
        out.append(f"<h3>Nodes</h3><pre>{_e(json.dumps(nodes, indent=1)[:4000])}</pre>")
    environment = a.get("environment")
    if isinstance(environment, dict):  # folded: versions, memory, disks, ulimits, variables, GPUs
        took = environment.get("took_ms")
        out.append(f"<details><summary>Environment at the first failure (environment.json, taken in {_e(took)} ms)"
                   f"</summary><pre>{_e(json.dumps(environment, indent=1)[:20000])}</pre></details>")  # fmt: skip
    out.append("</section>")
    return "".join(out)


def render_html(report: dict[str, Any], problems: Sequence[str] = (), source: str = "") -> str:
    """The page for one report (as loaded by :func:`load_report_dir`, or straight from a session)."""
    report = redaction.current().data(report)  # masked again, before HTML escaping hides a shape
    problems = [redaction.current().text(p) for p in problems]
    d = _dict(report.get("diagnosis"))
    attempts = [a for a in _list(report.get("attempts")) if isinstance(a, dict)]
    if not attempts and isinstance(report.get("ranks"), list):
        attempts = [{"status": report.get("status"), "diagnosis": d, "ranks": report["ranks"]}]
    cls = text(d.get("failure_class")) or "unknown"
    rank = integer(d.get("initiating_rank"))
    title = f"elastic_diag: {text(report.get('status')) or 'report'}: {cls}" + (
        f", rank {rank}" if rank is not None else ""
    )
    out = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body><main>",
        f"<h1>{html.escape(title)}</h1>",
    ]
    if problems:
        items = "".join(f"<li>{_e(p)}</li>" for p in problems)
        out.append(f'<section class="missing" id="missing"><b>Incomplete report</b><ul>{items}</ul></section>')
    out.append(_verdict(report))
    out.append(_known_good(report))
    out.append(_checklist(report))
    for w in _list(report.get("warnings")):
        if isinstance(w, dict):
            out.append(f'<p class="warn">warning ({_e(w.get("class"))}): {_e(w.get("summary"))}</p>')
    for err in _list(report.get("internal_errors")):
        out.append(f'<p class="warn">elastic_diag internal error (the job was not affected): {_e(err)}</p>')
    for a in reversed(attempts):  # the last attempt (the job's end) first
        out.append(_attempt(a, len(attempts), rank))
    notes = _list(report.get("notes"))
    if notes:
        out.append("<h2>Notes</h2><ul>" + "".join(f"<li>{_e(n)}</li>" for n in notes) + "</ul>")
    meta = [
        ("run id", report.get("run_id")),
        ("node", report.get("node")),
        ("diag dir", report.get("diag_dir")),
        ("report", source),
        ("schema", report.get("schema")),
    ]
    out.append(
        "<h2>About this report</h2><dl>"
        + "".join(f"<dt>{k}</dt><dd><code>{_e(v)}</code></dd>" for k, v in meta if v)
        + "</dl></main></body></html>"
    )
    return "\n".join(out)


def write_html(diag_dir: Path, report: dict[str, Any] | None = None) -> tuple[Path, list[str]]:
    """Render ``diag_dir/report.html`` (from ``report``, or from what is in the folder); returns the
    path and what was missing. Written atomically, like report.json."""
    problems: list[str] = []
    if report is None:
        report, problems = load_report_dir(diag_dir)
    text = render_html(report, problems, source=str(diag_dir / REPORT_FILE))
    path = diag_dir / HTML_FILE
    write_atomic(path, text)
    return path, problems
