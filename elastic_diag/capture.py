"""``torchrun --logs-specs diag`` under its first name (``elastic_diag.capture:DiagLogsSpecs``): it lives
in :mod:`elastic_diag.agent.logs_specs`."""

from elastic_diag.agent.logs_specs import DiagLogsSpecs

__all__ = ["DiagLogsSpecs"]
