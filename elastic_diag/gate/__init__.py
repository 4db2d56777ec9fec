"""The restart gate: a policy (:mod:`~elastic_diag.gate.policy`, pure) says whether a failed attempt may
be restarted, and the verification controls (:mod:`~elastic_diag.gate.controls`, subprocesses) must
pass first. The names users write (``elastic_diag.gate.RestartPolicy``, ``Decision``, ``AttemptOutcome``,
the built-in policies) are importable from here. The controls' names load the controls (and what they
run with: tenacity, urllib) when first used, not with the policy a launcher reads before its ranks start.
"""

from typing import Any

from elastic_diag.gate.policy import (
    BUILTIN_POLICIES,
    DETERMINISTIC_CLASSES,
    AttemptOutcome,
    Decision,
    GateRecord,
    RestartPolicy,
    always,
    ask_policy,
    load_policy,
    never,
    verified,
)
from elastic_diag.layout import latest_checkpoint

__all__ = [
    "BUILTIN_POLICIES",
    "DETERMINISTIC_CLASSES",
    "AttemptOutcome",
    "ControlContext",
    "ControlResult",
    "Decision",
    "GateRecord",
    "RestartPolicy",
    "always",
    "ask_policy",
    "latest_checkpoint",
    "load_policy",
    "never",
    "verified",
    "verify",
]


def __getattr__(name: str) -> Any:
    if name in ("ControlContext", "ControlResult", "verify"):
        from elastic_diag.gate import controls

        return getattr(controls, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
