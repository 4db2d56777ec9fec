"""The set-up every way of launching shares (``torchrun-diag``, ``elastic_diag.elastic_launch`` and plain
torchrun with ``--rdzv-backend diag+c10d``): the restart policy loaded and the diag dir checked before
any worker starts (a usage error, not a failed job), the run's session, and our LogsSpecs in place of
the launch's own, keeping its ``--log-dir``, ``--redirects``, ``--tee`` and ``--local-ranks-filter``.
"""

from __future__ import annotations

import logging

import torch

from elastic_diag._compat import torch_version_problem
from elastic_diag.agent.logs_specs import DiagLogsSpecs
from elastic_diag.config import ENV_TERMINATION_LOG, DiagConfig
from elastic_diag.core.verification import JobFacts
from elastic_diag.gate.policy import load_policy
from elastic_diag.layout import ENV_BEACON, ENV_PROGRESS_INTERVAL
from elastic_diag.report.session import DiagSession
from elastic_diag.report.termination import termination_log_problem

logger = logging.getLogger(__name__)


def open_session(
    config: DiagConfig, *, run_id: str, logs_specs: object, job: JobFacts | None = None
) -> tuple[DiagSession, DiagLogsSpecs]:
    """The run's session (with its restart policy) and the LogsSpecs to launch with. Raises UsageError
    for a policy that cannot be loaded or a diag dir that cannot be written. ``job``: what the
    verification commands re-run (launch/relaunch.py)."""
    policy = load_policy(config.restart_policy)
    config.check_writable()
    session = DiagSession(config, run_id=run_id)
    session.mark_running()
    session.policy = policy
    session.job = job
    if config.termination_log is not None and (why := termination_log_problem(config.termination_log)) is not None:
        text = (f"no termination message: {config.termination_log} cannot be written ({why}); set "
                f"--diag-termination-log / {ENV_TERMINATION_LOG} to a writable file or 'off'")  # fmt: skip
        logger.warning("elastic_diag: %s", text)
        session.note(text)
        session.termination_log = None
    problem = torch_version_problem(torch.__version__)
    if problem is not None:
        logger.warning("elastic_diag: %s", problem)
        session.note(problem)
    specs = DiagLogsSpecs.replacing(logs_specs, config.diag_dir)
    # the beacon's settings for the ranks of this launch (the user's own variables win)
    if config.monitored:
        specs.rank_env = {ENV_PROGRESS_INTERVAL: f"{config.progress_interval_s:g}"}
    else:  # neither a hang verdict nor a stall snapshot: nothing reads the ranks' progress
        specs.rank_env = {ENV_BEACON: "0"}  # no beacon thread, no hooks
    return session, specs
