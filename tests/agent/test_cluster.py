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
