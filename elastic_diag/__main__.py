"""``python -m elastic_diag``: the same as ``elastic-diag``."""

from elastic_diag.cli import _entry

_entry()
