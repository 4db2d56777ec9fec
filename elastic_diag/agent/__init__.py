"""The elastic agent's side: :class:`~elastic_diag.agent.agent.DiagAgent` (torch's LocalElasticAgent
with the capture before teardown), the capture of one attempt (:mod:`~elastic_diag.agent.capture`),
the stack and py-spy dumps, the exchange with other nodes' agents (:mod:`~elastic_diag.agent.cluster`),
the health monitor, the line clock (:mod:`~elastic_diag.agent.tailer`) and the LogsSpecs that keeps
every rank's output (:mod:`~elastic_diag.agent.logs_specs`).

``from elastic_diag.agent import DiagAgent`` imports torch; the modules that do not need it
(health, tailer) import without it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["DiagAgent"]


def __getattr__(name: str) -> Any:
    if name == "DiagAgent":
        from elastic_diag.agent.agent import DiagAgent

        return DiagAgent
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
