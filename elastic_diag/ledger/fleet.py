"""``elastic-diag fleet``: the hosts ranked by the failures the ledger blames on them, and which to keep out.

The rule (docs/fleet.md, every number a flag):

* only verdicts blamed on the ``node`` count against a host (a user's bug, a rendezvous or a full disk never do);
* a node failure that **follows the job** does not count: the same job failed with the same fingerprint on
  another host as well (a code path or a switch that breaks NCCL wherever the job lands, not this host);
* a host with ``min_node_failures`` (2) counted failures in the window (14 days) is recommended for exclusion.

A fingerprint that failed on ``widespread_hosts`` (3) hosts or more is listed as widespread, with how many jobs
it spans: the same failure across many hosts is the code's or the fabric's, not a node's.

The aggregation is SQL (a few grouped scans of the window, on indexes); the rule is Python over the few node rows.
"""

from __future__ import annotations

import json
import shlex
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from elastic_diag.core.schema_ids import FLEET_SCHEMA
from elastic_diag.ledger.store import Ledger

SCHEMA = FLEET_SCHEMA
BLAME_KEYS = ("node", "job", "infra", "unknown")
DAY_S = 86400.0
MAX_WIDESPREAD = 20


@dataclass(frozen=True, slots=True)
class ExclusionRule:
    window_days: float = 14.0
    min_node_failures: int = 2
    widespread_hosts: int = 3
    hold_days: float = 30.0  # a host the rule kept out stays out this long after its last counted node failure

    def to_json(self) -> dict[str, Any]:
        return {"window_days": self.window_days, "min_node_failures": self.min_node_failures,
                "widespread_hosts": self.widespread_hosts, "hold_days": self.hold_days}  # fmt: skip


