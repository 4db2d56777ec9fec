"""The agent's clock and sleep, injected into everything that waits or stamps a time (so unit tests never
sleep), and the test hook that skews this host's clock to play a node whose clock is off.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from elastic_diag.layout import ENV_CLOCK_SKEW

Clock = Callable[[], float]
Sleep = Callable[[float], None]


def skewed_clock() -> Clock:
    try:
        skew = float(os.environ.get(ENV_CLOCK_SKEW, "") or 0.0)
    except ValueError:
        skew = 0.0
    if skew == 0.0:
        return time.time
    return lambda: time.time() + skew
