"""Settings of a diagnosed run: one frozen dataclass, validated on construction.

Precedence: command line > environment > default. Environment variable names are the constants
below.
"""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from elastic_diag.errors import UsageError

ENV_DIAG_DIR = "ELASTIC_DIAG_DIR"
ENV_GRACE = "ELASTIC_DIAG_GRACE"
ENV_STACK_TIMEOUT = "ELASTIC_DIAG_STACK_TIMEOUT"
ENV_HANG_TIMEOUT = "ELASTIC_DIAG_HANG_TIMEOUT"

DEFAULT_RUNS_DIR = "elastic_diag_runs"
DEFAULT_GRACE_S = 5.0
DEFAULT_STACK_TIMEOUT_S = 2.0
DEFAULT_TAIL_LINES = 40


def default_diag_dir(now: float | None = None) -> Path:
    """A durable, unique folder under the working directory (never a temp dir)."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    return Path.cwd() / DEFAULT_RUNS_DIR / f"{stamp}-{uuid.uuid4().hex[:6]}"


def parse_hang_timeout(raw: str, source: str = "--diag-hang-timeout") -> float | None:
    """``auto`` -> None (the automatic threshold), ``off`` -> 0.0, else seconds (> 0)."""
    value = raw.strip().lower()
    if value in ("", "auto"):
        return None
    if value in ("off", "0", "none", "false"):
        return 0.0
    try:
        seconds = float(value)
    except ValueError as e:
        raise UsageError(f"{source} {raw!r}: expected auto, off, or a number of seconds") from e
    if not 0 < seconds <= 7 * 86400:
        raise UsageError(f"{source} {raw!r}: must be more than 0 seconds and at most a week")
    return seconds


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError as e:
        raise UsageError(f"{name}={raw!r} is not a number of seconds") from e


@dataclass(frozen=True, slots=True, kw_only=True)
class DiagConfig:
    """How the diagnosis runs.

    ``grace_s``: after the first failure, how long to wait for the other ranks to exit on their own
    before their stacks are taken and the group is torn down (ends early when all have exited).
    ``stack_timeout_s``: how long to wait for the stack dumps of ranks still alive.
    ``hang_timeout_s``: the health monitor's threshold (None: automatic, 0: off).
    """

    diag_dir: Path
    grace_s: float = DEFAULT_GRACE_S
    stack_timeout_s: float = DEFAULT_STACK_TIMEOUT_S
    tail_lines: int = DEFAULT_TAIL_LINES
    hang_timeout_s: float | None = None  # None: automatic threshold; 0: health monitor off

    def __post_init__(self) -> None:
        if not 0 <= self.grace_s <= 600:
            raise UsageError(f"--diag-grace {self.grace_s}: must be between 0 and 600 seconds")
        if not 0 <= self.stack_timeout_s <= 60:
            raise UsageError(f"--diag-stack-timeout {self.stack_timeout_s}: must be between 0 and 60 seconds")
        if not 1 <= self.tail_lines <= 10_000:
            raise UsageError(f"--diag-tail-lines {self.tail_lines}: must be between 1 and 10000")

    @classmethod
    def resolve(
        cls,
        *,
        diag_dir: str | None = None,
        grace_s: float | None = None,
        stack_timeout_s: float | None = None,
        tail_lines: int | None = None,
        hang_timeout: str | None = None,
    ) -> DiagConfig:
        """CLI values (None when not given) over environment over defaults."""
        raw_dir = diag_dir or os.environ.get(ENV_DIAG_DIR)
        return cls(
            diag_dir=Path(raw_dir).absolute() if raw_dir else default_diag_dir(),
            grace_s=grace_s if grace_s is not None else _env_float(ENV_GRACE, DEFAULT_GRACE_S),
            stack_timeout_s=(
                stack_timeout_s
                if stack_timeout_s is not None
                else _env_float(ENV_STACK_TIMEOUT, DEFAULT_STACK_TIMEOUT_S)
            ),
            tail_lines=tail_lines if tail_lines is not None else DEFAULT_TAIL_LINES,
            hang_timeout_s=(
                parse_hang_timeout(hang_timeout)
                if hang_timeout is not None
                else parse_hang_timeout(os.environ.get(ENV_HANG_TIMEOUT, ""), ENV_HANG_TIMEOUT)
            ),
        )

    def check_writable(self) -> None:
        """Create the diag dir and prove it writable, or raise a UsageError naming it."""
        try:
            self.diag_dir.mkdir(parents=True, exist_ok=True)
            probe = self.diag_dir / f".write-probe-{os.getpid()}"
            probe.write_text("ok")
            probe.unlink()
        except OSError as e:
            raise UsageError(
                f"the diag dir {str(self.diag_dir)!r} is not writable ({e.strerror or e}); "
                f"pass --diag-dir DIR or set {ENV_DIAG_DIR} to a folder you can write"
            ) from e
