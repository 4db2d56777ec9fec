"""The fleet view as text (the terminal) and as one self-contained HTML page (no script, no outside resource)."""

from __future__ import annotations

import html
import time
from collections.abc import Mapping
from typing import Any

from elastic_diag.redaction import mask_shapes


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.gmtime(t)) + " UTC" if t else "-"


def fleet_text(view: Mapping[str, Any], top: int = 20) -> str:
    rule = view["rule"]
    out = [f"elastic_diag fleet: {view['ledger']}",
           f"  window: the last {rule['window_days']:g} days: {view['verdicts']} verdicts, {view['failed']} failed",
           f"  rule: a host with {rule['min_node_failures']}+ node failures (not following their job to other hosts) "
           f"is recommended for exclusion{_hold(rule)}", ""]  # fmt: skip
    hosts = view["hosts"][:top]
    if not hosts:
        out.append("  no failure named a host in the window")
    else:
        out.append(f"  {'host':<24} {'node':>5} {'job':>5} {'infra':>5} {'unkn.':>5}  counted  exclude")
        for h in hosts:
            f = h["failures"]
            out.append(f"  {h['host'][:24]:<24} {f['node']:>5} {f['job']:>5} {f['infra']:>5} {f['unknown']:>5}  "
                       f"{h['node_failures_counted']:>7}  {'YES' if h['exclude'] else '-'}")  # fmt: skip
        if len(view["hosts"]) > top:
            out.append(f"  ... {len(view['hosts']) - top} more hosts (--json has them all)")
    if view["widespread"]:
        out += ["", "  the same failure on many hosts (the code's or the fabric's, not a node's):"]
        for w in view["widespread"][:10]:
            out.append(f"    {w['fingerprint']}  {w['signature'] or w['class']}: {w['count']} failures on "
                       f"{w['hosts']} hosts, {w['jobs']} job(s)")  # fmt: skip
    actions = view["actions"]
    if view["exclude"]:
        out += ["", f"  keep out: {', '.join(view['exclude'])}", f"    srun/sbatch {actions['slurm_exclude']}"]
        out += [f"    {line}" for line in actions["scontrol"]]
        out += [f"    {line}" for line in actions["kubectl"]]
        out.append("    (`elastic-diag fleet --apply` runs the scontrol lines)")
    else:
        out += ["", "  no host is recommended for exclusion"]
    return mask_shapes("\n".join(out))


_STYLE = """body{font:14px/1.4 system-ui,sans-serif;margin:2em;color:#222}table{border-collapse:collapse;margin:1em 0}
td,th{border:1px solid #ccc;padding:4px 8px;text-align:left}th{background:#f3f3f3}.x{background:#fde2e2}
code{font-size:12px}h1{font-size:20px}"""


def _hold(rule: Mapping[str, Any]) -> str:
    days = float(rule.get("hold_days") or 0)
    return f", and kept out {days:g} days after its last counted one" if days > 0 else ""


def fleet_html(view: Mapping[str, Any]) -> str:
    e = html.escape
    rule = view["rule"]
    rows = []
    for h in view["hosts"]:
        f = h["failures"]
        fps = "<br>".join(f"<code>{e(p['fingerprint'])}</code> {e(str(p['signature'] or p['class']))} x{p['count']}"
                          f" ({e(p['blame'])})" for p in h["fingerprints"])  # fmt: skip
        rows.append(f"<tr class=\"{'x' if h['exclude'] else ''}\"><td>{e(h['host'])}</td><td>{f['node']}</td>"
                    f"<td>{f['job']}</td><td>{f['infra']}</td><td>{f['unknown']}</td>"
                    f"<td>{h['node_failures_counted']}</td><td>{'yes' if h['exclude'] else 'no'}</td>"
                    f"<td>{e(_when(h['last_failure']))}</td><td>{fps}</td><td>{e(h['why'])}</td></tr>")  # fmt: skip
    wide = "".join(f"<tr><td><code>{e(w['fingerprint'])}</code></td><td>{e(str(w['signature'] or w['class']))}</td>"
                   f"<td>{e(w['blame'])}</td><td>{w['hosts']}</td><td>{w['jobs']}</td><td>{w['count']}</td></tr>"
                   for w in view["widespread"])  # fmt: skip
    actions = view["actions"]
    lines = [actions["slurm_exclude"], *actions["scontrol"], *actions["kubectl"]] if view["exclude"] else []
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>elastic_diag fleet</title>
<style>{_STYLE}</style></head><body>
<h1>elastic_diag fleet</h1>
<p>{e(view["ledger"])}: the last {rule["window_days"]:g} days ({e(_when(view["window"]["since"]))} to
{e(_when(view["window"]["until"]))}), {view["verdicts"]} verdicts, {view["failed"]} failed.
Rule: a host with {rule["min_node_failures"]} or more failures blamed on the node (not following their job to other
hosts) is recommended for exclusion{e(_hold(rule))}; user bugs, rendezvous and storage never count against a host.</p>
<h2>Hosts</h2>
<table><tr><th>host</th><th>node</th><th>job</th><th>infra</th><th>unknown</th><th>counted</th><th>exclude</th>
<th>last failure</th><th>fingerprints</th><th>why</th></tr>{"".join(rows)}</table>
<h2>The same failure on many hosts</h2>
<p>The code's or the shared infrastructure's, not one node's.</p>
<table><tr><th>fingerprint</th><th>signature</th><th>blame</th><th>hosts</th><th>jobs</th><th>failures</th></tr>{wide}
</table>
<h2>Keep them out</h2>
<pre>{e(chr(10).join(line for line in lines if line)) or "no host is recommended for exclusion"}</pre>
</body></html>
"""
    return mask_shapes(page)
