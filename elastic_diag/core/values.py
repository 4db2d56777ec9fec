"""Values read from JSON that another process wrote (a rank's record, another node's, an older version's
file): each reader returns the value when it has the expected type and a value a run can have, and None
otherwise (``1e308``, ``NaN``, a pid of -5, an integer of 400 digits: junk, not facts), never raising.
Also the name of the signal an exit status stands for. Pure: no torch, no I/O.
"""

from __future__ import annotations

import signal
from typing import Any

# a time (epoch seconds) or a duration beyond this is junk: later than the year 2286, or three centuries long
MAX_SECONDS = 1e10
# what a 64-bit field can hold (an exit status, a pid, a step, a byte offset): a longer integer is junk
MAX_INT = 2**63 - 1
# torch's ranks are C ints: a larger rank number (a log's "[rank<5,000 digits>]:") names no process
MAX_RANK = 2**31 - 1


def as_seconds(value: Any) -> float | None:
    """A time or duration: a number from 0 to :data:`MAX_SECONDS`, else None (negative, NaN, infinite, 1e308)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if isinstance(value, int) and not 0 <= value <= MAX_SECONDS:  # float() of a 400-digit int overflows
        return None
    return float(value) if 0 <= value <= MAX_SECONDS else None  # NaN compares False


def as_int(value: Any) -> int | None:
    """An integer (not a bool) a 64-bit field can hold, else None."""
    if isinstance(value, int) and not isinstance(value, bool) and -MAX_INT <= value <= MAX_INT:
        return value
    return None


def as_count(value: Any) -> int | None:
    """A pid, a count, a step, a byte offset, a local rank: a non-negative :func:`as_int`, else None."""
    number = as_int(value)
    return number if number is not None and number >= 0 else None


def as_rank(value: Any) -> int | None:
    """A rank: an integer from 0 to :data:`MAX_RANK`, else None."""
    number = as_int(value)
    return number if number is not None and 0 <= number <= MAX_RANK else None


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
