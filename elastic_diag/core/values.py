"""Values read from JSON that another process wrote (a rank's record, another node's, an older version's
file): each reader returns the value when it has the expected type and None otherwise, never raising.
Also the name of the signal an exit status stands for. Pure: no torch, no I/O.
"""

from __future__ import annotations

import math
import signal
from typing import Any


def as_seconds(value: Any) -> float | None:
    """A time or duration: a finite number, else None."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def as_int(value: Any) -> int | None:
    """An integer (not a bool), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def as_text(value: Any, limit: int = 100_000) -> str | None:
    """A non-empty string, cut to ``limit`` characters, else None."""
    return value[:limit] if isinstance(value, str) and value else None


def signal_name(exit_code: int | None) -> str | None:
    """``SIGKILL`` for an exit code of -9 (Popen's convention), else None."""
    if exit_code is None or exit_code >= 0:
        return None
    try:
        return signal.Signals(-exit_code).name
    except ValueError:
        return f"SIG{-exit_code}"
