"""The config flag for existing jobs: ``torchrun --rdzv-backend diag+c10d`` (or
``PET_RDZV_BACKEND=diag+c10d torchrun ...``) turns the diagnosis on with no other change.

torch registers every ``torchrun.handlers`` entry point when its rendezvous module is imported,
calling it with no arguments; :func:`handler_factory` returns the creator torch then calls with the
rendezvous parameters (elastic/rendezvous/registry.py). The creator

* builds torch's own c10d rendezvous and wraps it, so ``get_backend()`` answers ``diag+c10d`` as
  torch requires of a registered name;
* selects :class:`~elastic_diag.agent.DiagAgent` for this launch: the creator runs inside
  ``launch_agent`` just before it builds its agent (launcher/api.py, torch 2.13), so it swaps the
  ``LocalElasticAgent`` name that ``launch_agent`` looks up for a one-shot factory that builds a
  DiagAgent (with DiagLogsSpecs, keeping the launch's --redirects/--tee) and restores the name.

Settings come from the environment (``ELASTIC_DIAG_DIR``, ...) and a ``[tool.elastic_diag]`` table,
as for torchrun-diag; the agent writes report.json and prints the summary when the run ends.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable
from datetime import datetime
from typing import Any

from torch.distributed.elastic.rendezvous.api import RendezvousHandler, RendezvousInfo, RendezvousParameters

from elastic_diag.layout import ENV_SWITCH

logger = logging.getLogger(__name__)

BACKEND = "diag+c10d"


class DiagRendezvousHandler(RendezvousHandler):
    """torch's c10d rendezvous, under the name ``diag+c10d``."""

    def __init__(self, inner: RendezvousHandler) -> None:
        self._inner = inner

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        return bool(self._inner.use_agent_store)

    def next_rendezvous(self) -> RendezvousInfo:
        return self._inner.next_rendezvous()

    def is_closed(self) -> bool:
        return self._inner.is_closed()

    def set_closed(self) -> None:
        self._inner.set_closed()  # type: ignore[no-untyped-call]

    def num_nodes_waiting(self) -> int:
        return self._inner.num_nodes_waiting()

    def get_run_id(self) -> str:
        return self._inner.get_run_id()

    def shutdown(self) -> bool:
        return self._inner.shutdown()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler as create_dynamic

    # as torchrun-diag does: with gloo, restarts through the shared rendezvous store fail in torch 2.13
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    own_endpoint(params)
    backend, store = create_backend(params)
    handler = DiagRendezvousHandler(create_dynamic(store, backend, params))
    try:
        select_diag_agent(params.run_id)
    except Exception as e:  # the job runs on as plain torchrun; say so
        logger.warning("elastic_diag: diag+c10d could not select the diagnosing agent (%r); running as c10d", e)
    return handler


def own_endpoint(params: RendezvousParameters) -> None:
    """A one-node ``diag+c10d`` job with no endpoint would bind torch's default ``localhost:29400``
    with run id ``none``, and a second such job on the host would join the first one's rendezvous.
    It gets what ``--standalone`` gives: a free port on 127.0.0.1 and a fresh run id."""
    if params.endpoint or params.max_nodes != 1:
        return
    params.endpoint = "127.0.0.1:0"
    if params.run_id in ("", "none"):
        params.run_id = f"diag-{uuid.uuid4().hex[:12]}"
    logger.info("elastic_diag: one node and no --rdzv-endpoint: rendezvous on %s, run id %s", params.endpoint,
                params.run_id)  # fmt: skip


def handler_factory() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """The ``torchrun.handlers`` entry point (called with no arguments at registration). With
    ``ELASTIC_DIAG=1`` it also wraps torch's own ``c10d`` and ``static`` creators (:func:`switch_on`)."""
    if switch_setting() == "on":
        wrap_torch_backends()
    return create_handler


WRAPPED = ("c10d", "static")  # what torchrun --standalone forces, what accelerate and TorchTitan pass


