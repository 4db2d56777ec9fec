"""What the terminal shows: colour and compact tables on a TTY, plain text everywhere else.

Colour only when the stream is a terminal, ``NO_COLOR`` is unset and ``TERM`` is not ``dumb``
(https://no-color.org); a log file or a pipe gets the same words with no escape codes. The progress
line (:class:`Progress`) redraws one line of a TTY while something slow runs (a verification
control, an analysis of many files) and prints nothing at all elsewhere.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from types import TracebackType
from typing import IO, Any

_CODES = {"bold": "1", "dim": "2", "red": "31", "green": "32", "yellow": "33", "blue": "34", "magenta": "35"}
ROLE_STYLE = {"initiating": ("bold", "red"), "collateral": ("yellow",), "stopped": ("dim",), "healthy": ("green",)}


def is_tty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def wants_colour(stream: Any) -> bool:
    return is_tty(stream) and "NO_COLOR" not in os.environ and os.environ.get("TERM") != "dumb"


class Paint:
    """``paint("text", "bold", "red")``: ANSI-styled when enabled, the text itself otherwise."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def __call__(self, text: str, *styles: str) -> str:
        if not self.enabled or not styles:
            return text
        codes = ";".join(_CODES[s] for s in styles)
        return f"\x1b[{codes}m{text}\x1b[0m"


def table(header: Sequence[str], rows: Sequence[Sequence[str]], paint: Paint | None = None,
          row_styles: Sequence[tuple[str, ...]] = (), max_width: int = 60) -> list[str]:  # fmt: skip
    """Columns aligned to their widest cell (each cell clipped to ``max_width``)."""
    clipped = [[c if len(c) <= max_width else c[: max_width - 1] + "\u2026" for c in row] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in clipped)]) for i, h in enumerate(header)]
    paint = paint or Paint(False)

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()

    out = [paint(line(header), "bold")]
    for i, row in enumerate(clipped):
        styles = row_styles[i] if i < len(row_styles) else ()
        out.append(paint(line(row), *styles))
    return out


class Progress:
    """One self-redrawing line on a TTY while a slow step runs: ``with Progress("control collective"):``.

    ``update(text)`` changes the detail shown after the label; the elapsed time is added. On a
    stream that is not a terminal nothing is written, so logs stay clean."""

    def __init__(self, label: str, stream: IO[str] | None = None, interval: float = 0.2) -> None:
        import sys

        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = is_tty(self.stream)
        self.interval = interval
        self.detail = ""
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def update(self, detail: str) -> None:
        self.detail = detail

    def _draw(self) -> None:
        elapsed = time.monotonic() - self.started
        text = f"{self.label}: {self.detail} ({elapsed:.1f} s)" if self.detail else f"{self.label} ({elapsed:.1f} s)"
        with self._lock:
            try:
                self.stream.write("\r\x1b[K" + text[:200])
                self.stream.flush()
            except (OSError, ValueError):
                self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._draw()

    def __enter__(self) -> Progress:
        if self.enabled:
            self._draw()
            self._thread = threading.Thread(target=self._run, name="elastic-diag-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:  # fmt: skip
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1)
            with self._lock:
                try:
                    self.stream.write("\r\x1b[K")
                    self.stream.flush()
                except (OSError, ValueError):
                    pass
