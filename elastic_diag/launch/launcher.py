"""Our one copy of torch's ``launch_agent``, with the agent class as a parameter.

Follows ``torch/distributed/launcher/api.py::launch_agent`` of torch 2.13.0, minus the Meta-internal
early health-check server. torch hard-codes ``LocalElasticAgent`` there (line 356); this copy builds
:class:`~elastic_diag.agent.agent.DiagAgent` with the run's :class:`~elastic_diag.report.session.DiagSession`.
Compare with the installed torch on every upgrade (:mod:`elastic_diag._compat` holds the version range and the
private names this copy and the agent use).
"""

from __future__ import annotations

import os
import traceback
import uuid
from collections.abc import Callable
from typing import Any

from torch.distributed.elastic import events, metrics
from torch.distributed.elastic.agent.server.api import WorkerSpec
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous import registry as rdzv_registry
from torch.distributed.launcher.api import LaunchConfig

from elastic_diag._compat import launcher_helpers
from elastic_diag.agent.agent import DiagAgent
from elastic_diag.config import DiagConfig
from elastic_diag.layout import ENV_DISABLE_SHARED_STORE
from elastic_diag.report.session import DiagSession

# Restarts with gloo and the shared rendezvous TCPStore fail in torch 2.13 ("Gloo connectFullMesh
# failed"); with sharing off, rank 0 of each round publishes a fresh master port and restarts work.


def launch_agent(
    config: LaunchConfig,
    entrypoint: Callable[..., Any] | str | None,
    args: list[Any],
    *,
    session: DiagSession,
    agent_cls: type[DiagAgent] = DiagAgent,
) -> dict[int, Any]:
    if not config.run_id:
        config.run_id = str(uuid.uuid4().int)
    session.run_id = config.run_id
    if config.max_restarts > 0 or config.min_nodes != config.max_nodes:
        # a restart (or a membership change, which restarts the workers) through the shared rendezvous
        # store fails in Gloo connectFullMesh in torch 2.13; a run with no restart keeps the shared store,
        # whose absence costs every rank 0.3 to 0.5 s of TCPStore connect retries at start
        # (python benchmarks/launcher.py phases: "first rank's first line -> last rank joined")
        os.environ.setdefault(ENV_DISABLE_SHARED_STORE, "1")

    _get_addr_and_port, _get_entrypoint_name = launcher_helpers()
    entrypoint_name = _get_entrypoint_name(entrypoint, args)
    rdzv_parameters = RendezvousParameters(
        backend=config.rdzv_backend,
        endpoint=config.rdzv_endpoint,
        run_id=config.run_id,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        local_addr=config.local_addr,
        **config.rdzv_configs,
    )
    master_addr, master_port = _get_addr_and_port(rdzv_parameters)
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = config.signals_to_handle

    spec = WorkerSpec(
        role=config.role,
        local_world_size=config.nproc_per_node,
        entrypoint=entrypoint,
        args=tuple(args),
        rdzv_handler=rdzv_registry.get_rendezvous_handler(rdzv_parameters),
        max_restarts=config.max_restarts,
        monitor_interval=config.monitor_interval,
        master_addr=master_addr,
        master_port=master_port,
        local_addr=config.local_addr,
        event_log_handler=config.event_log_handler,
        numa_options=config.numa_options,
        duplicate_stdout_filters=config.duplicate_stdout_filters,
        duplicate_stderr_filters=config.duplicate_stderr_filters,
        virtual_local_rank=config.virtual_local_rank,
    )
    agent = agent_cls(
        spec=spec,
        logs_specs=config.logs_specs,
        start_method=config.start_method,
        log_line_prefix_template=config.log_line_prefix_template,
        shutdown_timeout=config.shutdown_timeout,
        session=session,
    )

    shutdown_rdzv = True
    try:
        metrics.initialize_metrics(metrics.MetricsConfig(config.metrics_cfg))  # type: ignore[attr-defined]
        result = agent.run()
        events.record(agent.get_event_succeeded(), config.event_log_handler)
        if result.is_failed():
            raise ChildFailedError(name=entrypoint_name, failures=result.failures)
        values: dict[int, Any] = result.return_values
        return values
    except ChildFailedError:
        raise
    except SignalException:
        # the agent was signalled: keep the rendezvous open for other agents (as torch does)
        shutdown_rdzv = False
        events.record(agent.get_event_failed(), config.event_log_handler)
        raise
    except Exception:
        events.record(agent.get_event_failed(), config.event_log_handler)
        raise
    finally:
        if shutdown_rdzv:
            spec.rdzv_handler.shutdown()


def elastic_launch(
    config: LaunchConfig,
    entrypoint: Callable[..., Any] | str | None,
    diag: DiagConfig | None = None,
) -> Callable[..., dict[int, Any]]:
    """torch's ``elastic_launch(config, entrypoint)(*args)`` with the diagnosis on: the same call,
    and the report in ``diag.diag_dir`` (default: settings from the environment and TOML, as the CLI).

    The restart gate is the one of ``diag.restart_policy``; a ChildFailedError is raised as torch's
    own launcher raises it, after report.json is written."""

    def launch(*args: Any) -> dict[int, Any]:
        from elastic_diag.launch.relaunch import job_facts
        from elastic_diag.launch.setup import open_session

        settings = diag or DiagConfig.resolve()
        session, config.logs_specs = open_session(settings, run_id=config.run_id or "", logs_specs=config.logs_specs,
                                                  job=job_facts("api", settings))  # fmt: skip
        try:
            result = launch_agent(config, entrypoint, list(args), session=session)
        except ChildFailedError:
            session.end("failed")
            raise
        except SignalException as e:
            session.end("stopped", signum=int(e.sigval))
            raise
        except Exception as e:
            session.end("failed", launch_error="".join(traceback.format_exception(e)))
            raise
        session.end("succeeded")
        return result

    return launch
