"""Several agents on 127.0.0.1 (c10d rendezvous, 2 nodes x 2 ranks): one global verdict on every node.

Node 0 hosts the rendezvous store (``is_host=1``); each agent has its own diag dir, as on separate
hosts. Also the record exchange itself on a real TCPStore: garbled and newer records, a store that
vanishes, bounded waits.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import EXAMPLE, ROOT, Run, kill_leftovers, launch, torchrun_diag

from elastic_diag.agent.cluster import StoreExchange, offset_from_ping
from elastic_diag.core import merge as nodes

MULTI = [pytest.mark.multiprocess, pytest.mark.timeout(200)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_nodes(tmp_path: Path, script: list[str], n: int = 2, env: dict[int, dict[str, str]] | None = None,
                nnodes: int | None = None, join_timeout: int = 20) -> list[subprocess.Popen[str]]:  # fmt: skip
    port, procs = free_port(), []
    for g in range(n):
        argv = [sys.executable, "-m", "elastic_diag.run", "--diag-dir", str(tmp_path / f"node{g}"), "--nnodes",
                str(nnodes or n), "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                f"127.0.0.1:{port}", "--rdzv-id", f"t{port}", "--rdzv-conf",
                f"is_host={int(g == 0)},join_timeout={join_timeout}",
                "--node-rank", str(g), str(EXAMPLE), *script]  # fmt: skip
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", **((env or {}).get(g, {}))}
        procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env,
                                      cwd=ROOT, start_new_session=True))  # fmt: skip
        time.sleep(0.3)  # node 0 first: it hosts the store
    return procs


def finish(procs: list[subprocess.Popen[str]], tmp_path: Path, timeout: float = 150) -> list[str]:
    errs = []
    try:
        for p in procs:
            _out, err = p.communicate(timeout=timeout)
            errs.append(err)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.communicate()
        for d in tmp_path.glob("node*"):
            kill_leftovers(d)
    return errs


def report(tmp_path: Path, g: int) -> dict:
    return json.loads((tmp_path / f"node{g}" / "report.json").read_text())


def verdict(rep: dict) -> tuple:
    d = rep["diagnosis"]
    return d["failure_class"], d["initiating_rank"], d["initiating_node"]


@pytest.mark.parametrize("inject, cls", [("exception", "python_exception"), ("sigkill", "killed"), ("hang", "hang")])
@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_every_node_names_the_same_rank_on_the_other_node(tmp_path, inject, cls):
    """hang: every node's health monitor (5 s) takes its ranks' stacks; only the merge sees that
    rank 3 was outside any collective while the other three waited in one."""
    env = {g: {"ELASTIC_DIAG_HANG_TIMEOUT": "5"} for g in range(2)}
    script = ["--inject", inject, "--culprit-rank", "3", "--pg-timeout", "300" if inject == "hang" else "30"]
    errs = finish(start_nodes(tmp_path, script, env=env), tmp_path)
    reps = [report(tmp_path, g) for g in range(2)]
    assert verdict(reps[0]) == verdict(reps[1]) == (cls, 3, f"{socket.gethostname()} (node 1)"), errs[0][-3000:]
    assert {r["rank"]: r["role"] for r in reps[0]["ranks"]}[3] == "initiating"
    assert len(reps[0]["ranks"]) == 4  # the leader's report holds every rank; node 1's its own, same roles
    assert {r["rank"]: r["role"] for r in reps[1]["ranks"]} == {r: {r["rank"]: r["role"] for r in reps[0]["ranks"]}[r]
                                                                for r in (2, 3)}  # fmt: skip
    assert reps[0]["attempts"][-1]["nodes"]["nodes"] == [f"{socket.gethostname()} (node {g})" for g in range(2)]


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_a_node_whose_clock_is_5_s_behind_does_not_change_the_verdict(tmp_path):
    """Node 1's clock (agent and ranks) runs 5 s behind. Its ranks fail only after the culprit (rank 1
    on node 0) but their raw times are 4 s EARLIER; the offset measured at the start fixes that."""
    script = ["--inject", "exception-after-cleanup", "--cleanup-seconds", "2", "--culprit-rank", "1", "--pg-timeout",
              "30"]  # fmt: skip
    errs = finish(start_nodes(tmp_path, script, env={1: {"ELASTIC_DIAG_CLOCK_SKEW": "-5"}}), tmp_path)
    reps = [report(tmp_path, g) for g in range(2)]
    assert verdict(reps[0]) == verdict(reps[1]), errs
    assert verdict(reps[1])[:2] == ("python_exception", 1)
    offset = reps[1]["attempts"][-1]["nodes"]["clock_offset_s"]
    assert abs(offset - 5.0) < 0.2, offset
    assert reps[1]["attempts"][-1]["nodes"]["decided_by"] == "group rank 0"
    times = {r["rank"]: r["first_error_time"] for r in reps[0]["ranks"]}  # the leader merged them all
    assert all(times[r] > times[1] for r in (2, 3) if times[r] is not None)  # on one clock: after the culprit


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_the_survivors_name_a_node_whose_agent_was_killed(tmp_path):
    procs = start_nodes(tmp_path, ["--steps", "400", "--pg-timeout", "60"])
    progress = tmp_path / "node1" / "attempt_0" / "rank_2" / "progress.json"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            if json.loads(progress.read_text())["steps"] >= 3:
                break
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.2)
    os.kill(procs[1].pid, signal.SIGKILL)  # the host is gone: its agent and its ranks
    kill_leftovers(tmp_path / "node1")
    errs = finish(procs, tmp_path)
    rep = report(tmp_path, 0)
    d = rep["diagnosis"]
    assert (d["failure_class"], d["initiating_rank"], d["signature_id"]) == ("killed", 2, "node-lost"), errs[0][-3000:]
    assert d["initiating_node"] == f"{socket.gethostname()} (node 1)"
    roles = {r["rank"]: r["role"] for r in rep["ranks"]}
    assert roles[0] == roles[1] == "collateral" and roles[2] == "initiating"
    assert rep["attempts"][-1]["nodes"]["missing_group_ranks"] == [1]


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_node_that_never_joins_is_named_with_the_timeout(tmp_path):
    procs = start_nodes(tmp_path, ["--steps", "3"], n=1, nnodes=2, join_timeout=8)
    errs = finish(procs, tmp_path, timeout=90)
    d = report(tmp_path, 0)["diagnosis"]
    assert d["failure_class"] == "rendezvous_timeout", errs[0][-2000:]
    assert "1 node(s) never joined" in d["summary"] and "after 8.0 s" in d["summary"]
    assert "this node" in d["summary"]


# -- the exchange on a real TCPStore ------------------------------------------------------------------


def record(g: int, rank: int, **extra) -> dict:
    rec = {"schema": nodes.SCHEMA, "node": f"h{g}", "group_rank": g, "attempt": 0, "clock_offset_s": 0.0,
           "decided_at": 100.0, "hang": None,
           "ranks": [{"rank": rank, "local_rank": 0, "exit_code": 1, "exit_time": 100.0 + rank,
                      "exception": {"type": "ValueError", "message": "bad", "traceback": "", "time": 100.0 + rank},
                      "stderr_tail": ["ValueError: bad"]}]}  # fmt: skip
    rec.update(extra)
    return rec


def test_garbled_and_newer_records_are_left_out_and_the_wait_is_bounded():
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ex = StoreExchange(store, "run1")
    ex.publish(0, 0, record(0, 0))
    store.set("elastic_diag/run1/record/0/1", "{not json")
    store.set("elastic_diag/run1/record/0/2", json.dumps(record(2, 2, schema="elastic_diag.node_record/9")))
    t0 = time.monotonic()
    records, problems = ex.records(0, 4, timeout_s=1.0)  # node 3 never publishes
    assert time.monotonic() - t0 < 3
    assert list(records) == [0]
    assert any("node 1: garbled record" in p for p in problems)
    assert any("node 2: record of schema 'elastic_diag.node_record/9'" in p for p in problems)
    m = nodes.merge(0, records, 4, {3: {"node": "h3", "ranks": [6, 7]}}, problems)
    assert m.missing == [1, 2, 3]


def test_a_store_that_disappears_raises_and_is_not_waited_on_forever():
    """The agent catches this and keeps its local verdict (agent.py: the local verdict stands)."""
    code = ("import sys, time; from torch.distributed import TCPStore; "
            "s = TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False); print(s.port, flush=True); "
            "time.sleep(60)")  # fmt: skip
    server = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        from datetime import timedelta

        from torch.distributed import TCPStore

        client = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=3))
        ex = StoreExchange(client, "run2")
        ex.publish(0, 1, record(1, 2))
        server.kill()
        server.wait()
        t0 = time.monotonic()
        with pytest.raises(Exception):  # noqa: B017 - torch raises DistStoreError or RuntimeError
            ex.records(0, 2, timeout_s=2.0)
        assert time.monotonic() - t0 < 10
    finally:
        server.kill()
        server.wait()
        if server.stdout is not None:
            server.stdout.close()


def test_clock_offset_from_a_ping():
    offset, rtt = offset_from_ping(t_send=10.0, t_leader=15.1, t_recv=10.2)
    assert offset == pytest.approx(5.0) and rtt == pytest.approx(0.2)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_an_unreachable_endpoint_and_a_port_in_use_are_diagnosed(tmp_path):
    """Node 1 of a job whose store never comes up (nothing listens); node 0 of a job whose store port is
    taken by another process on the host."""
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-id", "x", str(EXAMPLE)]

    def diag_run(name: str, port: int, conf: str) -> tuple[Run, dict]:
        argv = torchrun_diag("--diag-dir", str(tmp_path / name), "--rdzv-endpoint", f"127.0.0.1:{port}",
                             "--rdzv-conf", conf, *common)  # fmt: skip
        run = launch(argv, tmp_path / name, timeout=90)
        return run, run.report["diagnosis"]

    unreachable, d = diag_run("a", free_port(), "is_host=0,read_timeout=5")
    assert unreachable.returncode != 0 and d["failure_class"] == "rendezvous_timeout", unreachable.stderr[-2000:]
    assert d["signature_id"] == "store-connect-timeout"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        in_use, d = diag_run("b", taken.getsockname()[1], "is_host=1")
    assert in_use.returncode != 0 and d["failure_class"] == "port_conflict", in_use.stderr[-2000:]


def test_the_nodes_stall_records_merge_into_one_verdict():
    """Rank 0 (node 0) saved a checkpoint past the collective timeout while ranks 1 (node 0) and 2, 3 (node 1)
    waited in the barrier; then it reached the barrier and failed there like them. Each node's stall record
    saw its own ranks; merged, the stall names rank 0 and where it was. Node 1's clock is 2 s behind."""
    from elastic_diag.core.evidence import AttemptEvidence, RankEvidence
    from elastic_diag.core.exceptions import ExceptionRecord
    from elastic_diag.core.stall import StallRank, StallRecord

    closed = "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [::1]:4000"
    timed_out = ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 6000ms "
                 "for recv operation to complete")  # fmt: skip

    def rank(r: int, node: str, line: str, t: float) -> RankEvidence:
        etype, _, msg = line.partition(": ")
        return RankEvidence(rank=r, local_rank=r % 2, node=node, exit_code=1, exit_time=t + 0.2,
                            exception=ExceptionRecord(type=etype, message=msg, traceback=line, time=t))  # fmt: skip

    def stall(node: str, outside: dict[int, str], waiting: tuple[int, ...], at: float) -> StallRecord:
        ranks = [StallRank(rank=r, local_rank=r % 2, in_collective=False, where=w) for r, w in outside.items()]
        ranks += [StallRank(rank=r, local_rank=r % 2, in_collective=True, collective="barrier #9 (process group 0)")
                  for r in waiting]  # fmt: skip
        return StallRecord(number=1, node=node, since=at, detected_at=at + 2.0, threshold_s=2.0,
                           ranks=tuple(sorted(ranks, key=lambda x: x.rank)), ended_at=at + 9.0)  # fmt: skip

    save = "/job/train.py:27 in save_checkpoint"
    node0 = AttemptEvidence(attempt=0, ranks=(rank(0, "h0", closed, 109.0), rank(1, "h0", timed_out, 106.0)),
                            stalls=(stall("h0", {0: save}, (1,), 100.0),))  # fmt: skip
    node1 = AttemptEvidence(attempt=0, ranks=(rank(2, "h1", timed_out, 104.0), rank(3, "h1", timed_out, 104.0)),
                            stalls=(stall("h1", {}, (2, 3), 98.0),))  # fmt: skip
    records = {0: nodes.record_of(node0, node="h0", group_rank=0, offset=0.0),
               1: nodes.record_of(node1, node="h1", group_rank=1, offset=2.0)}  # fmt: skip
    m = nodes.merge(0, {g: json.loads(json.dumps(r)) for g, r in records.items()}, 2)
    d = m.diagnosis
    assert (d.initiating_rank, d.rule, d.signature_id) == (0, "outside_collective_at_stall",
                                                           "rank-outlasted-collective-timeout")  # fmt: skip
    assert save in d.summary and d.collateral_ranks == (1, 2, 3)
    merged = m.evidence.stall
    assert merged is not None and [r.rank for r in merged.outside] == [0] and merged.since == 100.0
