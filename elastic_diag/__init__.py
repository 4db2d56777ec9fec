"""elastic_diag: a torchrun / TorchElastic plugin that names the rank that failed first.

The package imports nothing heavy at import time: the worker bootstrap loads it in every rank
before the user's script, and ``elastic-diag analyze`` runs without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from elastic_diag.worker.beacon import heartbeat, watch

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """``heartbeat`` and ``watch`` load with the worker's beacon on first use (``elastic-diag analyze`` never
    needs them: its start-up stays short)."""
    if name in ("heartbeat", "watch"):
        from elastic_diag.worker import beacon

        return getattr(beacon, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["__version__", "elastic_launch", "heartbeat", "watch"]


def elastic_launch(config: Any, entrypoint: Any, diag: Any = None) -> Any:
    """torch's ``elastic_launch(config, entrypoint)`` with the diagnosis on (imports torch lazily:
    see :func:`elastic_diag.launch.launcher.elastic_launch`)."""
    from elastic_diag.launch.launcher import elastic_launch as launch

    return launch(config, entrypoint, diag)
