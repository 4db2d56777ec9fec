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
from collections.abc import Callable
from datetime import datetime
from typing import Any

from torch.distributed.elastic.rendezvous.api import RendezvousHandler, RendezvousInfo, RendezvousParameters

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
    backend, store = create_backend(params)
    handler = DiagRendezvousHandler(create_dynamic(store, backend, params))
    try:
        select_diag_agent(params.run_id)
    except Exception as e:  # the job runs on as plain torchrun; say so
        logger.warning("elastic_diag: diag+c10d could not select the diagnosing agent (%r); running as c10d", e)
    return handler


def handler_factory() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """The ``torchrun.handlers`` entry point (called with no arguments at registration)."""
    return create_handler


def select_diag_agent(run_id: str) -> None:
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
        from elastic_diag.launch.setup import open_session

        session, kwargs["logs_specs"] = open_session(DiagConfig.resolve(), run_id=run_id,
                                                     logs_specs=kwargs.get("logs_specs"))  # fmt: skip
        session.note(f"started by torchrun --rdzv-backend {BACKEND} at {datetime.now().isoformat(timespec='seconds')}")
        return DiagAgent(*args, session=session, print_summary=True, **kwargs)

    build._elastic_diag_factory = True  # type: ignore[attr-defined]
    launcher_api.LocalElasticAgent = build


__all__ = ["BACKEND", "DiagRendezvousHandler", "create_handler", "handler_factory"]