def fleet_view(ledger: Ledger, rule: ExclusionRule | None = None, *, now: float | None = None,
               top_fingerprints: int = 5) -> dict[str, Any]:  # fmt: skip
    """The fleet page's data (``--json``, schema ``elastic_diag.fleet/1``)."""
    rule = rule or ExclusionRule()
    until = time.time() if now is None else now
    since = until - rule.window_days * DAY_S
    first, last = int(since // DAY_S), int(until // DAY_S)  # the window counts whole UTC days

    def query(conn: Any) -> tuple[list[Any], list[Any], Any, list[Any]]:
        import sqlalchemy as sa

        d = ledger.days()
        t = ledger.table()
        in_window = sa.and_(d.c.day >= first, d.c.day <= last)
        failed = sa.and_(in_window, d.c.status != "succeeded", d.c.count > 0)
        per_fp = conn.execute(
            sa.select(d.c.host, d.c.fingerprint, d.c.blame, sa.func.sum(d.c.count), sa.func.max(d.c.last_at),
                      sa.func.min(d.c.signature), d.c.failure_class)
            .where(failed).group_by(d.c.host, d.c.fingerprint, d.c.blame, d.c.failure_class)
        ).all()  # fmt: skip
        totals = conn.execute(
            sa.select(sa.func.coalesce(sa.func.sum(d.c.count), 0),
                      sa.func.coalesce(sa.func.sum(d.c.count).filter(d.c.status != "succeeded"), 0))
            .where(in_window)
        ).one()  # fmt: skip
        window = sa.and_(
            t.c.recorded_at >= first * DAY_S - rule.hold_days * DAY_S, t.c.recorded_at < (last + 1) * DAY_S
        )  # the window, and the hold before it
        node_rows = conn.execute(
            sa.select(t.c.initiating_host, t.c.job_id, t.c.fingerprint, t.c.recorded_at)
            .where(t.c.blame == "node", window, t.c.status != "succeeded")
        ).all()  # fmt: skip
        all_time = conn.execute(
            sa.select(d.c.host, d.c.failure_class, d.c.blame, sa.func.sum(d.c.count))
            .where(d.c.status != "succeeded", d.c.count > 0).group_by(d.c.host, d.c.failure_class, d.c.blame)
        ).all()  # fmt: skip
        return per_fp, node_rows, totals, all_time

    per_fp, node_rows, totals, all_time = ledger.read("read the fleet", query)

    def spread(conn: Any) -> Any:
        import sqlalchemy as sa

        f = ledger.spread()
        t = ledger.table()
        n_hosts = sa.func.count(sa.distinct(f.c.host))
        wide = conn.execute(
            sa.select(f.c.fingerprint, n_hosts, sa.func.sum(f.c.count))
            .where(f.c.day >= first, f.c.day <= last, f.c.count > 0).group_by(f.c.fingerprint)
            .having(n_hosts >= rule.widespread_hosts).order_by(n_hosts.desc(), f.c.fingerprint).limit(MAX_WIDESPREAD)
        ).all()  # fmt: skip
        if not wide:
            return []
        window = sa.and_(t.c.recorded_at >= first * DAY_S, t.c.recorded_at < (last + 1) * DAY_S)
        about = {fp: rest for fp, *rest in conn.execute(
            sa.select(t.c.fingerprint, sa.func.count(sa.distinct(t.c.job_id)), sa.func.min(t.c.signature),
                      sa.func.min(t.c.failure_class), sa.func.min(t.c.blame))
            .where(t.c.fingerprint.in_([w[0] for w in wide]), window).group_by(t.c.fingerprint)).all()}  # fmt: skip
        return [(fp, hosts, count, *about.get(fp, (0, None, None, "unknown"))) for fp, hosts, count in wide]

    wide: list[Any] = ledger.read("read the fleet", spread)
    view = build_view(per_fp, node_rows, wide, totals, rule, since=since, until=until, ledger=ledger.shown,
                      top_fingerprints=top_fingerprints)  # fmt: skip
    # every failure the ledger holds (no window): what a Prometheus counter counts
    view["all_time_failures"] = [{"host": h, "class": c or "unknown", "blame": b, "count": int(n)}
                                 for h, c, b, n in sorted(all_time, key=lambda r: (r[0], r[1], r[2]))]  # fmt: skip
    return view


def host_verdict(ledger: Ledger, host: str, rule: ExclusionRule | None = None, *,
                 now: float | None = None) -> tuple[bool, int]:  # fmt: skip
    """Whether the rule recommends excluding ``host`` now, and its counted node failures (the window's node rows
    only: a few, read through the blame index)."""
    rule = rule or ExclusionRule()
    until = time.time() if now is None else now
    first, last = int((until - rule.window_days * DAY_S) // DAY_S), int(until // DAY_S)

    def rows(conn: Any) -> Any:
        import sqlalchemy as sa

        t = ledger.table()
        return conn.execute(
            sa.select(t.c.initiating_host, t.c.job_id, t.c.fingerprint, t.c.recorded_at)
            .where(t.c.blame == "node", t.c.recorded_at >= first * DAY_S - rule.hold_days * DAY_S,
                   t.c.recorded_at < (last + 1) * DAY_S, t.c.status != "succeeded")
        ).all()  # fmt: skip

    found = ledger.read("read the host's failures", rows)
    counted, _ = node_failures(r for r in found if r[3] >= first * DAY_S)
    n = counted.get(host, 0)
    return n >= rule.min_node_failures or host in held(found, rule, until), n


def node_failures(node_rows: Iterable[Sequence[Any]]) -> tuple[dict[str, int], dict[str, int]]:
    """Per host, the node-blamed failures that count against it and those that followed their job: ``node_rows``
    are (host, job, fingerprint, ...) of the window's failures blamed on the node. A failure follows its job when
    the same job failed with the same fingerprint on another host too."""
    rows = [(host, job, fp) for host, job, fp, *_ in node_rows if host]
    hosts_of: dict[tuple[str, str | None], set[str]] = defaultdict(set)
    for host, job, fp in rows:
        hosts_of[(job, fp)].add(host)
    counted: dict[str, int] = defaultdict(int)
    followed: dict[str, int] = defaultdict(int)
    for host, job, fp in rows:
        if len(hosts_of[(job, fp)]) > 1:
            followed[host] += 1
        else:
            counted[host] += 1
    return dict(counted), dict(followed)


def held(node_rows: Iterable[Sequence[Any]], rule: ExclusionRule, until: float) -> dict[str, float]:
    """The hosts the rule kept out at some time in the last ``hold_days`` (``min_node_failures`` counted node
    failures within ``window_days`` of each other, the last of them in the hold): host -> that last failure's time.
    ``node_rows``: (host, job, fingerprint, time) of the window and the hold before it."""
    if rule.hold_days <= 0:
        return {}
    rows = [tuple(r[:4]) for r in node_rows if r[0]]
    hosts_of: dict[tuple[str, str | None], set[str]] = defaultdict(set)
    for host, job, fp, _ in rows:
        hosts_of[(job, fp)].add(host)
    times: dict[str, list[float]] = defaultdict(list)
    for host, job, fp, at in rows:
        if len(hosts_of[(job, fp)]) == 1:
            times[host].append(float(at))
    out: dict[str, float] = {}
    start = int((until - rule.hold_days * DAY_S) // DAY_S) * DAY_S  # whole UTC days, as the window
    need = max(1, rule.min_node_failures)
    for host, ts in times.items():
        ts.sort()
        for i in range(len(ts) - 1, need - 2, -1):
            if ts[i] < start:
                break
            if ts[i] - ts[i - need + 1] <= rule.window_days * DAY_S:
                out[host] = ts[i]
                break
    return out


def recommended(counted: Mapping[str, int], rule: ExclusionRule) -> list[str]:
    """The hosts the rule keeps out, most failures first."""
    return sorted((h for h, n in counted.items() if n >= rule.min_node_failures), key=lambda h: (-counted[h], h))


def build_view(per_fp: list[Any], node_rows: list[Any], wide: list[Any], totals: Any,
               rule: ExclusionRule, *, since: float, until: float, ledger: str,
               top_fingerprints: int = 5) -> dict[str, Any]:  # fmt: skip
    """The view from the grouped counts (host, fingerprint, blame, count, last, signature, class), the node
    rows (host, job, fingerprint, time) and the widespread fingerprints (fingerprint, hosts, count, jobs,
    signature, class, blame)."""
    hosts: dict[str, dict[str, Any]] = {}
    unplaced: dict[str, int] = dict.fromkeys(BLAME_KEYS, 0)
    per_host_fps: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for host, fp, blame, count, last, sig, cls in per_fp:
        key = blame if blame in BLAME_KEYS else "unknown"
        if not host:
            unplaced[key] += int(count)
            continue
        h = hosts.setdefault(host, {"host": host, "failures": dict.fromkeys(BLAME_KEYS, 0), "last_failure": 0.0,
                                    "classes": defaultdict(int)})  # fmt: skip
        h["failures"][key] += int(count)
        h["classes"][(cls or "unknown", key)] += int(count)
        h["last_failure"] = max(h["last_failure"], float(last or 0))
        if not fp:
            continue
        per_host_fps[host].append({"fingerprint": fp, "blame": blame, "signature": sig, "class": cls,
                                   "count": int(count), "last": float(last or 0)})  # fmt: skip
    start = int(since // DAY_S) * DAY_S
    counted, followed = node_failures(r for r in node_rows if r[3] >= start)
    kept = held(node_rows, rule, until)
    for name in kept:
        hosts.setdefault(name, {"host": name, "failures": dict.fromkeys(BLAME_KEYS, 0), "last_failure": kept[name],
                                "classes": defaultdict(int)})  # fmt: skip
    out_hosts = []
    for name, h in hosts.items():
        n = counted.get(name, 0)
        excluded = n >= rule.min_node_failures or name in kept
        fps = sorted(per_host_fps.get(name, []), key=lambda f: (-f["count"], f["fingerprint"]))[:top_fingerprints]
        why = (f"{n} node failure(s) in {rule.window_days:g} days (rule: {rule.min_node_failures})" if n else
               "no node failure in the window")  # fmt: skip
        if name in kept and n < rule.min_node_failures:
            why += (f"; kept out {rule.hold_days:g} days after its last counted node failure "
                    f"({time.strftime('%Y-%m-%d', time.gmtime(kept[name]))}; rule: hold)")  # fmt: skip
        if followed.get(name):
            why += f"; {followed[name]} node failure(s) followed their job to other hosts (not counted)"
        classes = [{"class": c, "blame": b, "count": n} for (c, b), n in sorted(h.pop("classes").items())]
        out_hosts.append({**h, "classes": classes, "node_failures_counted": n,
                          "node_failures_followed_job": followed.get(name, 0), "fingerprints": fps,
                          "exclude": excluded, "why": why})  # fmt: skip
    out_hosts.sort(key=lambda h: (-h["node_failures_counted"], -h["failures"]["node"], -sum(h["failures"].values()),
                                  h["host"]))  # fmt: skip
    widespread = [{"fingerprint": fp, "signature": sig, "class": cls, "blame": blame, "hosts": int(nh),
                   "jobs": int(jobs), "count": int(n),
                   "reading": "the job's code or shared infrastructure, not one node"}
                  for fp, nh, n, jobs, sig, cls, blame in wide][:MAX_WIDESPREAD]  # fmt: skip
    widespread.sort(key=lambda w: (-w["hosts"], -w["count"], w["fingerprint"]))
    exclude = [h["host"] for h in out_hosts if h["exclude"]]
    return {
        "schema": SCHEMA,
        "ledger": ledger,
        "window": {"since": since, "until": until, "days": rule.window_days},
        "rule": rule.to_json(),
        "verdicts": int(totals[0]),
        "failed": int(totals[1]),
        "unplaced_failures": unplaced,
        "hosts": out_hosts,
        "widespread": widespread,
        "exclude": exclude,
        "actions": exclusion_actions(exclude, out_hosts),
    }


def exclusion_actions(exclude: list[str], hosts: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """What keeps the hosts out: Slurm's ``--exclude=`` list, an ``scontrol`` drain line per host (run by
    ``--apply``), ``kubectl`` cordon and taint lines (printed only)."""
    why = {h["host"]: h["why"] for h in hosts}
    reason = {name: drain_reason(why.get(name, "")) for name in exclude}
    return {
        "slurm_exclude": f"--exclude={','.join(exclude)}" if exclude else None,
        "scontrol": [shlex.join(scontrol_drain(name, reason[name])) for name in exclude],
        "kubectl": [line for name in exclude for line in (
            f"kubectl cordon {name}", f"kubectl taint nodes {name} elastic-diag/node-failures=true:NoSchedule")],
    }  # fmt: skip


def drain_reason(why: str) -> str:
    """The ``Reason=`` of a drain: the rule's first clause."""
    return ("elastic_diag: " + why.split(";")[0])[:120]


def scontrol_drain(host: str, reason: str) -> list[str]:
    return ["scontrol", "update", f"NodeName={host}", "State=DRAIN", f"Reason={reason}"]


def prometheus_text(view: Mapping[str, Any]) -> str:
    """The Prometheus textfile (node_exporter's textfile collector): every failure in the ledger per host, class
    and blame (a counter), and of the window: the node failures counted against each host, whether it is
    recommended for exclusion, the verdicts, the widespread failures (gauges)."""
    out = ["# HELP elastic_diag_failures_total Failed verdicts in the ledger, by initiating host, class and blame.",
           "# TYPE elastic_diag_failures_total counter"]  # fmt: skip
    for f in view.get("all_time_failures", []):
        labels = f'class="{_label(f["class"])}",host="{_label(f["host"] or "none")}",blame="{_label(f["blame"])}"'
        out.append(f"elastic_diag_failures_total{{{labels}}} {f['count']}")
    out += ["# HELP elastic_diag_host_node_failures Node failures counted against the host (the exclusion rule).",
            "# TYPE elastic_diag_host_node_failures gauge"]  # fmt: skip
    for h in view["hosts"]:
        out.append(f'elastic_diag_host_node_failures{{host="{_label(h["host"])}"}} {h["node_failures_counted"]}')
    out += ["# HELP elastic_diag_host_excluded 1 when the ledger recommends excluding the host.",
            "# TYPE elastic_diag_host_excluded gauge"]  # fmt: skip
    for h in view["hosts"]:
        out.append(f'elastic_diag_host_excluded{{host="{_label(h["host"])}"}} {1 if h["exclude"] else 0}')
    out += ["# HELP elastic_diag_verdicts Verdicts in the ledger's window.", "# TYPE elastic_diag_verdicts gauge",
            f'elastic_diag_verdicts{{status="failed"}} {view["failed"]}',
            f'elastic_diag_verdicts{{status="all"}} {view["verdicts"]}',
            "# HELP elastic_diag_widespread_failures Fingerprints seen on many hosts (code or fabric, not a node).",
            "# TYPE elastic_diag_widespread_failures gauge",
            f"elastic_diag_widespread_failures {len(view['widespread'])}"]  # fmt: skip
    return "\n".join(out) + "\n"


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def view_json(view: Mapping[str, Any]) -> str:
    return json.dumps(view, indent=2, sort_keys=False)
