"""Finding the candidate lines fast: the files under the paths the user gave, binary files told apart,
and the prefilter (a few anchor words found in C: ``bytes.find`` passes, or the system's ``grep -E`` over
many per-rank files at once). Only the lines it returns are parsed in Python.
"""

from __future__ import annotations

import gzip
import os
import re
import subprocess
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO, cast

CHUNK = 4 << 20  # files are read in blocks of this size, cut at the last line break

# The prefilter: a line is looked at only if it contains one of these. Each costs one C-level pass
# (bytes.find, 1.3 to 2 GB/s here), so they are few and long; a test checks that every signature's
# example lines contain one. Exception lines ("...Error: ", "...Exception"), NCCL WARN lines, the
# watchdog's, timeouts, kills, exits and signals, NaN lines, NCCL's desync report, kernel Xid lines.
ANCHORS = (b"rror", b"xception", b"WARN", b"atchdog", b"imed out", b"illed", b"xit", b"ignal", b" nan",
           b"finite", b" join", b"Xid (", b"nterrupt", b"egmentation", b"preamble", b"rrno",
           b"ore dumped", b"oom-kill", b"Out Of Memory")  # fmt: skip
# Lines that only map a pid or a local rank to a global rank: read in a second pass, and only when
# some error line needs such a mapping (raw NCCL lines, kernel OOM lines, DeepSpeed exits).
MAPPING_ANCHORS = (b"pid", b"nranks", b"nRanks", b"rank_mapping", b"closing signal")
_CONTROL_BYTES = bytes(b for b in range(32) if b not in (9, 10, 13, 27)) + b"\x7f"


def ere_escape(text: str) -> str:
    """``text`` as a POSIX extended regular expression matching it literally."""
    return re.sub(r"([.\\[\]()*+?{}|^$])", r"\\\1", text)


def candidate_lines(chunk: bytes, anchors: tuple[bytes, ...]) -> list[int]:
    """Start offsets of the lines of ``chunk`` that contain an anchor, sorted and distinct."""
    starts: set[int] = set()
    for anchor in anchors:
        i = chunk.find(anchor)
        while i >= 0:
            start = chunk.rfind(b"\n", 0, i) + 1
            starts.add(start)
            end = chunk.find(b"\n", i)
            if end < 0:
                break
            i = chunk.find(anchor, end)
    return sorted(starts)


def iter_files(paths: Iterable[str | Path], skipped: list[str]) -> Iterator[Path]:
    """Regular files under the paths, sorted; symlinks are not followed into loops."""
    seen: set[tuple[int, int]] = set()
    for raw in paths:
        p = Path(raw)
        if not p.exists():
            skipped.append(f"{p}: no such file or folder")
            continue
        if p.is_file():
            yield p
            continue
        for root, dirs, files in os.walk(p, followlinks=False):
            dirs.sort()
            for name in sorted(files):
                f = Path(root) / name
                try:
                    st = f.stat()
                except OSError as e:
                    skipped.append(f"{f}: {e.strerror or e}")
                    continue
                key = (st.st_dev, st.st_ino)
                if key in seen or not f.is_file():
                    continue
                seen.add(key)
                yield f


def is_binary(head: bytes) -> bool:
    """Mostly non-text: a core dump, a pickle. A log with some NUL bytes or junk is still read."""
    if not head:
        return False
    controls = len(head) - len(head.translate(None, _CONTROL_BYTES))
    invalid = head.decode("utf-8", errors="replace").count("\ufffd")
    return (controls + invalid) / len(head) > 0.3


def grep_batches(files: list[Path], progress: Callable[[str], None]) -> Iterator[tuple[list[Path], bytes]]:
    """The system grep's matching lines (``-b -H -Z``: file, NUL, byte offset, line) of ``files`` in batches,
    one grep per usable core, in order. A batch grep could not do is not yielded (Python reads it)."""
    # One ERE alternation in the C locale: GNU grep's DFA runs it 1.6x faster than -F with the same
    # strings (its multi-string search slows down with short anchors; docs/benchmarks.md).
    pattern = "|".join(ere_escape(a.decode()) for a in (*ANCHORS, b"ChildFailedError"))
    env = {**os.environ, "LC_ALL": "C"}

    def grep(batch: list[Path]) -> bytes | None:
        try:
            return subprocess.run(
                ["grep", "-a", "-b", "-H", "-Z", "-E", "-e", pattern, "--", *map(str, batch)],
                capture_output=True, timeout=600, check=False, env=env,
            ).stdout  # fmt: skip
        except (OSError, subprocess.SubprocessError):
            return None  # this batch is left to the Python path

    # the output is only the matching lines, small
    workers = max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1))
    size = max(1, min(256, -(-len(files) // workers)))
    batches = [files[i : i + size] for i in range(0, len(files), size)]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for n, (batch, out) in enumerate(zip(batches, pool.map(grep, batches), strict=True)):
            progress(f"scanned {min((n + 1) * size, len(files))} of {len(files)} log file(s)")
            if out is not None:
                yield batch, out


# compressed logs: gzip is read (the standard library has it); the others are listed as skipped
GZIP_SUFFIX = ".gz"
OTHER_COMPRESSED = (".zst", ".xz", ".bz2", ".lz4", ".zip", ".7z", ".tgz")


def open_log(path: Path) -> BinaryIO:
    """A log file's bytes, decompressed when it is gzipped."""
    if path.name.endswith(GZIP_SUFFIX):
        return cast(BinaryIO, gzip.open(path, "rb"))
    return open(path, "rb")
