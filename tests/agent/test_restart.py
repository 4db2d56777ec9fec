"""The agent's restart gate, without an agent: the policy's decision, the controls it asks for (a real
shell command), the record report.json keeps, the resume variables, and one decision for several nodes
through a store (a dict here: the real store's exchange is tested in test_cluster.py)."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Any

from elastic_diag.agent.restart import RestartGate, diagnosis_id, resume_env
from elastic_diag.config import DiagConfig
from elastic_diag.core.classify import classify_attempt
from elastic_diag.core.evidence import AttemptEvidence, RankEvidence
from elastic_diag.core.exceptions import ExceptionRecord
from elastic_diag.core.verdict import Diagnosis
from elastic_diag.gate import policy
from elastic_diag.layout import ENV_PREVIOUS_DIAGNOSIS, ENV_RESUME_FROM
from elastic_diag.report.session import DiagSession

T0 = 1_764_432_000.0


def session_after(tmp_path, failure: str = "ValueError", **config) -> DiagSession:
    """A run whose attempt 0 failed: rank 1 raised ``failure``, ranks 0 and 2 lost their peer."""
    settings = DiagConfig(diag_dir=tmp_path / "diag", verify_retries=0, **config)
    session = DiagSession(settings, run_id="run7")
    lost = ExceptionRecord(type="RuntimeError", message="[../gloo/transport/tcp/pair.cc:553] Connection closed by "
                           "peer [127.0.0.1]:29500", traceback="", time=T0 + 1)  # fmt: skip
    own = ExceptionRecord(type=failure, message="bad shard 7", traceback='  File "train.py", line 9, in step\n',
                          time=T0)  # fmt: skip
    ranks = tuple(RankEvidence(rank=r, local_rank=r, node="a", exit_code=1, exit_time=T0 + 2,
                               exception=own if r == 1 else lost) for r in range(3))  # fmt: skip
    evidence = AttemptEvidence(attempt=0, ranks=ranks, run_id="run7")
    session.record_attempt(evidence, classify_attempt(evidence), status="failed", final=True)
    return session


def decide(gate: RestartGate, *args: Any, **kwargs: Any) -> tuple[dict[str, Any], Diagnosis]:
    """The gate's decision as report.json keeps it (GateRecord.to_json)."""
    record, diagnosis = gate.decide(*args, **kwargs)
    return record.to_json(), diagnosis


class DictStore:
    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def set(self, key: str, value: str) -> None:
        self.data[key] = value.encode()

    def get(self, key: str) -> bytes:
        return self.data[key]

    def wait(self, keys: list[str], timeout: timedelta) -> None:
        missing = [k for k in keys if k not in self.data]
        if missing:
            raise TimeoutError(f"no {missing} within {timeout}")


def test_never_refuses_and_says_so(tmp_path):
    session = session_after(tmp_path)
    session.policy = policy.never
    entry, diagnosis = decide(RestartGate(session), 0, nproc=3)
    assert diagnosis.initiating_rank == 1
    assert entry["decision"] == "refused" and entry["reason"] == "the restart policy is 'never'"
    assert entry["failure"] == "python_exception (ValueError) on rank 1 at train.py:9 in step"
    assert entry["controls"] == [] and entry["verification_failed"] is False and "resume_from" not in entry


def test_always_restarts_without_controls(tmp_path):
    session = session_after(tmp_path)
    session.policy = policy.always
    entry, _ = decide(RestartGate(session), 0, nproc=3)
    assert entry["decision"] == "restart" and entry["controls"] == [] and entry["resume_from"] is None


def test_a_failing_control_refuses_the_restart_and_keeps_its_output(tmp_path):
    session = session_after(tmp_path, failure="ConnectionError", verify=("echo checking; exit 3",),
                            verify_timeout_s=10)  # fmt: skip
    entry, _ = decide(RestartGate(session), 0, nproc=3)  # verified: a ConnectionError of its own is retryable
    assert entry["decision"] == "refused" and entry["verification_failed"] is True
    assert entry["reason"].startswith("verification failed: echo checking; exit 3")
    (control,) = entry["controls"]
    assert control["passed"] is False and Path(control["output_file"]).read_text().startswith("checking")


def test_the_same_failure_twice_is_not_restarted_again(tmp_path):
    session = session_after(tmp_path, failure="ConnectionError", verify=("true",), verify_timeout_s=10)
    gate = RestartGate(session)
    first, _ = decide(gate, 0, nproc=3)
    assert first["decision"] == "restart" and [c["passed"] for c in first["controls"]] == [True]
    again, _ = decide(gate, 0, nproc=3)  # the next attempt ended the same way, from the same checkpoint
    assert again["decision"] == "refused" and len(gate.history) == 2


def test_the_next_attempt_learns_the_checkpoint_and_the_verdict(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "step_100.pt").write_text("old")
    (ckpt / "step_200.pt").write_text("new")
    os.utime(ckpt / "step_100.pt", (T0, T0))
    session = session_after(tmp_path, checkpoint_dir=ckpt)
    diagnosis = session.attempts[0].diagnosis
    env = resume_env(session, 0, diagnosis)
    assert env == {ENV_RESUME_FROM: str(ckpt / "step_200.pt"),
                   ENV_PREVIOUS_DIAGNOSIS: "run7/attempt_0/python-exception/rank1"}  # fmt: skip
    assert diagnosis_id("", 2, Diagnosis(failure_class="hang")) == "run/attempt_2/hang/rank?"


def test_the_other_nodes_follow_group_rank_0_or_decide_alone(tmp_path):
    store = DictStore()
    leader = session_after(tmp_path / "a")
    leader.policy = policy.never
    decided, _ = decide(RestartGate(leader), 0, nproc=3, nodes=2, group_rank=0, store=store)
    follower = session_after(tmp_path / "b")
    follower.policy = policy.always  # its own policy would restart: the leader's decision wins
    followed, _ = decide(RestartGate(follower), 0, nproc=3, nodes=2, group_rank=1, store=store)
    assert followed == {**decided, "decided_by": "group rank 0"}
    alone = session_after(tmp_path / "c")
    alone.policy = policy.always
    entry, _ = decide(RestartGate(alone), 1, nproc=3, nodes=2, group_rank=1, store=store)  # nothing for attempt 1
    assert entry["decision"] == "restart" and "decided_by" not in entry
    assert any("no restart decision from group rank 0" in n for n in alone.notes)
