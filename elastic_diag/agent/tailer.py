"""The launcher's line clock: every rank's stdout and stderr read as they grow, each line stamped with
its arrival time, and each rank's first error of its own kept (:mod:`elastic_diag.core.error_lines`).

A daemon thread polls the files the ranks write into (``stdout.log``, ``stderr.log`` in the rank's
folder) every :data:`POLL_S`. Reads are bounded: a rank that floods its output costs a seek, not
the agent's memory or CPU: the thread takes at most a tenth of a core (about 3 MB/s of output scanned
at full rate, measured), and beyond :data:`SKIP_AFTER` bytes behind it jumps to the last
:data:`RESUME_BYTES`. The first own error found is written to ``first_error.json`` in the rank's
folder at once, so it survives the agent and the offline analyzer reads it too.
"""

from __future__ import annotations

import codecs
import contextlib
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from elastic_diag.core.error_lines import ErrorScanner, error_line_to_json
from elastic_diag.core.evidence import ErrorLine
from elastic_diag.core.taxonomy import Taxonomy, load_taxonomy
from elastic_diag.layout import FIRST_ERROR_FILE, STREAM_FILES, write_json_atomic

POLL_S = 0.1  # a line is stamped within this of its arrival (each wake-up costs the agent CPU on a loaded host)
IDLE_POLL_S = 0.2  # quiet streams are read less often: a line after a quiet spell is stamped up to this late
DUTY = 9.0  # sleep this many times the last poll's duration: at most 10% of a core
READ_BYTES = 1 << 20  # per stream and poll
SKIP_AFTER = 8 << 20  # this far behind, jump ahead: the lines that matter are rare
RESUME_BYTES = 256 << 10
_SPLIT = re.compile(r"\r\n|\r|\n")


@dataclass(slots=True)
class _Stream:
    path: Path
    scanner: ErrorScanner
    offset: int = 0
    fd: int | None = None  # kept open: an fstat and a pread a poll, no path lookup
    partial: str = ""
    skipped: int = 0
    decoder: codecs.IncrementalDecoder = field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace"))


class StreamTailer:
    """Reads the streams of several ranks (``rank_dirs``: key -> the rank's folder)."""

    def __init__(
        self,
        rank_dirs: dict[int, Path],
        taxonomy: Taxonomy | None = None,
        clock: Callable[[], float] = time.time,
        poll_s: float = POLL_S,
    ) -> None:
        tax = taxonomy or load_taxonomy()
        self._clock = clock
        self._poll_s = poll_s
        self._dirs = dict(rank_dirs)
        self._streams = {
            key: [_Stream(d / name, ErrorScanner(tax, name.split(".")[0])) for name in STREAM_FILES]
            for key, d in rank_dirs.items()
        }
        self._written: set[int] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.problems: list[str] = []

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="elastic-diag-tailer", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2.0)

    def _run(self) -> None:
        wait = self._poll_s
        while not self._stop.wait(wait):
            start = time.monotonic()
            try:
                read = self.poll()
            except Exception as e:  # never take the agent down; say it once
                self.problems.append(f"the line clock stopped: {type(e).__name__}: {e}")
                return
            # at most a tenth of a core: ranks that print a lot are read in larger, rarer gulps (and past
            # SKIP_AFTER bytes behind, the tailer jumps ahead; the final read takes the end of each stream);
            # while every stream is quiet the polls space out (each wake-up costs the agent CPU on a loaded host)
            wait = max(self._poll_s, (time.monotonic() - start) * DUTY) if read else min(IDLE_POLL_S, wait * 2)

    def poll(self, final: bool = False) -> int:
        """Read what every stream has gained; ``final``: the ranks have exited, so a last line with no
        newline (a rank killed mid-line) counts too. Returns the bytes read."""
        read = 0
        with self._lock:
            now = self._clock()
            for key, streams in self._streams.items():
                for s in streams:
                    read += self._read(s, now, final)
                self._write_first(key, final)
            if final:  # the ranks have exited: nothing more will come
                self._close()
        return read

    def _read(self, s: _Stream, now: float, final: bool) -> int:
        try:
            if s.fd is None:
                s.fd = os.open(s.path, os.O_RDONLY)
            size = os.fstat(s.fd).st_size
        except OSError:
            return 0
        if size < s.offset:  # truncated: start over
            s.offset, s.partial = 0, ""
        if size - s.offset > SKIP_AFTER:
            s.skipped += size - RESUME_BYTES - s.offset
            s.offset, s.partial = size - RESUME_BYTES, ""
        data = b""
        if size > s.offset:
            try:
                data = os.pread(s.fd, min(READ_BYTES, size - s.offset), s.offset)
            except OSError:
                return 0
            s.offset += len(data)
        if not data and not (final and s.partial):
            return 0
        text = s.partial + s.decoder.decode(data)
        parts = _SPLIT.split(text)
        s.partial = parts.pop()  # the line still being written
        if len(s.partial) > 64 * 1024:
            parts.append(s.partial)
            s.partial = ""
        if final and s.partial:
            parts.append(s.partial)
            s.partial = ""
        for line in parts:
            s.scanner.feed(line, now)
        return len(data)

    def _close(self) -> None:
        for streams in self._streams.values():
            for s in streams:
                if s.fd is not None:
                    with contextlib.suppress(OSError):
                        os.close(s.fd)
                    s.fd = None

    def first_error(self, key: int) -> ErrorLine | None:
        """The rank's first own error on any of its streams (the earliest)."""
        with self._lock:
            found = [e for s in self._streams.get(key, ()) if (e := s.scanner.first()) is not None]
        return min(found, key=lambda e: e.time) if found else None

    def _write_first(self, key: int, final: bool) -> None:
        if key in self._written:
            return
        now = self._clock()
        found = [e for s in self._streams[key] if (e := (s.scanner.first() if final else s.scanner.settled(now)))]
        if not found:
            return
        self._written.add(key)
        first = min(found, key=lambda e: e.time)
        with contextlib.suppress(OSError):
            write_json_atomic(self._dirs[key] / FIRST_ERROR_FILE, error_line_to_json(first), indent=None)

    def skipped_bytes(self, key: int) -> int:
        return sum(s.skipped for s in self._streams.get(key, ()))
