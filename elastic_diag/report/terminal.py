"""What the terminal shows: colour and compact tables on a TTY, plain text everywhere else.

Colour only when the stream is a terminal, ``NO_COLOR`` is unset and ``TERM`` is not ``dumb``
(https://no-color.org); a log file or a pipe gets the same words with no escape codes. The progress
line (:class:`Progress`) redraws one line of a TTY while something slow runs (a verification
control, an analysis of many files) and prints nothing at all elsewhere.

What the ranks printed is untrusted: a worker's ESC / OSC / CSI sequences (a title change, a
hyperlink, a cursor move, a screen clear), a carriage return that overwrites the line, a bell, and
Unicode direction overrides must not reach the reader's terminal through the summary, ``analyze`` or
``report``. :func:`shown` is the one gate every text from evidence passes on its way to a terminal:
the secrets masked (:mod:`elastic_diag.redaction`) and each such character written as an escape
(``\x1b``, ``\r``, ``\u202e``), so the reader sees it and the terminal does nothing. Only the codes
:class:`Paint` adds itself are real escape sequences.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Sequence
from types import TracebackType
from typing import IO, Any

_CODES = {"bold": "1", "dim": "2", "red": "31", "green": "32", "yellow": "33", "blue": "34", "magenta": "35"}
ROLE_STYLE = {"initiating": ("bold", "red"), "collateral": ("yellow",), "stopped": ("dim",), "healthy": ("green",)}


# C0 controls but tab and line feed, DEL, C1 controls (0x9b is a one-character CSI), and the Unicode
# direction marks that reorder what is shown ("Trojan Source", CVE-2021-42574)
_UNPRINTABLE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")
_NAMED = {"\r": "\\r", "\x1b": "\\x1b", "\x00": "\\x00"}
MAX_DEPTH = 64


def printable(text: str) -> str:
    """``text`` with every character that would act on a terminal written as an escape."""
    if not _UNPRINTABLE.search(text):
        return text
    return _UNPRINTABLE.sub(lambda m: _escape(m.group()), text)


def _escape(ch: str) -> str:
    code = ord(ch)
    return _NAMED.get(ch) or (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")


def shown(text: str) -> str:
    """A text from evidence, as a terminal may show it: secrets masked, control characters escaped."""
    from elastic_diag import redaction

    return printable(redaction.current().text(text))


def shown_data(value: Any, depth: int = 0) -> Any:
    """:func:`shown` on every string inside dicts and lists (a report about to be formatted)."""
    if isinstance(value, str):
        return shown(value)
    if depth >= MAX_DEPTH and isinstance(value, dict | list | tuple):
        return f"(nested deeper than {MAX_DEPTH} levels: not shown)"
    if isinstance(value, dict):
        return {shown(k) if isinstance(k, str) else k: shown_data(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [shown_data(v, depth + 1) for v in value]
    return value


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
                self.stream.write("\r\x1b[K" + printable(text[:200]))
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
