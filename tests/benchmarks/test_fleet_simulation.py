"""benchmarks/fleet.py, small: the ledger's exclusion rule against a naive count and a FACT-like kernel-log rule
over one simulated fleet (user bugs, application Xids, a NCCL misconfiguration that follows its job, a flaky NIC
seen only by NCCL), and ``fleet_view`` over a real SQLite ledger of the policy's verdicts agreeing with it."""

from __future__ import annotations

import importlib.util
import sys
from collections import defaultdict
from pathlib import Path
from types import ModuleType

from elastic_diag.ledger.fleet import DAY_S, ExclusionRule, fleet_view
from elastic_diag.ledger.store import Ledger

ROOT = Path(__file__).resolve().parents[2]


def _load() -> ModuleType:
    """benchmarks/fleet.py as a module (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location("benchmark_fleet", ROOT / "benchmarks" / "fleet.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


bench = _load()


def test_the_ledgers_rule_is_more_precise_than_naive_and_fact_and_never_blames_a_node_for_a_users_bug():
    fleet, results = bench.run_all(jobs=3_000, hosts=300, days=60, seed=7)
    ed, naive, fact, none = results["elastic_diag"], results["naive"], results["fact"], results["none"]
    # the scenario has teeth: every kind of failure happened, and the naive rule kept good hosts out for them
    assert {"user", "appxid", "misconfig", "gpu", "nic", "rdzv", "storage"} <= set(none.causes)
    assert naive.precision < 1 and fact.precision < 1
    assert ed.precision >= naive.precision and ed.precision >= fact.precision
    assert ed.recall >= fact.recall and ed.excluded
    assert ed.node_failures < none.node_failures  # keeping the bad hosts out spared jobs
    # a host whose failures (as the elastic_diag run saw them) were all the job's was never kept out by it
    blames: dict[str, set[str]] = defaultdict(set)
    causes: dict[str, set[str]] = defaultdict(set)
    for a in ed.history:
        if a.cause is not None and a.host is not None:
            blames[fleet.names[a.host]].add(a.blame)
            causes[fleet.names[a.host]].add(a.cause)
    jobs_only = {h for h, b in blames.items() if b == {"job"}}
    assert jobs_only and not jobs_only & set(ed.ever_excluded)
    assert {h for h in jobs_only if causes[h] == {"user"}}  # hosts that only ever saw users' bugs
    # the NCCL misconfiguration failed on several hosts, every time blamed on the node: it followed its job
    misconfigured = [a for a in ed.history if a.cause == "misconfig"]
    assert misconfigured and all(a.blame == "node" for a in misconfigured)
    counted, followed = bench.node_failures((fleet.names[a.host], a.job.name, a.fp) for a in misconfigured)
    assert sum(followed.values()) > sum(counted.values())
    assert not {fleet.names[a.host] for a in misconfigured} & (set(ed.ever_excluded) - set(ed.bad))


def test_fleet_view_over_a_ledger_of_50000_verdicts_agrees_with_the_policy(tmp_path):
    fleet = bench.make_fleet(1_000, 11)
    jobs = bench.make_jobs(46_000, 30, 11)
    end = bench.T0 + 30 * DAY_S
    res = bench.simulate("elastic_diag", jobs, fleet, seed=11, end=end, keep=True)
    assert len(res.history) >= 50_000
    check = bench.ledger_check(res, fleet, tmp_path / "ledger.sqlite", rank_hosts=False)  # the fleet never reads them
    assert check["verdicts"] == len(res.history) and check["node_blamed"] > 0
    assert check["policy_recommendation"] and check["agree"], check
    # the same ledger read at an earlier moment (the end of a UTC day: fleet_view counts whole days) agrees with
    # the rule over the rows of that window
    ledger = Ledger(f"sqlite:///{tmp_path / 'ledger.sqlite'}")
    mid = end - 10 * DAY_S - 0.001
    rule = ExclusionRule()
    start = bench.window_start(mid, rule)
    rows = [(fleet.names[a.host] if a.host is not None else None, a.job.name, a.fp, a.end) for a in res.history
            if a.blame == "node" and start - rule.hold_days * DAY_S <= a.end <= mid]  # fmt: skip
    counted, _ = bench.node_failures(r for r in rows if r[3] >= start)
    view = fleet_view(ledger, rule, now=mid)
    ledger.close()
    kept = bench.held(rows, rule, mid)
    assert kept and set(view["exclude"]) == set(bench.recommended(counted, rule)) | set(kept)
