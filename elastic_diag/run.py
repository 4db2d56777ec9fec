"""``python -m elastic_diag.run`` and the ``torchrun-diag`` console script of earlier installs: the
command lives in :mod:`elastic_diag.launch.run`."""

from elastic_diag.launch.arguments import get_parser
from elastic_diag.launch.run import _entry, main

__all__ = ["_entry", "get_parser", "main"]

if __name__ == "__main__":
    _entry()