def switch_setting(environ: dict[str, str] | None = None) -> str:
    """``ELASTIC_DIAG``: "on" (1), "off" (unset, empty or 0), or "invalid" (anything else: said once,
    and the job runs as plain torchrun would)."""
    value = (os.environ if environ is None else environ).get(ENV_SWITCH, "").strip()
    if value in ("", "0"):
        return "off"
    if value == "1":
        return "on"
    logger.warning("elastic_diag: %s=%r is not 1 or 0; diagnosis stays off (set %s=1 to turn it on)",
                   ENV_SWITCH, value, ENV_SWITCH)  # fmt: skip
    return "invalid"


def wrap_torch_backends() -> None:
    """Replace torch's ``c10d`` and ``static`` creators by ones that build the very same handler (the
    backend keeps its name, so every torch branch that tests it behaves as before) and select the
    diagnosing agent for the launch, as ``diag+c10d`` does. torchrun-diag (which builds its own agent)
    takes the switch out of its environment."""
    from torch.distributed.elastic.rendezvous.api import rendezvous_handler_registry

    table: dict[str, Any] = rendezvous_handler_registry._registry  # the registry refuses a second creator
    for name in WRAPPED:
        original = table.get(name)
        if original is None or getattr(original, "_elastic_diag_wrapped", False):
            continue

        def creator(params: RendezvousParameters, _original: Any = original, _name: str = name) -> RendezvousHandler:
            if switch_setting() == "on":
                os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # as torchrun-diag does
            handler: RendezvousHandler = _original(params)
            if switch_setting() == "on":
                try:
                    select_diag_agent(params.run_id, f"{ENV_SWITCH}=1 (torchrun --rdzv-backend {_name})")
                except Exception as e:  # the job runs on as plain torchrun; say so
                    logger.warning("elastic_diag: %s=1 could not select the diagnosing agent (%r); running as "
                                   "plain torchrun", ENV_SWITCH, e)  # fmt: skip
            return handler

        creator._elastic_diag_wrapped = True  # type: ignore[attr-defined]
        table[name] = creator


def select_diag_agent(run_id: str, started_by: str = f"torchrun --rdzv-backend {BACKEND}") -> None:
    """Make the next ``LocalElasticAgent(...)`` built by torch's ``launch_agent`` a DiagAgent."""
    import torch.distributed.launcher.api as torch_launcher

    launcher_api: Any = torch_launcher  # its LocalElasticAgent name is what launch_agent calls
    original = launcher_api.LocalElasticAgent
    if getattr(original, "_elastic_diag_factory", False):
        return

    def build(*args: Any, **kwargs: Any) -> Any:
        launcher_api.LocalElasticAgent = original  # one launch only
        from elastic_diag.agent.agent import DiagAgent
        from elastic_diag.config import DiagConfig
        from elastic_diag.errors import UsageError
        from elastic_diag.launch.relaunch import job_facts
        from elastic_diag.launch.setup import open_session

        try:
            config = DiagConfig.resolve()
            session, logs_specs = open_session(config, run_id=run_id, logs_specs=kwargs.get("logs_specs"),
                                               job=job_facts("torchrun", config))  # fmt: skip
        except UsageError as e:  # a bad setting: say which, and run as plain torchrun would
            logger.warning("elastic_diag: %s; the job runs WITHOUT diagnosis, as plain torchrun", e)
            return original(*args, **kwargs)
        kwargs["logs_specs"] = logs_specs
        session.note(f"started by {started_by} at {datetime.now().isoformat(timespec='seconds')}")
        return DiagAgent(*args, session=session, print_summary=True, **kwargs)

    build._elastic_diag_factory = True  # type: ignore[attr-defined]
    launcher_api.LocalElasticAgent = build


__all__ = [
    "BACKEND",
    "DiagRendezvousHandler",
    "create_handler",
    "handler_factory",
    "switch_setting",
    "wrap_torch_backends",
]
