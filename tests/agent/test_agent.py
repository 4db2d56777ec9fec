"""DiagAgent's own helpers, without an agent: the verdict from torch's failure list when no evidence
folder could be laid out, and what a rendezvous that timed out knew. (DiagAgent itself runs in every
live test: tests/launch/test_launcher_matrix.py, tests/agent/test_cluster.py, tests/gate/test_gate.py.)"""

from __future__ import annotations

import json
import os
import signal
from datetime import timedelta
from types import SimpleNamespace

from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from elastic_diag.agent.agent import evidence_from_failures, rendezvous_context
from elastic_diag.core.classify import classify_attempt


def test_the_verdict_from_torchs_failure_list_alone(tmp_path):
    """Rank 1 raised (its torchelastic error file says what), rank 0 was SIGTERMed by torch's teardown,
    rank 2 is absent from the list: it exited 0."""
    rank_dir = tmp_path / "rank_1"
    rank_dir.mkdir()
    error_file = rank_dir / "error.json"
    error_file.write_text(json.dumps({"message": {"message": "KeyError: 'label'", "extraInfo": {
        "py_callstack": "Traceback (most recent call last):\n  File \"train.py\", line 3\nKeyError: 'label'",
        "timestamp": "1764432000"}}}))  # fmt: skip
    failures = {
        0: ProcessFailure(local_rank=0, pid=101, exitcode=-signal.SIGTERM, error_file=str(tmp_path / "none")),
        1: ProcessFailure(local_rank=1, pid=102, exitcode=1, error_file=str(error_file)),
    }
    group = SimpleNamespace(workers=[SimpleNamespace(global_rank=r, local_rank=r) for r in range(3)])
    evidence = evidence_from_failures(0, failures, group, "node-a")  # type: ignore[arg-type]
    by_rank = {r.rank: r for r in evidence.ranks}
    assert by_rank[0].stopped_by_agent and by_rank[0].exit_code == -signal.SIGTERM
    assert by_rank[1].exception is not None and by_rank[1].exception.type == "KeyError"
    assert by_rank[2].exit_code == 0 and by_rank[2].exception is None
    diagnosis = classify_attempt(evidence)
    assert (diagnosis.initiating_rank, diagnosis.exception_type) == (1, "KeyError")
    assert diagnosis.roles[0] == "stopped" and diagnosis.roles[2] == "healthy"


def test_every_rank_sigtermed_is_no_rank_stopped_by_the_launcher(tmp_path):
    """All SIGTERMed and no rank failed by itself: a kill from outside, not the launcher's teardown."""
    failures = {r: ProcessFailure(local_rank=r, pid=100 + r, exitcode=-signal.SIGTERM, error_file="") for r in range(2)}
    group = SimpleNamespace(workers=[SimpleNamespace(global_rank=r, local_rank=r) for r in range(2)])
    evidence = evidence_from_failures(0, failures, group, "node-a")  # type: ignore[arg-type]
    assert not any(r.stopped_by_agent for r in evidence.ranks)
    assert classify_attempt(evidence).failure_class == "killed"


def test_what_a_rendezvous_that_timed_out_knew():
    settings = SimpleNamespace(min_nodes=2, max_nodes=2, timeout=SimpleNamespace(join=timedelta(seconds=30)))
    participant = SimpleNamespace(addr="host-b", pid=4242)
    holder = SimpleNamespace(sync=lambda: None, state=SimpleNamespace(participants=[participant], wait_list=()))
    handler = SimpleNamespace(_settings=settings, _state_holder=holder)
    ctx = rendezvous_context(handler, "host-a")
    assert (ctx["min_nodes"], ctx["max_nodes"], ctx["join_timeout_s"]) == (2, 2, 30.0)
    assert ctx["joined"] == [f"host-a (pid {os.getpid()}, this node)", "host-b (pid 4242)"]


def test_a_rendezvous_without_readable_state_still_names_this_node():
    ctx = rendezvous_context(SimpleNamespace(), "host-a")  # not torch's dynamic rendezvous: no private state
    assert "joined_error" in ctx and ctx["joined"] == [f"host-a (pid {os.getpid()}, this node)"]
    assert "min_nodes" not in ctx
