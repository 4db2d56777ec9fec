"""elastic_diag: a torchrun / TorchElastic plugin that names the rank that failed first.

The package imports nothing heavy at import time: the worker bootstrap loads it in every rank
before the user's script, and ``elastic-diag analyze`` runs without torch.
"""

from __future__ import annotations

from elastic_diag.beacon import heartbeat, watch

__version__ = "0.1.0"

__all__ = ["__version__", "heartbeat", "watch"]
