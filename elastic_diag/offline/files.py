"""Finding the candidate lines fast: the files under the paths the user gave, binary files told apart,
and the prefilter (a few anchor words found in C: ``bytes.find`` passes, or the system's ``grep -E`` over
many per-rank files at once). Only the lines it returns are parsed in Python.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO, cast

CHUNK = 4 << 20  # files are read in blocks of this size, cut at the last line break

# The prefilter: a line is looked at only if it contains one of these. Each costs one C-level pass
# (bytes.find, 1.3 to 2 GB/s here), so they are few and long; a test checks that every signature's
# example lines contain one. Exception lines ("...Error: ", "...Exception"), NCCL WARN lines, the
# watchdog's, timeouts, kills, exits and signals, NaN lines, NCCL's desync report, kernel Xid lines.
# None may match what healthy runs print all the time: Python logging's WARNING lines (a quarter of a
# real log), NCCL INFO lines, progress bars (benchmarks/analyze.py builds its chatter from them).
ANCHORS = (b"rror", b"xception", b"NCCL WARN", b"atchdog", b"imed out", b"Killed", b"killed", b"xit", b"ignal", b" nan",
           b"finite", b" join", b"Xid (", b"nterrupt", b"egmentation", b"preamble", b"rrno",
           b"ore dumped", b"oom-kill", b"Out Of Memory", b"onnection re", b"ut of memory",
           b"ailed : ", b"aving ", b"valuat", b"alidat", b"elastic_diag: job ", b"; page: ", b"CudaCheck",
           b"okeniz", b"Map: ", b"Map (num_proc", b"rouping texts", b"ain_process_first", b"zero_first",
           b"enerating train split", b"emory allocation of", b"bad_alloc",
           b"_group call #", b"num_machines", b"world_sizes=", b"nnodes", b"--standalone",
           b"(local_rank:")  # fmt: skip
# An anchor directly followed by one of these bytes does not count: ``error_rate=0.01``, NCCL's
# ``dlerror=libnccl-net.so`` and other names that hold "error" are what healthy runs print.
NOT_FOLLOWED_BY = {b"rror": b"_="}
# Lines that only map a pid or a local rank to a global rank: read in a second pass, and only when
# some error line needs such a mapping (raw NCCL lines, kernel OOM lines, DeepSpeed exits).
MAPPING_ANCHORS = (b"pid", b"nranks", b"nRanks", b"rank_mapping", b"closing signal")
_CONTROL_BYTES = bytes(b for b in range(1, 32) if b not in (9, 10, 13, 27)) + b"\x7f"


def ere_escape(text: str) -> str:
    """``text`` as a POSIX extended regular expression matching it literally."""
    return re.sub(r"([.\\[\]()*+?{}|^$])", r"\\\1", text)


# torchrun's failure summary starts at one of these: read whole, not by anchors. ChildFailedError's own line
# is missing where a launcher prints only the table (str(ChildFailedError): torchrun-diag, a user's handler)
SUMMARY_MARKS = (b"ChildFailedError", b"Failures:")


def candidate_lines(chunk: bytes, anchors: tuple[bytes, ...]) -> list[int]:
    """Start offsets of the lines of ``chunk`` that contain an anchor, sorted and distinct: one
    ``bytes.find`` pass per anchor (the pure-Python prefilter)."""
    starts: set[int] = set()
    for anchor in anchors:
        unless = NOT_FOLLOWED_BY.get(anchor, b"")
        i = chunk.find(anchor)
        while i >= 0:
            after = i + len(anchor)
            if unless and chunk[after : after + 1] in unless and after < len(chunk):
                i = chunk.find(anchor, after)  # not this one: the next on the same line may count
                continue
            start = chunk.rfind(b"\n", 0, i) + 1
            starts.add(start)
            end = chunk.find(b"\n", i)
            if end < 0:
                break
            i = chunk.find(anchor, end)
    return sorted(starts)


def anchor_ere(anchor: bytes) -> str:
    """``anchor`` as a POSIX ERE for grep, with its :data:`NOT_FOLLOWED_BY` rule."""
    unless = NOT_FOLLOWED_BY.get(anchor)
    literal = ere_escape(anchor.decode())
    return f"{literal}([^{unless.decode()}]|$)" if unless else literal


def _anchor_hyperscan(anchor: bytes) -> bytes:
    """``anchor`` as a Hyperscan expression over a chunk of whole lines (each ends with a newline, so
    the byte after an anchor always exists)."""
    unless = NOT_FOLLOWED_BY.get(anchor)
    return re.escape(anchor) + (b"[^" + re.escape(unless) + b"]" if unless else b"")


class LineFinder:
    """The first stage of the analyzer over one chunk of whole lines: the start of every line holding
    one of ``anchors``, and where torchrun's summary (:data:`SUMMARY_MARKS`) starts (-1: not in it).

    With Hyperscan installed (a dependency on Linux x86_64/aarch64) all anchors are found in one
    vectorised pass, 1.2 GB/s on one core here against 460 MB/s for GNU grep's ``-E`` alternation of
    the same strings (docs/benchmarks.md); else one ``bytes.find`` pass per anchor. Both give the same
    lines (tests/offline/test_analyze.py)."""

    def __init__(self, anchors: tuple[bytes, ...], *, use_hyperscan: bool = True) -> None:
        self.anchors = anchors
        self._db = _hyperscan_db((*anchors, *SUMMARY_MARKS)) if use_hyperscan else None

    @property
    def engine(self) -> str:
        return "hyperscan" if self._db is not None else "python"

    def __call__(self, chunk: bytes) -> tuple[list[int], int]:
        if self._db is None:
            found = [i for i in (chunk.find(mark) for mark in SUMMARY_MARKS) if i >= 0]
            return candidate_lines(chunk, self.anchors), min(found, default=-1)
        ends: list[int] = []
        summary: list[int] = []
        first_mark = len(self.anchors)

        def on_match(pattern: int, _start: int, end: int, _flags: int, _ctx: object) -> None:
            if pattern >= first_mark:
                summary.append(end - len(SUMMARY_MARKS[pattern - first_mark]))
            else:
                ends.append(end)

        self._db.scan(chunk, match_event_handler=on_match)
        starts: list[int] = []
        line_end = -1
        for end in sorted(ends):
            last = end - 1  # the match's last byte: the newline itself after an anchor at a line's end
            if last <= line_end:
                continue  # another anchor on a line already taken
            starts.append(chunk.rfind(b"\n", 0, last) + 1)
            nl = chunk.find(b"\n", last)
            line_end = nl if nl >= 0 else len(chunk)
        return starts, (min(summary) if summary else -1)


def _hyperscan_db(literals: tuple[bytes, ...]) -> Any:
    """A Hyperscan block-mode database matching ``literals``; None when Hyperscan is not installed
    (or cannot run on this CPU): the caller falls back to ``bytes.find``."""
    try:
        import hyperscan  # type: ignore[import-not-found,import-untyped,unused-ignore]

        db = hyperscan.Database(mode=hyperscan.HS_MODE_BLOCK)
        db.compile(expressions=[_anchor_hyperscan(lit) for lit in literals], ids=list(range(len(literals))),
                   elements=len(literals), flags=[0] * len(literals))  # fmt: skip
        return db
    except Exception:  # noqa: BLE001 - ImportError, hyperscan.error, a CPU without SSSE3: use the fallback
        return None


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


# files that are not logs, by their first bytes (their NUL bytes would otherwise be read as a crashed writer's hole)
_MAGIC = ((b"\x7fELF", "an ELF executable, library or core dump"), (b"\x89PNG", "a PNG image"),
          (b"\xff\xd8\xff", "a JPEG image"), (b"PK\x03\x04", "a zip archive (a torch checkpoint is one)"),
          (b"\x80\x02", "a pickle"), (b"\x80\x03", "a pickle"), (b"\x80\x04", "a pickle"), (b"\x80\x05", "a pickle"),
          (b"\x93NUMPY", "a NumPy array"), (b"\x89HDF", "an HDF5 file"), (b"SQLite format 3\x00", "an SQLite database"),
          (b":W&B", "a Weights & Biases run file"), (b"\x1f\x8b", "gzip data"), (b"\x28\xb5\x2f\xfd", "zstd data"),
          (b"\xfd7zXZ", "xz data"), (b"BZh", "bzip2 data"))  # fmt: skip


def binary_kind(head: bytes) -> str | None:
    """Why a file whose first bytes are ``head`` is not a log (its format, or "binary"), None for a log. NUL
    bytes do not count: a log that a crashed writer or a sparse file left with a hole of NULs (at its start, or
    all of its first 8 KB) is still read, the text after the hole included; a log with some junk is read too."""
    for magic, kind in _MAGIC:
        if head.startswith(magic):
            return kind
    text = head.replace(b"\x00", b"")
    if not text:
        return None
    controls = len(text) - len(text.translate(None, _CONTROL_BYTES))
    invalid = text.decode("utf-8", errors="replace").count("\ufffd")
    return "binary" if (controls + invalid) / len(text) > 0.3 else None


def grep_batches(files: list[Path], progress: Callable[[str], None]) -> Iterator[tuple[list[Path], bytes]]:
    """The system grep's matching lines (``-b -H -Z``: file, NUL, byte offset, line) of ``files`` in batches,
    one grep per usable core, in order. A batch grep could not do is not yielded (Python reads it)."""
    import subprocess  # the grep prefilter's modules load only when it is used (the analyzer's start-up)
    from concurrent.futures import ThreadPoolExecutor

    # One ERE alternation in the C locale: GNU grep's DFA runs it 1.6x faster than -F with the same
    # strings (its multi-string search slows down with short anchors; docs/benchmarks.md).
    pattern = "|".join(anchor_ere(a) for a in (*ANCHORS, *SUMMARY_MARKS))
    env = {**os.environ, "LC_ALL": "C"}

    def grep(batch: list[Path]) -> bytes | None:
        try:
            return subprocess.run(
                [*_GREP_ARGV, pattern, "--", *map(str, batch)],
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


WRAP_JOIN = b"\x00"  # what replaces the newline of a hard-wrapped line (the offsets stay those of the file)


# how a log line starts: a bracketed prefix, a date, a glog level, a traceback's lines
_LINE_START = re.compile(
    rb"^(?:\[|\d{4}-\d\d-\d\d|[IWEF]\d{4} |\d+: |\s*File \"|Traceback|[\w.]*(?:Error|Exception)\b)"
)


def _continues(line: bytes, nxt: bytes) -> bool:
    """Whether ``nxt`` reads as the rest of ``line`` cut at the terminal's width, not a line of its own:
    it does not start the way log lines start, nor with ``line``'s own first bytes (the next rank's
    copy of the same message)."""
    return bool(nxt) and not _LINE_START.match(nxt) and nxt[:3] != line[:3] and not line.endswith(b" ")


def wrap_width(head: bytes) -> int | None:
    """The width a terminal or tmux pane hard-wrapped this log at, when it was: three or more lines of
    exactly the longest length (80 columns or more) and most of them followed by a line that reads as
    their continuation. Lines of one length by chance (every rank's copy of one message) are not."""
    lines = [line.rstrip(b"\r") for line in head.split(b"\n")[:-1]]
    if len(lines) < 4:
        return None
    width = max(len(line) for line in lines)
    cut = [i for i, line in enumerate(lines[:-1]) if len(line) == width]
    if width < 80 or len(cut) < 3:
        return None
    continued = sum(_continues(lines[i], lines[i + 1]) for i in cut)
    return width if 3 * continued >= 2 * len(cut) else None


def unwrap(chunk: bytes, width: int) -> bytes:
    """The chunk with every line of exactly ``width`` bytes that the next line continues joined to it (its
    newline becomes :data:`WRAP_JOIN`, so every offset stays the file's own); the reader drops the joins."""
    out = bytearray(chunk)
    start = 0
    while True:
        nl = chunk.find(b"\n", start)
        if nl < 0:
            return bytes(out)
        if nl - start == width:
            nxt_end = chunk.find(b"\n", nl + 1)
            if _continues(chunk[start:nl], chunk[nl + 1 : nxt_end if nxt_end >= 0 else len(chunk)]):
                out[nl] = WRAP_JOIN[0]
        start = nl + 1


PREFILTERS = ("hyperscan", "grep", "python")
_GREP_ARGV = ("grep", "-a", "-b", "-H", "-Z", "-E", "-e")


def choose_prefilter(wanted: str = "auto", *, no_grep: bool = False) -> str:
    """The first stage to use: ``wanted`` when it works here, else the fastest that does (Hyperscan,
    then a grep with GNU's ``-b -H -Z`` output, then Python). ``no_grep``: never the system grep."""
    order = [wanted] if wanted in PREFILTERS else []
    order += [p for p in PREFILTERS if p not in order]
    for name in order:
        if name == "python":
            return name
        if name == "hyperscan" and _hyperscan_db((b"x",)) is not None:
            return name
        if name == "grep" and not no_grep and grep_is_gnu_compatible():
            return name
    return "python"


@functools.cache
def grep_is_gnu_compatible() -> bool:
    """Whether the ``grep`` on PATH prints what :func:`grep_batches` parses: ``file NUL offset:line``.
    BusyBox's has no ``-b``/``-Z``; BSD's ``-Z`` means decompress; some systems have no grep at all.
    Tried once per process on a two-line file."""
    import subprocess
    import tempfile

    try:
        with tempfile.TemporaryDirectory(prefix="elastic_diag_grep_") as tmp:
            probe = os.path.join(tmp, "rank_0.log")
            with open(probe, "wb") as fp:
                fp.write(b"a\nxx Error yy\n")
            out = subprocess.run([*_GREP_ARGV, "Error|Watchdog", "--", probe], capture_output=True, timeout=10,
                                 check=False, env={**os.environ, "LC_ALL": "C"}).stdout  # fmt: skip
            return out == os.fsencode(probe) + b"\x002:xx Error yy\n"
    except (OSError, subprocess.SubprocessError):
        return False


# compressed logs: gzip is read (the standard library has it); the others are listed as skipped
GZIP_SUFFIX = ".gz"
OTHER_COMPRESSED = (".zst", ".xz", ".bz2", ".lz4", ".zip", ".7z", ".tgz")


def open_log(path: Path) -> BinaryIO:
    """A log file's bytes, decompressed when it is gzipped."""
    if path.name.endswith(GZIP_SUFFIX):
        import gzip

        return cast(BinaryIO, gzip.open(path, "rb"))
    return open(path, "rb")
