"""Every difference between torch versions, in one place.

elastic_diag extends torch through its seams (entry points, LogsSpecs, the agent's template methods)
and keeps one copy of torch's code: ``launch_agent`` (:mod:`elastic_diag.launch.launcher`), which
follows ``torch/distributed/launcher/api.py`` of torch 2.13.0. The private names that copy and the
agent rely on are imported or read here, so an upgrade is checked in this one file:

- ``torch.distributed.launcher.api._get_addr_and_port`` / ``_get_entrypoint_name`` (the copy uses them
  as torch's own ``launch_agent`` does);
- ``LocalElasticAgent._pcontext.subprocess_handlers[local_rank].proc`` (the workers' Popen objects: the
  capture watches their exits before torch's monitor reaps them);
- ``LocalElasticAgent._logs_specs`` and ``_remaining_restarts`` (the agent's own state, read and set by
  DiagAgent's template-method overrides).

:data:`SUPPORTED_TORCH` is the range pyproject.toml declares; :func:`torch_version_problem` says when
the installed torch is outside it (the launcher prints it once, and runs on).
"""

from __future__ import annotations

from typing import Any

SUPPORTED_TORCH = ((2, 13), (2, 14))  # [min, max): the versions the launch_agent copy follows
TESTED_TORCH = "2.13.0"


def _major_minor(version: str) -> tuple[int, int] | None:
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def torch_version_problem(version: str) -> str | None:
    """None when ``version`` (``torch.__version__``) is in the supported range, else what to tell the user."""
    got = _major_minor(version)
    low, high = SUPPORTED_TORCH
    if got is not None and low <= got < high:
        return None
    return (f"elastic_diag follows torch {low[0]}.{low[1]}'s launch_agent (tested with {TESTED_TORCH}); torch "
            f"{version} is installed: the diagnosis may miss evidence (see elastic_diag/_compat.py)")  # fmt: skip


def launcher_helpers() -> tuple[Any, Any]:
    """torch's private ``_get_addr_and_port`` and ``_get_entrypoint_name`` (torch/distributed/launcher/api.py)."""
    from torch.distributed.launcher.api import _get_addr_and_port, _get_entrypoint_name

    return _get_addr_and_port, _get_entrypoint_name


def worker_processes(pcontext: Any) -> dict[int, Any] | None:
    """local rank -> Popen of the agent's workers (``SubprocessContext.subprocess_handlers``), or None when
    the workers are not subprocesses (torch's multiprocessing start method for function entrypoints)."""
    handlers = getattr(pcontext, "subprocess_handlers", None)
    if not handlers:
        return None
    return {lr: h.proc for lr, h in handlers.items()}
