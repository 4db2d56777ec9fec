"""elastic-diag fleet over a real SQLite ledger: the hosts ranked by node-attributable failures, user bugs and
failures that follow their job never counted against a host, the exclusion lines, the JSON schema, the page, and a
Prometheus textfile that Debian's promtool accepts."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elastic_diag.ledger.fleet import ExclusionRule, fleet_view, prometheus_text
from elastic_diag.ledger.fleet_page import fleet_html
from elastic_diag.ledger.store import Ledger
from elastic_diag.ledger.verdicts import verdicts_of_report
from elastic_diag.report.schema import validate

DAY = 86400.0
NOW = 1_796_000_000.0
XID79 = "NVRM: Xid (PCI:0000:{bus}:00): 79, pid={pid}, name=python, GPU has fallen off the bus."
XID13 = (
    "NVRM: Xid (PCI:0000:{bus}:00): 13, pid={pid}, Graphics SM Warp Exception on (GPC 0, TPC 1): Out Of Range Address"
)
NCCL_NET = "NCCL WARN NET/IB : Got completion from peer 10.0.{bus}.2 with status=12 opcode=0 len=0 vendor err {pid}"


def _report(run: str, attempt: int, host: str, sig: str, cls: str, line: str, *, others: tuple[str, ...] = ()) -> dict:
    d = {"failure_class": cls, "initiating_rank": 3, "initiating_node": host, "signature_id": sig, "rule":
         "own_failure_first", "summary": f"Rank 3 on {host}: {line[:60]}", "evidence": [line]}  # fmt: skip
    ranks = [{"rank": 3, "node": host}, *({"rank": 10 + i, "node": h} for i, h in enumerate(others))]
    return {"run_id": run, "status": "failed", "attempts": [{"attempt": attempt, "status": "failed", "diagnosis": d,
                                                              "ranks": ranks}]}  # fmt: skip


def _ledger(path: Path) -> Ledger:
    """A fortnight of a small fleet, with every kind of failure the rule must tell apart."""
    rows = []

    def add(report: dict, job: str, days_ago: float) -> None:
        rows.extend(verdicts_of_report(report, source="torchrun-diag", job_id=job, recorded_at=NOW - days_ago * DAY))

    # a GPU that falls off the bus in two jobs: the node
    add(_report("a", 0, "gpu-bad", "gpu-xid-ecc", "cuda_error", XID79.format(bus="3b", pid=11)), "slurm:1", 5)
    add(_report("b", 0, "gpu-bad", "gpu-xid-ecc", "cuda_error", XID79.format(bus="3b", pid=97)), "slurm:2", 1)
    # a flaky NIC: NCCL network errors only, no kernel line, three times in two jobs (a restart on it too)
    for run, att, job, ago in (("c", 0, "slurm:3", 9), ("c", 1, "slurm:3", 8.9), ("d", 0, "slurm:4", 2)):
        add(_report(run, att, "gpu-nic", "nccl-network-error", "network_error", NCCL_NET.format(bus=7, pid=ago)), job,
            ago)  # fmt: skip
    # a user's bug, many times, always on the host of its rank 3: never the node
    for i in range(6):
        add(_report(f"u{i}", 0, "gpu-user", "python-exception", "python_exception", "KeyError: 'ferret'"),
            f"slurm:{100 + i}", i)  # fmt: skip
    # an Xid the application causes (13), twice: the job's
    for i in range(2):
        app = _report(f"x{i}", 0, "gpu-app", "gpu-xid-ecc", "cuda_error", XID13.format(bus="af", pid=i))
        add(app, f"slurm:{200 + i}", i)
    # one job's NCCL misconfiguration: network errors on whatever hosts it lands, attempt after attempt
    for att, host in enumerate(("gpu-10", "gpu-11", "gpu-12")):
        misconfigured = _report("m", att, host, "nccl-network-error", "network_error", NCCL_NET.format(bus=9, pid=att))
        add(misconfigured, "slurm:300", 3 - att * 0.1)
    # one Xid on another host: not yet a pattern; two old ones on a third: outside the window
    add(_report("o", 0, "gpu-once", "gpu-xid-ecc", "cuda_error", XID79.format(bus="1a", pid=5)), "slurm:400", 4)
    add(_report("p", 0, "gpu-old", "gpu-xid-ecc", "cuda_error", XID79.format(bus="1a", pid=5)), "slurm:500", 30)
    add(_report("q", 0, "gpu-old", "gpu-xid-ecc", "cuda_error", XID79.format(bus="1a", pid=6)), "slurm:501", 29)
    # two older still, also within 14 days of each other: beyond the 30 days' hold
    add(_report("r", 0, "gpu-older", "gpu-xid-ecc", "cuda_error", XID79.format(bus="1a", pid=7)), "slurm:502", 45)
    add(_report("s", 0, "gpu-older", "gpu-xid-ecc", "cuda_error", XID79.format(bus="1a", pid=8)), "slurm:503", 40)
    healthy = _report("h", 0, "gpu-01", "python-exception", "python_exception", "")
    healthy["status"] = healthy["attempts"][0]["status"] = "succeeded"
    for i in range(20):
        add({**healthy, "run_id": f"h{i}"}, f"slurm:{600 + i}", i / 2)
    ledger = Ledger(f"sqlite:///{path}")
    ledger.record(rows)
    return ledger


def test_node_faults_count_user_bugs_and_failures_that_follow_their_job_do_not(tmp_path):
    view = fleet_view(_ledger(tmp_path / "l.sqlite"), ExclusionRule(), now=NOW)
    validate(view)
    hosts = {h["host"]: h for h in view["hosts"]}
    assert view["exclude"] == ["gpu-nic", "gpu-bad", "gpu-old"]  # most counted failures first; then the held
    assert hosts["gpu-nic"]["node_failures_counted"] == 3 and hosts["gpu-bad"]["failures"]["node"] == 2
    assert hosts["gpu-user"]["failures"] == {"node": 0, "job": 6, "infra": 0, "unknown": 0}
    assert not hosts["gpu-user"]["exclude"] and not hosts["gpu-app"]["exclude"]
    assert hosts["gpu-app"]["failures"]["job"] == 2  # Xid 13: the application's
    for h in ("gpu-10", "gpu-11", "gpu-12"):  # the misconfigured job: its failures followed it
        assert hosts[h]["node_failures_counted"] == 0 and hosts[h]["node_failures_followed_job"] == 1
        assert "followed their job" in hosts[h]["why"]
    assert not hosts["gpu-once"]["exclude"] and "gpu-older" not in hosts
    # gpu-old's two Xids (29 and 30 days ago) kept it out then: held 30 days after the last, with no run since
    old = hosts["gpu-old"]
    assert (old["exclude"], old["node_failures_counted"], old["failures"]["node"]) == (True, 0, 0), old
    assert "kept out 30 days after its last counted node failure" in old["why"] and "rule: hold" in old["why"]
    assert "gpu-old" not in fleet_view(_ledger(tmp_path / "n.sqlite"), ExclusionRule(hold_days=0), now=NOW)["exclude"]
    (wide,) = view["widespread"]  # the same NCCL line on the NIC's host and where the misconfigured job ran
    assert (wide["hosts"], wide["jobs"], wide["signature"]) == (4, 3, "nccl-network-error")
    assert hosts["gpu-bad"]["fingerprints"][0]["count"] == 2  # one fingerprint: the same Xid line, another pid
    assert view["verdicts"] == 37 and view["failed"] == 17  # the two old failures are outside the window
    actions = view["actions"]
    assert actions["slurm_exclude"] == "--exclude=gpu-nic,gpu-bad,gpu-old"
    assert actions["scontrol"][1].startswith(
        "scontrol update NodeName=gpu-bad State=DRAIN 'Reason=elastic_diag: 2 node"
    )
    assert "kubectl cordon gpu-bad" in actions["kubectl"]
    # the rule's numbers are the user's
    assert fleet_view(_ledger(tmp_path / "m.sqlite"), ExclusionRule(min_node_failures=3), now=NOW)["exclude"] == [
        "gpu-nic"]  # fmt: skip


def test_the_page_is_self_contained_and_escapes_what_it_shows(tmp_path):
    ledger = _ledger(tmp_path / "l.sqlite")
    odd = _report("z", 0, "<img src=x onerror=alert(1)>", "gpu-xid-ecc", "cuda_error", XID79.format(bus="3b", pid=1))
    ledger.record(verdicts_of_report(odd, source="exec", recorded_at=NOW))
    page = fleet_html(fleet_view(ledger, now=NOW))
    assert "<script" not in page and "http://" not in page and "https://" not in page.replace(
        "https://json-schema", "")  # fmt: skip
    assert "&lt;img src=x" in page and "<img" not in page and "gpu-bad" in page


def _promtool() -> str | None:
    found = shutil.which("promtool")
    if found is None and os.environ.get("ELASTIC_DIAG_REQUIRE_PROMTOOL") == "1":
        pytest.fail("promtool is not installed: apt-get install prometheus")
    return found


def test_the_prometheus_textfile_passes_promtool(tmp_path):
    ledger = _ledger(tmp_path / "l.sqlite")
    odd = _report("z", 0, 'odd"host\\name', "gpu-xid-ecc", "cuda_error", XID79.format(bus="3b", pid=1))
    ledger.record(verdicts_of_report(odd, source="exec", recorded_at=NOW))
    text = prometheus_text(fleet_view(ledger, now=NOW))
    assert 'elastic_diag_failures_total{class="cuda_error",host="gpu-bad",blame="node"} 2' in text
    assert 'elastic_diag_failures_total{class="cuda_error",host="gpu-old",blame="node"} 2' in text  # a counter
    assert 'elastic_diag_host_excluded{host="gpu-nic"} 1' in text and 'host="odd\\"host\\\\name"' in text
    promtool = _promtool()
    if promtool is None:
        pytest.skip("promtool is not installed (apt-get install prometheus)")
    done = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def _cli(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "elastic_diag", *argv], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})  # fmt: skip


def test_the_command_writes_json_page_and_textfile_and_refuses_a_newer_ledger(tmp_path):
    ledger = _ledger(tmp_path / "l.sqlite")
    # the ledger's rows were recorded 'now' minus days: the command's window ends at the real now
    import sqlalchemy as sa

    with ledger.engine.begin() as conn:
        conn.execute(sa.update(ledger.table()).values(recorded_at=ledger.table().c.recorded_at + (time.time() - NOW)))
        conn.execute(sa.delete(ledger.days()))
    rows = ledger.read("all", lambda c: [dict(r._mapping) for r in c.execute(sa.select(ledger.table()))])
    fresh = Ledger(f"sqlite:///{tmp_path / 'now.sqlite'}")
    fresh.insert_many([{k: v for k, v in r.items() if k != "id"} for r in rows])
    fresh.close()
    done = _cli("fleet", "--json", "--html", str(tmp_path / "fleet.html"), "--prometheus", str(tmp_path / "f.prom"),
                env={"ELASTIC_DIAG_LEDGER": str(tmp_path / "now.sqlite")})  # fmt: skip
    assert done.returncode == 0, done.stderr
    view = json.loads(done.stdout)
    validate(view)
    assert view["exclude"] == ["gpu-nic", "gpu-bad", "gpu-old"]
    assert (tmp_path / "fleet.html").read_text().startswith("<!doctype html>")
    assert "elastic_diag_host_excluded" in (tmp_path / "f.prom").read_text()
    text = _cli("fleet", "--diag-ledger", str(tmp_path / "now.sqlite"))
    assert "keep out: gpu-nic, gpu-bad, gpu-old" in text.stdout and "--exclude=gpu-nic,gpu-bad,gpu-old" in text.stdout
    with fresh.engine.begin() as conn:
        conn.execute(sa.text("UPDATE ledger_meta SET value = '7' WHERE key = 'schema_version'"))
    fresh.close()
    newer = _cli("fleet", "--diag-ledger", str(tmp_path / "now.sqlite"))
    assert newer.returncode == 1 and "schema 7, written by a newer elastic_diag" in newer.stderr
    missing = _cli("fleet", "--diag-ledger", str(tmp_path / "nothing.sqlite"))
    assert missing.returncode == 2 and "no ledger at" in missing.stderr
    assert not (tmp_path / "nothing.sqlite").exists()


def test_the_hold_keeps_a_host_out_after_the_window_and_lets_it_back_after_the_hold():
    from elastic_diag.ledger.fleet import held

    rule = ExclusionRule()  # 2 counted in 14 days; held 30 days after the last
    pair = [("h", "j1", "f", NOW - 20 * DAY), ("h", "j2", "f", NOW - 10 * DAY)]
    assert held(pair, rule, NOW) == {"h": NOW - 10 * DAY}
    assert held(pair, rule, NOW + 21 * DAY) == {}  # 31 days after the last: back
    far = [("h", "j1", "f", NOW - 28 * DAY), ("h", "j2", "f", NOW - 10 * DAY)]  # 18 days apart: never kept out
    assert held(far, rule, NOW) == {}
    # the same job's fingerprint on two hosts followed its job: it never counts, so never holds
    followed = [("a", "j1", "f", NOW - 9 * DAY), ("b", "j1", "f", NOW - 9 * DAY), ("a", "j1", "f", NOW - 8 * DAY),
                ("b", "j1", "f", NOW - 8 * DAY)]  # fmt: skip
    assert held(followed, rule, NOW) == {}
    assert held(pair, ExclusionRule(hold_days=0), NOW) == {}
    assert held(pair, ExclusionRule(min_node_failures=3), NOW) == {}
