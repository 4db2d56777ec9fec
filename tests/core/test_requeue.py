"""Whether a failed run asks the scheduler for a requeue (core/requeue.py): retryable and no restart left here,
or a node lost; never a deterministic failure, never a stop from outside. Pure."""

from __future__ import annotations

import pytest

from elastic_diag.core.requeue import requeue_decision
from elastic_diag.core.verdict import Diagnosis, stopped_from_outside

NETWORK = Diagnosis(failure_class="network_error", signature_id="nccl-network-error", initiating_rank=3,
                    retryable=True)  # fmt: skip
EXCEPTION = Diagnosis(failure_class="python_exception", signature_id="python-exception", initiating_rank=1)
DESYNC = Diagnosis(failure_class="collective_desync", signature_id="collective-schedule-diverged")
NODE_LOST = Diagnosis(failure_class="killed", signature_id="node-lost")


@pytest.mark.parametrize(
    ("status", "final", "own", "gate", "requeue"),
    [
        ("failed", NETWORK, False, None, True),  # restarts used up (none were asked for)
        ("failed", NETWORK, False, {"decision": "refused", "verification_failed": True}, True),
        ("failed", NODE_LOST, False, None, True),
        ("failed", EXCEPTION, False, None, False),  # a plain exception of the code: it would repeat
        ("failed", EXCEPTION, True, None, True),  # ...unless its own exception is a retryable one
        ("failed", DESYNC, False, None, False),  # deterministic
        ("succeeded", None, False, None, False),
        ("stopped", stopped_from_outside("SIGTERM", 5, [0, 1]), False, None, False),  # the scheduler decides
    ],
    ids=["retryable", "verification-failed", "node-lost", "exception", "own-retryable", "desync", "ok", "stopped"],
)
def test_the_requeue_decision(status, final, own, gate, requeue):
    decision = requeue_decision(status, final, own_retryable=own, gate=gate, exit_code=75)
    assert decision.requeue is requeue, decision.reason
    assert decision.to_json()["exit_code"] == (75 if requeue else None)


def test_requeue_and_the_restart_gate_agree_on_what_is_deterministic():
    from elastic_diag.core import requeue
    from elastic_diag.gate import policy

    assert requeue.DETERMINISTIC_CLASSES == policy.DETERMINISTIC_CLASSES
