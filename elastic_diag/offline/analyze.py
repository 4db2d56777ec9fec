"""``elastic-diag analyze``: the classifier over log files a user already has. No torch, no upload.

Streaming: each file is read in chunks; a prefilter of a few anchor words finds the few candidate
lines in C (the system's ``grep -E`` for per-rank files when there is one, else ``bytes.find``
passes), and only those lines are parsed in Python. The
rank of a line comes from its prefix (``[rank3]:``), else from its file's path. Per rank the
earliest distinct errors are kept, plus the last lines of the files that belong to it; torchrun's
failure summary adds exit codes, signals and pids. The same :func:`classify_attempt` as the live
agent then attributes the failure. Memory is bounded by the number of ranks, not the log size.
"""

from __future__ import annotations

import functools
import os
import re
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from elastic_diag.core.attribution import judge_settled, settle
from elastic_diag.core.error_lines import HOOK_FAILED
from elastic_diag.core.evidence import AttemptEvidence, LogLine
from elastic_diag.core.exceptions import ExceptionRecord
from elastic_diag.core.log_lines import (
    EXC_LINE,
    GENERIC_EXCEPTION,
    LAUNCHER_EXIT_WORDS,
    SummaryParser,
    completion_line,
    evidence_line,
    failure_evidence,
    parse_deepspeed_exit,
    parse_failed_line,
    parse_launcher_exit,
    parse_line,
    rank_from_path,
    single_node_line,
)
from elastic_diag.core.taxonomy import Taxonomy, load_taxonomy
from elastic_diag.core.verdict import Diagnosis, format_ranks
from elastic_diag.core.verification import render
from elastic_diag.layout import (
    ENV_NO_GREP,
    ENV_PREFILTER,
    ERROR_FILE,
    EXCEPTION_FILE,
    FR_MAX_BYTES,
    REPORT_FILE,
    TAIL_BYTES,
    attempt_dirs,
    is_attempt_dir,
    last_lines_of,
    load_flight_record,
    read_attempt,
    read_error_file,
    read_report,
    read_tail_bytes,
)
from elastic_diag.offline.files import (
    ANCHORS,
    CHUNK,
    GZIP_SUFFIX,
    MAPPING_ANCHORS,
    OTHER_COMPRESSED,
    SUMMARY_MARKS,
    WRAP_JOIN,
    LineFinder,
    binary_kind,
    choose_prefilter,
    grep_batches,
    iter_files,
    open_log,
    unwrap,
    wrap_width,
)
from elastic_diag.offline.ranks import RankResolver
from elastic_diag.offline.records import MAX_FAILURE_LINES, PHASE_LINES, TAIL_LINES, Analysis, LogRead, RankLines
from elastic_diag.report.terminal import Paint

MAX_LINE = 64 * 1024  # longer lines are cut before matching
MAX_LINES_PER_RANK = 64
# skipping a line its rank printed before with other digits: the key is the line's rank prefix and the rest
# with every digit made 0; at most this many keys are kept
_KEY_PREFIX = re.compile(rb"(?:[A-Za-z0-9][\w.-]*: )?(?:\[(?:rank|default)\d+\]:)*")
_DIGIT_RUNS = re.compile(rb"\d+")
_X_RUN = re.compile(rb"xxxxxxxx+")  # of a line with its hex digits made "x": an address, a request id, a hash
_HEX_AS_X = bytes.maketrans(b"0123456789abcdef", b"x" * 16)
# what a line's repeats are (see Analyzer._line): read again, skipped, or kept as the last phase lines
READ_AGAIN, PHASE, SKIP, QUIET = 0, 1, 2, 3  # QUIET: no anchor (a dense chunk's lines are all looked up)
_DENSE_LINES = 2000  # a chunk with at least this many candidate lines, most of its lines, is dense
_NO_DIGITS = bytes.maketrans(b"123456789", b"000000000")
_SEEN_LINES = 1 << 16
# a line holding one of these may tell a fact by the value of its digits (an exit code, a node count, a
# local rank in torchrun's table): never skipped
_DIGIT_FACT_WORDS = ("xit", "failed (", "(local_rank:", "-- Process ", "num_machines", "num_nodes", "nnodes",
                     "world_sizes", "--standalone", "_group call #", "Signals.")  # fmt: skip
CONTEXT_LINES = 100
COMPLETION_LINES = 200  # how far from a file's end a line saying the run ended well is looked for
# every completion line (core/log_lines.completion_line) holds one of these
_COMPLETION_WORDS = (
    b"successfully",
    b"SUCCEEDED",
    b"Training completed",
    b"Trainer.fit",
    b"code 0",
    b"status 0",
    b"train metrics",
    b"train_runtime",
    b"after training is done",
    b"run_stop",
    b"ENDING TIMING RUN",
    b"succeeded",
    b"raining finished",
    b"raining complete",
    b"raining done",
    b"RAINING FINISHED",
    b"RAINING COMPLETE",
    b"RAINING DONE",
    b"inished training",
    b"one training",
    b"raining is ",
    b"destroy_process_group() was not called",
)


# --- walking the paths ---------------------------------------------------------------------------


# --- reading ---------------------------------------------------------------------------------------


class Analyzer:
    """Reads the files and gathers a :class:`~elastic_diag.offline.records.LogRead`; :meth:`finish` turns it
    into the core's evidence and has the core judge it (:func:`~elastic_diag.core.classify.classify_attempt`,
    the live agent's verdict). An evidence folder of ``torchrun-diag`` (``attempt_N/`` with its rank folders) is
    read as the live agent reads it (:func:`~elastic_diag.layout.read_attempt`), not as logs. The reading state
    is the anchors of the pass (the mapping pass reads only the lines that map pids and local ranks to ranks),
    the local-rank offsets of the file being read, and the position of each line in the whole read."""

    def __init__(self, taxonomy: Taxonomy | None = None) -> None:
        self.taxonomy = taxonomy or load_taxonomy()
        self.facts = LogRead()
        self.folders: list[AttemptEvidence] = []  # the evidence folders' attempts, as the live agent read them
        self.problems: list[str] = []  # what the evidence folders were missing
        self.summary = SummaryParser()
        self.prefilter = choose_prefilter(
            os.environ.get(ENV_PREFILTER, "auto"), no_grep=os.environ.get(ENV_NO_GREP, "") not in ("", "0")
        )
        self.find_lines = LineFinder(ANCHORS, use_hyperscan=self.prefilter == "hyperscan")
        self.find_marks = LineFinder((), use_hyperscan=self.prefilter == "hyperscan")  # the summary's start alone
        self.find_mappings = LineFinder(MAPPING_ANCHORS, use_hyperscan=self.prefilter == "hyperscan")
        self.find_completion = LineFinder(_COMPLETION_WORDS, use_hyperscan=self.prefilter == "hyperscan")
        self.progress: Callable[[str], None] = lambda _text: None
        self.resolver = RankResolver(self.facts)
        self._order = 0
        # a file's last lines are often candidate lines already parsed (a rank's final error lines)
        self.parse = functools.lru_cache(maxsize=8192)(parse_line)
        self._wrap: int | None = None  # the width the file being read was hard-wrapped at
        self._block_rank: int | None = None  # torch.multiprocessing.spawn: the process whose traceback follows
        self._in_own_summary = False  # inside torchrun-diag's own summary (skipped)
        self._hook_failed: set[int] = set()  # ranks inside an "Error in sys.excepthook:" traceback
        self._seen: dict[tuple[int | None, bytes, bytes], int] = {}  # what a line's repeats tell (the file's)
        self._dense = False  # the file's last chunk was dense: most lines held an anchor
        # a line's shape (its digits made 0) -> where its rank prefix ends, and each prefix's kind (the file's)
        self._shapes: dict[bytes, tuple[int, dict[bytes, int]]] = {}
        self._phases: deque[tuple[int, bytes, int, int, int | None]] = deque(maxlen=PHASE_LINES)

    @property
    def ranks(self) -> dict[int, RankLines]:
        return self.facts.ranks

    def finish(self) -> Analysis:
        """The verdict on what was read, and the lines of the log around its decisive line."""
        self.facts.summary_failures = self.summary.finish()
        evidence = settle(combined(self.folders, self.facts.evidence()), self.taxonomy)
        diagnosis = judge_settled(evidence, self.taxonomy)
        seen = diagnosis.failure_class != "healthy" and (
            diagnosis.failure_class != "unknown"
            or bool(evidence.failure_lines)
            or any(r.failed for r in evidence.ranks)
        )
        analysis = Analysis(diagnosis=diagnosis, evidence=evidence, files=self.facts.files,
                            skipped=[*self.facts.skipped, *self.problems], failure_seen=seen)  # fmt: skip
        analysis.decisive = decisive_line(evidence, diagnosis)
        if analysis.decisive is not None:
            analysis.context = self._context(analysis.decisive)
        return analysis

    def add_paths(self, paths: Iterable[str | Path], progress: Callable[[str], None] | None = None) -> None:
        """Read every file under ``paths``; ``progress`` hears how far it got (a terminal's progress line)."""
        self.progress = progress or (lambda _text: None)
        given = [Path(p) for p in paths]
        folders = [d for p in given for d in evidence_folders(p)]
        for folder in folders:
            self._add_folder(folder)
        inside = tuple(str(f.parent if f.name.startswith("attempt_") else f) for f in folders)
        files = [f for f in iter_files(given, self.facts.skipped) if not _under(f, inside)]
        self.progress(f"{len(files)} file(s) found")
        done = self._grep_scan(files) if self.prefilter == "grep" else set()
        for i, f in enumerate(files):
            if f in done:
                continue
            if i % 16 == 0:
                self.progress(f"file {i + 1} of {len(files)}: {f.name}")
            try:
                self.add_file(f)
            except (OSError, EOFError) as e:  # EOFError: a gzipped log cut short (what was read counts)
                self.facts.skipped.append(f"{f}: {getattr(e, 'strerror', None) or e}")
        if self.facts.pid_lines or self.facts.ds_exits:
            self._mapping_pass()

    def _grep_scan(self, files: list[Path]) -> set[Path]:
        """The per-rank text files, prefiltered by the system's grep (C, several times faster than
        bytes.find passes); returns the files handled. Anything grep cannot do is left to Python."""
        eligible = []
        for f in files:
            skip = (".json", ".pkl", ".pickle", ".tmp", GZIP_SUFFIX, *OTHER_COMPRESSED)
            if f.name.endswith(skip) or rank_from_path(f) is None:
                continue
            try:
                with open(f, "rb") as fp:
                    head = fp.read(8192)
                    if b"\x00" in head or binary_kind(head) or wrap_width(head):
                        continue  # a hard-wrapped log is unwrapped by the Python reader, a NUL hole skipped by it
            except OSError:
                continue
            eligible.append(f)
        done: set[Path] = set()
        for batch, out in grep_batches(eligible, self.progress):
            self._grep_batch(batch, out, done)
        return done

    def _grep_batch(self, batch: list[Path], out: bytes, done: set[Path]) -> None:
        """One batch's grep output: the matching lines of each file, with their byte offsets."""
        hits: dict[str, list[tuple[int, bytes]]] = {}
        for record in out.split(b"\n"):
            name, sep, rest = record.partition(b"\0")
            where, sep2, line = rest.partition(b":")
            if sep and sep2 and where.isdigit():
                hits.setdefault(os.fsdecode(name), []).append((int(where), line))
        for f in batch:
            lines = hits.get(str(f), [])
            if any(len(line) > MAX_LINE or any(m in line for m in (*SUMMARY_MARKS, b"\x00")) for _, line in lines):
                continue  # torchrun's summary needs every line after it; a NUL hole is a line break, and a line over
                # MAX_LINE is read frame by frame: the Python path
            idx = len(self.facts.files)
            self.facts.files.append(str(f))
            file_rank = rank_from_path(f)
            if file_rank is None:
                continue
            if f.stat().st_size:
                self.facts.rank(file_rank).printed += 1
            for offset, line in lines:
                if any(a in line for a in ANCHORS):
                    for frame in _frames(line[:MAX_LINE].decode("utf-8", errors="replace")):
                        self._line(frame, offset, idx, file_rank)
            self._read_end(f, file_rank, read_tail_bytes(f, COMPLETION_LINES))
            done.add(f)

    def _mapping_pass(self) -> None:
        """Second pass over the text files, for the lines that map pids / local ranks to ranks."""
        for idx, name in enumerate(self.facts.files):
            path = Path(name)
            if path.suffix in (".json", ".pkl", ".pickle") or not path.is_file():
                continue  # an evidence folder, a report, a flight record: read in the first pass
            try:
                with open_log(path) as fp:  # a gzipped log decompressed again (bounded as in the first pass)
                    file_rank = rank_from_path(name)
                    head = fp.read(8192)
                    self.resolver.start_file(fp, head, file_rank)
                    fp.seek(0)
                    self._scan(fp, idx, file_rank, self._map_chunk)
            except (OSError, EOFError) as e:
                self.facts.skipped.append(f"{name}: second pass: {getattr(e, 'strerror', None) or e}")

    def _add_folder(self, attempt_dir: Path) -> None:
        """An attempt of ``torchrun-diag``'s evidence folder, read as the live agent reads it."""
        read = read_attempt(attempt_dir, taxonomy=self.taxonomy)
        self.folders.append(read.evidence)
        self.facts.files.append(str(attempt_dir))
        self.problems.extend(f"{attempt_dir}: {p}" for p in read.problems)

    def add_file(self, path: Path) -> None:
        if path.name in (EXCEPTION_FILE, ERROR_FILE):
            self._add_error_json(path)
            return
        if path.name == REPORT_FILE:  # a report sent alone: the facts it recorded of each rank, not its verdict
            read = read_report(path, self.taxonomy)
            if read is None:
                self.facts.skipped.append(f"{path}: not a report.json this version reads (no report schema), skipped")
            else:
                self.folders.append(read.evidence)
                self.facts.files.append(str(path))
                self.problems.extend(read.problems)
            return
        if ("trace" in path.name or path.suffix in (".pkl", ".pickle")) and self._add_flight_record(path):
            return
        if path.suffix in (".json", ".pkl", ".pickle", ".tmp"):
            return
        if path.name.endswith(OTHER_COMPRESSED):
            self.facts.skipped.append(f"{path}: compressed ({path.suffix}), not read: decompress it first")
            return
        with open_log(path) as fp:
            head = fp.read(8192)
            kind = binary_kind(head)
            if kind is not None:
                self.facts.skipped.append(f"{path}: not a log ({kind}), skipped")
                return
            fp.seek(0)
            idx = len(self.facts.files)
            self.facts.files.append(str(path))
            file_rank = rank_from_path(path)
            self.resolver.start_file(fp, head, file_rank)
            fp.seek(0)
            self._wrap = wrap_width(head)
            try:
                tail = self._scan(fp, idx, file_rank, self._read_chunk)
                self._flush_phases()
            finally:
                self._phases.clear()
                self._shapes.clear()  # a [defaultN] prefix is a local rank: another file's may be another rank
                self._seen.clear()
                self._dense = False
                self._wrap = self._block_rank = None
        self._read_end(path, file_rank, last_lines_of(tail, COMPLETION_LINES))

    def _read_end(self, path: Path, rank: int | None, last: list[bytes]) -> None:
        """The end of the file (``last``: its last lines, kept by :meth:`_scan`): its last lines belong to the
        rank, and a line there may say the run ended well (looked for only in lines holding one of the
        completion lines' words)."""
        if rank is not None:
            log = self.facts.rank(rank)
            for line in last[-TAIL_LINES:]:
                log.last_lines.append(self.parse(_decode(line)).text[:2000])
        blob = b"\n".join(last) + b"\n"
        for start in self.find_completion(blob)[0]:
            text = self.parse(_decode(blob[start : blob.find(b"\n", start)])).text.strip()
            if completion_line(text):
                self.facts.completion_lines.append(text[:500])
                return

    def _add_flight_record(self, path: Path) -> bool:
        """A flight-recorder dump (torch's JSON or pickle, or elastic_diag's fr_trace.json); False when
        the file is not one (it is then read as a log)."""
        rank = rank_from_path(path)
        got = load_flight_record(path, rank, FR_MAX_BYTES)
        if not got.is_dump:
            return False
        if got.record is None or rank is None:
            self.facts.skipped.append(f"{path}: {got.problem}, skipped")
            return True
        self.facts.flight_records[rank] = got.record
        self.facts.rank(rank)
        self.facts.files.append(str(path))
        return True

    def _scan(
        self, fp: Any, idx: int, file_rank: int | None, on_chunk: Callable[[bytes, int, int, int | None], None]
    ) -> bytes:
        """The file in chunks of whole lines (a giant line is cut), each given to ``on_chunk``; returns the last
        :data:`TAIL_BYTES` of it (read once: a gzipped log cannot be read from its end)."""
        tail = b""
        read = fp.read
        path = Path(self.facts.files[idx])
        if path.name.endswith(GZIP_SUFFIX):  # a compression bomb, or a log of one line repeated: read a bounded part
            limit = max(GZIP_MIN_LIMIT, GZIP_RATIO_LIMIT * path.stat().st_size)
            read = _bounded(fp.read, limit, lambda: self._cut_short(path, limit))
        holes = [0]
        read = _holes_as_breaks(read, holes)
        for chunk, base in chunks_of(read, self._wrap):
            on_chunk(chunk, base, idx, file_rank)
            tail = chunk[-TAIL_BYTES:] if len(chunk) >= TAIL_BYTES else (tail + chunk)[-TAIL_BYTES:]
        note = (f"{path}: {holes[0]} NUL bytes (a hole a crashed writer or a sparse file leaves) skipped; the text "
                "around them was read")  # fmt: skip
        if holes[0] and note not in self.facts.skipped:
            self.facts.skipped.append(note)
        return tail

    def _cut_short(self, path: Path, limit: int) -> None:
        note = (f"{path}: expands more than {GZIP_RATIO_LIMIT}x (a compression bomb, or one line repeated): read its "
                f"first {limit >> 20} MiB decompressed, the rest was not read")  # fmt: skip
        if note not in self.facts.skipped:
            self.facts.skipped.append(note)

    def _map_chunk(self, chunk: bytes, base: int, idx: int, file_rank: int | None) -> None:
        """The second pass: only the lines that map pids and local ranks to ranks."""
        for start in self.find_mappings(chunk)[0]:
            end = chunk.find(b"\n", start)
            self._map_line(chunk[start : min(end if end >= 0 else len(chunk), start + MAX_LINE)], file_rank)

    def _read_chunk(self, chunk: bytes, base: int, idx: int, file_rank: int | None) -> None:
        """The first pass: who printed, torchrun's summary, and every candidate line."""
        if self._wrap:
            chunk = unwrap(chunk, self._wrap)
        starts: list[int] = []
        if self._dense:
            summary_at = self.find_marks(chunk)[1]
        else:
            self.resolver.count_lines(chunk, file_rank)
            starts, summary_at = self.find_lines(chunk)
        if self.summary.active:
            summary_at = 0
        if summary_at >= 0:
            self._feed_summary(chunk, summary_at)
        if self._dense:
            self._dense = self._read_dense(chunk, base, idx, file_rank)
            return
        for start in starts:
            end = chunk.find(b"\n", start)
            end = len(chunk) if end < 0 else end
            if end - start > MAX_LINE and chunk.find(b"\r", start, end) >= 0:
                self._long_line(chunk[start:end], base + start, idx, file_rank)
                continue
            line_bytes = chunk[start : min(end, start + MAX_LINE)]
            self._candidate(line_bytes, base + start, idx, file_rank, self._key(line_bytes, file_rank))
        # most lines hold an anchor (a retry loop, progress bars logged a frame a line): the next chunks are
        # read line by line, each line's key looked up before its anchors
        self._dense = len(starts) >= _DENSE_LINES and 2 * len(starts) > chunk.count(b"\n")

    def _long_line(self, line_bytes: bytes, offset: int, idx: int, file_rank: int | None) -> None:
        """A line longer than :data:`MAX_LINE` that ``\\r`` cuts into frames (a progress bar redrawn for hours
        without a newline, then a rank's error glued after it): each frame is a line to a terminal, so each one
        holding an anchor is read as a line of its own (the anchors found in one pass, as in a chunk)."""
        frames = line_bytes.replace(b"\r", b"\n") + b"\n"
        for start in self.find_lines(frames)[0]:
            end = frames.find(b"\n", start)
            frame = line_bytes[start : min(end, start + MAX_LINE)]
            self._candidate(frame, offset + start, idx, file_rank, self._key(frame, file_rank))

    def _key(self, line_bytes: bytes, file_rank: int | None) -> tuple[int | None, bytes, bytes] | None:
        """:func:`line_key`; None while a state of the read makes each line count (a spawned process's
        traceback, a failing excepthook, our own summary)."""
        return line_key(line_bytes, file_rank) if self._keyed else None

    @property
    def _keyed(self) -> bool:
        """Lines may be keyed: no state of the read makes each line count."""
        return self._block_rank is None and not self._hook_failed and not self._in_own_summary

    def _candidate(
        self,
        line_bytes: bytes,
        offset: int,
        idx: int,
        file_rank: int | None,
        key: tuple[int | None, bytes, bytes] | None,
    ) -> None:
        """A line holding an anchor: read, unless its rank printed it before with other digits alone and it told
        nothing then that other digits could change (a retry warning, an evaluation's log line), or it is a
        phase line again (a progress bar: only the last ones are read, at the end of the file)."""
        seen = self._seen
        if key is not None:
            kind = seen.get(key)
            if kind in (SKIP, QUIET):
                return
            if kind == PHASE:
                self._put_aside(line_bytes, offset, idx, file_rank)
                return
        kind = SKIP
        for line in self._physical_line(line_bytes):
            kind = min(kind, self._line(line, offset, idx, file_rank, key[1] if key is not None else None))
        if key is not None and kind != READ_AGAIN:
            self._remember(key, kind, line_bytes)

    def _put_aside(self, line_bytes: bytes, offset: int, idx: int, file_rank: int | None) -> None:
        """A phase line again: only its place in the order now; the last ones are read at the file's end."""
        self._order += 1
        self._phases.append((self._order, line_bytes, offset, idx, file_rank))

    def _remember(self, key: tuple[int | None, bytes, bytes], kind: int, line_bytes: bytes) -> None:
        """What the repeats of the line of ``key`` are; for a line without a hex run, under its shape too."""
        if len(self._seen) >= _SEEN_LINES:
            self._seen.clear()
            self._shapes.clear()
        self._seen[key] = kind
        shape = line_bytes.translate(_NO_DIGITS)
        cut = len(key[1])
        if shape[cut:] == key[2]:
            self._shapes.setdefault(shape, (cut, {}))[1][key[1]] = kind

    def _read_dense(self, chunk: bytes, base: int, idx: int, file_rank: int | None) -> bool:
        """A chunk where most lines hold an anchor, line by line: a line whose key is known costs a lookup,
        a new one is looked at for its anchors (and its rank prefix). Returns whether the chunk was dense."""
        seen = self._seen
        offset = base
        quiet = 0
        lines = chunk.split(b"\n")
        if lines and not lines[-1]:
            lines.pop()
        shapes = self._shapes
        free = self._keyed
        for line_bytes in lines:
            start = offset
            offset += len(line_bytes) + 1
            if len(line_bytes) > MAX_LINE:
                if b"\r" in line_bytes:
                    self._long_line(line_bytes, start, idx, file_rank)
                    free = self._keyed
                    continue
                line_bytes = line_bytes[:MAX_LINE]
            key = None
            if free:
                # the fast path: the line with its digits made 0 gives where its rank prefix ends, and the kinds
                # of the prefixes seen with it (lines without hex runs: their key is that and the prefix)
                shape = line_bytes.translate(_NO_DIGITS)
                entry = shapes.get(shape)
                kind = entry[1].get(line_bytes[: entry[0]]) if entry is not None else None
                if kind == SKIP:
                    continue
                if kind == QUIET:
                    quiet += 1
                    continue
                if kind == PHASE:
                    self._put_aside(line_bytes, start, idx, file_rank)
                    continue
                key = line_key(line_bytes, file_rank)
                kind = seen.get(key)
                if kind in (SKIP, QUIET):  # a line with a hex run
                    quiet += kind == QUIET
                    continue
            else:
                kind = None
            if kind is None:
                self.resolver.count_lines(line_bytes, file_rank)
                if not self.find_lines(line_bytes + b"\n")[0]:
                    quiet += 1
                    if key is not None:
                        self._remember(key, QUIET, line_bytes)
                    continue
            self._candidate(line_bytes, start, idx, file_rank, key)
            free = self._keyed
        return 2 * quiet < len(lines)

    def _physical_line(self, line_bytes: bytes) -> list[str]:
        raw = line_bytes.decode("utf-8", errors="replace")
        if self._wrap:
            raw = raw.replace(WRAP_JOIN.decode(), "")
        return _frames(raw)

    def _flush_phases(self) -> None:
        """The phase lines put aside while the file was read (repeats of a phase line: see :meth:`_read_chunk`),
        read now that the file is done, in their order among the others."""
        if not self._phases:
            return
        kept = list(self.facts.phase_lines)
        for order, line_bytes, offset, idx, file_rank in self._phases:
            for raw in self._physical_line(line_bytes):
                parsed = self.parse(raw)
                text = parsed.text.strip()
                if is_phase_line(text):
                    rank = self.resolver.line_rank(parsed, text, file_rank)
                    kept.append(evidence_line(text, time=parsed.time, clock=parsed.clock, order=order,
                                              source=self.facts.files[idx], offset=offset, rank=rank))  # fmt: skip
        self._phases.clear()
        self.facts.phase_lines.clear()
        self.facts.phase_lines.extend(sorted(kept, key=lambda line: line.order))

    def _map_line(self, raw: bytes, file_rank: int | None) -> None:
        parsed = parse_line(raw.decode("utf-8", errors="replace"))
        text = parsed.text.strip()
        self.resolver.record_mappings(parsed, text, self.resolver.line_rank(parsed, text, file_rank))

    def _feed_summary(self, chunk: bytes, start: int) -> None:
        """torchrun's failure summary: every line of it, from ChildFailedError on (it is short)."""
        start = chunk.rfind(b"\n", 0, start) + 1
        for n, raw in enumerate(chunk[start:].split(b"\n")):
            if n > 5000 or (n > 0 and not self.summary.active):
                break
            self.summary.feed(parse_line(raw.decode("utf-8", errors="replace")).text)

    def _line(self, raw: str, offset: int, idx: int, file_rank: int | None, keyed: bytes | None = None) -> int:
        """Reads one candidate line; returns what a line that differs from it in its digits alone, from the same
        rank (``keyed``: the rank prefix the caller took as the line's origin), would tell: nothing more
        (SKIP), the same phase line at a later time (PHASE), or something its digits decide (READ_AGAIN)."""
        parsed = self.parse(raw)
        text = parsed.text.strip()
        if self._own_summary(text):
            if text.startswith("rank ") and "_group call #" in text:
                self.facts.call_lines.append(text[:2000])  # a fact its verdict printed: rank R's new_group call
            return READ_AGAIN
        # the rank must come from the file or from the prefix the caller keyed the line by; the facts below
        # whose value its digits give (exit codes, pids, sizes, a rank in the message) are never skipped
        same = (
            parsed.pid is None
            and (
                (parsed.rank is None and file_rank is not None)
                or (
                    parsed.rank is not None
                    and keyed is not None
                    and str(parsed.rank).encode() in _DIGIT_RUNS.findall(keyed)
                )
            )
            and not any(w in text for w in _DIGIT_FACT_WORDS)
        )
        if len(self.facts.failure_lines) < MAX_FAILURE_LINES and failure_evidence(text):
            self.facts.failure_lines.append(text[:2000])
        failed = parse_failed_line(text)
        if failed:
            self.facts.failed_lines.append(failed)
        ds_exit = parse_deepspeed_exit(text) if "exits with return code" in text else None
        if ds_exit is not None:
            self.facts.ds_exits.append((parsed.host, ds_exit[0], ds_exit[1]))
        launcher_exit = parse_launcher_exit(text) if any(w in text for w in LAUNCHER_EXIT_WORDS) else None
        if launcher_exit is not None:
            self.facts.launcher_exits.append(launcher_exit)
        rank = self.resolver.line_rank(parsed, text, file_rank)
        if rank is not None:
            self.facts.global_ranks.add(rank)
        if (block := _SPAWN_BLOCK.search(text)) is not None:
            self._block_rank = int(block["rank"])  # the traceback after it is that process's
            self.facts.rank(self._block_rank).local_seen = True
        elif rank is None:
            rank = self._block_rank
        if self.facts.single_node is None and (proof := single_node_line(text)) is not None:
            self.facts.single_node = proof
        if "(local_rank:" in text and (row := _TABLE_ROW.match(text)) is not None:
            self.facts.table_ranks.setdefault(int(row["local"]), int(row["rank"]))
        self.resolver.record_mappings(parsed, text, rank)
        self._order += 1
        source = self.facts.files[idx]

        def line(sig_id: str | None, rank: int | None = None) -> LogLine:
            return evidence_line(text, time=parsed.time, clock=parsed.clock, order=self._order, source=source,
                                 offset=offset, rank=rank, signature=sig_id)  # fmt: skip

        phase = is_phase_line(text)
        if phase:
            self.facts.phase_lines.append(line(None, rank))
        exc = EXC_LINE.match(text)
        hits = []
        matched, same_for_digits = self.taxonomy.match_line_digits(text)
        same = same and same_for_digits
        for sig, m in matched:
            groups = m.groupdict()
            if groups.get("rank") or groups.get("pid"):  # ABOUT another process: a kernel OOM line, srun's task N
                if groups.get("rank"):
                    about = self.facts.rank(int(groups["rank"]))
                    about.lines.append(line(sig.id))
                    if "terminated with" in text:  # mp.spawn's "process 3 terminated with signal": an index
                        about.local_seen = True
                else:
                    self.facts.pid_lines.append((int(groups["pid"]), line(sig.id)))
            else:
                hits.append(sig)
        if rank is None:
            for sig in hits:
                # an exception no line ties to a rank counts (a one-line paste, a console without
                # prefixes), except the launcher's own, which only report the ranks' failures
                if sig.id != GENERIC_EXCEPTION or (exc and exc["type"].rsplit(".", 1)[-1] not in _LAUNCHER_EXCEPTIONS):
                    if parsed.pid is not None:
                        self.facts.pid_lines.append((parsed.pid, line(sig.id)))
                    else:
                        self.facts.unranked.append(line(sig.id))
            if hits or not same:  # unranked lines are counted (every rank printing the same error)
                return READ_AGAIN
            return PHASE if phase else SKIP
        log = self.facts.rank(rank)
        if parsed.host and log.node is None:
            log.node = parsed.host
        for sig in hits:
            if sig.id == GENERIC_EXCEPTION and not exc:
                continue
            # past the bound, a signature this rank has no line of yet is still kept: a rank that logged a
            # retry warning a thousand times and then ran out of memory keeps its out-of-memory line
            if len(log.lines) < MAX_LINES_PER_RANK or all(kept.signature != sig.id for kept in log.lines):
                log.lines.append(line(sig.id))
        if text.startswith(HOOK_FAILED):  # a failing excepthook's traceback: the rank's own follows it
            self._hook_failed.add(rank)
            return READ_AGAIN
        if text.startswith(_ORIGINAL):
            self._hook_failed.discard(rank)
            return READ_AGAIN
        if (
            exc
            and log.exception is None
            and rank not in self._hook_failed
            and not text.startswith(("Traceback", "raise "))
        ):
            log.exception = ExceptionRecord(type=exc["type"], message=exc["msg"] or "", traceback="", time=parsed.time)
        if not same:
            return READ_AGAIN
        if phase:
            return READ_AGAIN if hits else PHASE
        return SKIP

    def _own_summary(self, text: str) -> bool:
        """torchrun-diag's own summary at the end of a run it printed (a console pasted whole): its verdict is
        not evidence and is skipped, from "elastic_diag: job ..." to its "evidence: ... (report: ...; page: ...)"
        line; only that the job succeeded counts, as the launcher's word that every rank exited 0."""
        if not self._in_own_summary and not text.startswith("elastic_diag: job "):
            return False
        if _OWN_SUMMARY.match(text):
            self._in_own_summary = True
            if text.startswith("elastic_diag: job succeeded"):
                self.facts.all_exited_ok.append(text[:300])
                self.facts.completion_lines.append(text[:300])  # the run ended well, even with no rank known
            return True
        if self._in_own_summary and _OWN_SUMMARY_END.match(text):
            self._in_own_summary = False
            return True
        return self._in_own_summary

    def _add_error_json(self, path: Path) -> None:
        """An error file in a torchrun log dir (``attempt_0/<rank>/error.json``) or a rank folder: ours
        (exception.json) is the precise record; torchelastic's only fills a gap."""
        rank = rank_from_path(path.parent / "stderr.log")
        record = read_error_file(path)
        if record is None:
            self.facts.skipped.append(f"{path}: not an error file that can be read, skipped")
            return
        if rank is None:
            return
        log = self.facts.rank(rank)
        if path.name == EXCEPTION_FILE or log.exception is None or log.exception.time is None:
            log.exception = record

    # --- attribution -----------------------------------------------------------------------------

    def _context(self, line: LogLine) -> list[str]:
        """The lines of the log before the decisive one (read again from its file)."""
        if line.source is None or line.offset is None:  # inferred, not read from a file
            return []
        path = line.source
        try:
            with open(path, "rb") as fp:
                start = max(0, line.offset - 256 * 1024)
                fp.seek(start)
                data = fp.read(line.offset - start + MAX_LINE)
        except OSError:
            return []
        hole = b"\x00" in data
        if hole:
            data = data.replace(b"\x00", b"\n")  # a crashed writer's hole: line breaks, as the read took them
        before = data[: line.offset - start].decode("utf-8", errors="replace").splitlines()
        if hole:
            before = [text for text in before if text]
        if start > 0 and before:
            before = before[1:]
        line_end = data.find(b"\n", line.offset - start)
        decisive = data[line.offset - start : line_end if line_end >= 0 else len(data)].decode("utf-8", "replace")
        return [text[:2000] for text in before[-CONTEXT_LINES:]] + [decisive[:2000]]


def decisive_line(evidence: AttemptEvidence, diagnosis: Diagnosis) -> LogLine | None:
    """The line of the initiating rank the verdict rests on: one of its signature, else its exception's, else
    its first; shown with the lines before it."""
    ev = evidence.rank(diagnosis.initiating_rank) if diagnosis.initiating_rank is not None else None
    if ev is None or not ev.lines:
        return None
    for wanted in (diagnosis.signature_id, GENERIC_EXCEPTION):
        found = next((line for line in ev.lines if line.signature == wanted), None)
        if found is not None:
            return found
    return ev.lines[0]


def evidence_folders(path: Path) -> list[Path]:
    """The attempts of ``torchrun-diag`` evidence folders under ``path`` to read as the live agent does: of a
    diag dir its newest attempt, an ``attempt_N`` folder given itself."""
    if is_attempt_dir(path):
        return [path]
    if not path.is_dir():
        return []
    found = []
    for root, dirs, _files in os.walk(path, followlinks=False):
        attempts = [d for d in attempt_dirs(Path(root)) if is_attempt_dir(d)]
        if attempts:
            found.append(attempts[-1])
            dirs[:] = [d for d in dirs if not d.startswith("attempt_")]
        dirs.sort()
    return found


def _under(path: Path, folders: tuple[str, ...]) -> bool:
    text = str(path)
    return any(text == f or text.startswith(f + os.sep) for f in folders)


def combined(folders: list[AttemptEvidence], logs: AttemptEvidence) -> AttemptEvidence:
    """The evidence folders' attempts and the logs read beside them, as one attempt: a rank's record from a
    folder is kept whole (the launcher watched it); a rank only the logs show is added."""
    if not folders:
        return logs
    ranks = {ev.rank: ev for ev in logs.ranks}
    for folder in folders:
        ranks.update((ev.rank, ev) for ev in folder.ranks)
    first = folders[0]
    return replace(
        logs, attempt=first.attempt, run_id=first.run_id, source=first.source,
        ranks=tuple(sorted(ranks.values(), key=lambda ev: ev.rank)),
        decided_at=min((f.decided_at for f in folders if f.decided_at is not None), default=None),
        hang=next((f.hang for f in folders if f.hang is not None), None),
        came_up=any(f.came_up for f in folders) if any(f.came_up is not None for f in folders) else None,
        stalls=tuple(s for f in folders for s in f.stalls),
    )  # fmt: skip


# a gzipped log is read up to this many times its compressed size decompressed (at least GZIP_MIN_LIMIT bytes):
# real logs compress 5 to 30x; a bomb (or a log of one line repeated) expands 1,000x
GZIP_RATIO_LIMIT = 100
GZIP_MIN_LIMIT = 256 << 20


def _bounded(read: Callable[[int], bytes], limit: int, on_cut: Callable[[], None]) -> Callable[[int], bytes]:
    """``read`` that gives at most ``limit`` bytes in all, and calls ``on_cut`` when there was more."""
    done = [0]

    def bounded(n: int) -> bytes:
        if done[0] >= limit:
            if read(1):
                on_cut()
            return b""
        data = read(min(n, limit - done[0]))
        done[0] += len(data)
        return data

    return bounded


def _holes_as_breaks(read: Callable[[int], bytes], holes: list[int]) -> Callable[[int], bytes]:
    """``read`` with every NUL byte made a newline (a crashed writer's hole, a sparse file's: the text after it
    starts a line; each offset stays the file's own), counted in ``holes[0]``."""

    def read_text(n: int) -> bytes:
        data = read(n)
        if b"\x00" in data:  # memchr: nothing to pay for a file without NULs
            holes[0] += data.count(b"\x00")
            data = data.replace(b"\x00", b"\n")
        return data

    return read_text


def chunks_of(read: Callable[[int], bytes], wrap: int | None) -> Iterator[tuple[bytes, int]]:
    """A file's bytes (``read(n)``) as chunks of whole lines and their offsets: at most :data:`CHUNK` bytes read
    at a time, a line longer than 4 chunks cut, a hard-wrapped line (``wrap``) kept with its continuation."""
    carry = b""
    base = 0
    while True:
        block = read(CHUNK)
        if not block:
            break
        data = carry + block
        cut = data.rfind(b"\n")
        if cut < 0 and len(data) < 4 * CHUNK:
            carry = data
            continue
        if cut < 0:
            cut = len(data) - 1  # a giant line: cut it
        if wrap and cut > 0:  # a wrapped line at the end stays with its continuation
            prev = data.rfind(b"\n", 0, cut)
            if cut - prev - 1 == wrap and prev >= 0:
                cut = prev
        chunk, carry = data[: cut + 1], data[cut + 1 :]
        yield chunk, base
        base += len(chunk)
    if carry:
        yield carry + b"\n", base


def _decode(line: bytes) -> str:
    return line.decode("utf-8", errors="replace").rstrip("\r")


# Python's report of an excepthook that raised: its traceback, then "Original exception was:" and the rank's own
_ORIGINAL = "Original exception was:"
# torchrun-diag's own summary: its first line, and its last ("  evidence: DIR  (report: ...; page: ...)")
_OWN_SUMMARY = re.compile(r"^elastic_diag: job (?:FAILED|succeeded|STOPPED)\b")
_OWN_SUMMARY_END = re.compile(r"^evidence: .*\(report: .*; page: .*\)$")
# torch.multiprocessing.spawn's ProcessRaisedException: "-- Process 1 terminated with the following error:",
# then that process's traceback, without prefixes (its index is its rank)
_TABLE_ROW = re.compile(r"^rank\s*:\s*(?P<rank>\d+)\s*\(local_rank:\s*(?P<local>\d+)\)")  # torchrun's table
_SPAWN_BLOCK = re.compile(r"^-- Process (?P<rank>\d+) terminated with the following error")
# a rank-local phase beginning: a checkpoint save, an evaluation (what one rank's path alone may do)
_PHASE = re.compile(r"\b(?:[Ss]aving (?:model )?(?:checkpoint|model|state|weights)|[Ee]valuating|Running [Ee]valuation|"
                    r"[Vv]alidation (?:sanity check|loop|epoch|DataLoader)"
                    # the data preparation frameworks run on the main process first (datasets' map, HF examples,
                    # LLaMA-Factory, axolotl, TRL): its progress bars and log lines
                    r"|Running tokenizer on|[Tt]okeniz(?:ing|e) (?:the )?(?:[Pp]rompts|dataset|train|data)"
                    r"|^\s*Map(?: \(num_proc=\d+\))?:\s+\d+%"
                    r"|Grouping texts in chunks|Packing (?:the )?dataset"
                    r"|Generating (?:train|validation|test) split)")  # fmt: skip


# every phase line holds one of these (the pattern costs 7 us a line: these are tested first)
_PHASE_WORDS = ("aving ", "valuat", "alidation ", "okeniz", "Map", "rouping texts", "acking ", "enerating ")


def is_phase_line(text: str) -> bool:
    """The line says a rank-local phase began (a checkpoint save, an evaluation, data preparation)."""
    return any(word in text for word in _PHASE_WORDS) and _PHASE.search(text) is not None


# what launchers raise about their workers' failures (torchrun, torch.multiprocessing.spawn, accelerate)
_LAUNCHER_EXCEPTIONS = ("ChildFailedError", "SignalException", "CalledProcessError", "ProcessExitedException",
                        "ProcessRaisedException")  # fmt: skip


_ANCHOR_TEXT = tuple(a.decode() for a in ANCHORS)


# the end of a tqdm frame ("| 280000/2969526 [29:55<4:48:08, 155.57 examples/s]") with what another process
# printed glued to it, no newline between: a log record, a rank prefix, a traceback
_GLUED_AFTER_BAR = re.compile(
    r"\[\d+:\d+(?::\d+)?(?:<[\d:?]+)?, [^\]\n]{0,100}\](?=\[[EWFI][\d ]|\[rank\d|\[default\d|Traceback )"
)


def line_key(line_bytes: bytes, file_rank: int | None) -> tuple[int | None, bytes, bytes]:
    """What a line's repeats have in common: its rank (its file's, its prefix), and the rest with every digit
    made 0 and each run of 8 hex digits or more (an address, a request id) made one "#"."""
    # "[rank3]:", "[default0]:[rank8]:" (the last "]:" in the first 40 bytes), else a host before them
    bracket = line_bytes[:1] == b"["
    cut = line_bytes.rfind(b"]:", 0, 40) + 2 if bracket else _KEY_PREFIX.match(line_bytes).end()  # type: ignore[union-attr]
    rest = line_bytes[cut:]
    xs = rest.translate(_HEX_AS_X)
    if b"xxxxxxxx" in xs:
        parts: list[bytes] = []
        done = 0
        for m in _X_RUN.finditer(xs):
            parts += (rest[done : m.start()], b"#")
            done = m.end()
        parts.append(rest[done:])
        rest = b"".join(parts)
    return file_rank, line_bytes[: max(cut, 0)], rest.translate(_NO_DIGITS)


def _unglue(frame: str) -> list[str]:
    m = _GLUED_AFTER_BAR.search(frame)
    return [frame] if m is None else [frame[: m.end()], *_unglue(frame[m.end() :])]


def _frames(raw: str) -> list[str]:
    """The lines of one physical line: a progress bar rewrites itself with ``\\r`` and no newline, so the
    frames, and what another process printed between them or glued after a frame's end, are lines of their
    own; only those that hold an anchor are worth parsing."""
    if "\r" not in raw.rstrip("\r\n"):
        return _unglue(raw) if "/s]" in raw or "/it]" in raw else [raw]
    return [g for f in raw.split("\r") if f.strip() and any(a in f for a in _ANCHOR_TEXT) for g in _unglue(f)]


def analyze_paths(
    paths: Iterable[str | Path], taxonomy: Taxonomy | None = None, progress: Callable[[str], None] | None = None
) -> Analysis:
    analyzer = Analyzer(taxonomy)
    analyzer.add_paths(paths, progress)
    return analyzer.finish()


def format_analysis(a: Analysis, paint: Paint | None = None) -> str:
    from elastic_diag.report.terminal import shown

    paint = paint or Paint(False)
    d = a.diagnosis
    out = []
    if d.failure_class == "healthy":
        out.append(paint("elastic-diag analyze: healthy, no rank reported an error", "bold", "green"))
    else:
        who = f"rank {d.initiating_rank}" if d.initiating_rank is not None else "no rank can be named"
        out.append(paint(f"elastic-diag analyze: {d.failure_class}; initiating: {who}", "bold", "red"))
    out.append(f"  {shown(d.summary)}")
    if a.torchrun_root is not None and a.torchrun_root != d.initiating_rank:
        out.append(f"  (torchrun's own summary named rank {a.torchrun_root} as root cause; that rank was only waiting)")
    if d.evidence:
        out.append("  decisive lines:")
        out.extend(f"    {shown(e)}" for e in d.evidence)
    roles: dict[str, list[int]] = {}
    for r, role in sorted(d.roles.items()):
        roles.setdefault(role, []).append(r)
    if roles:
        out.append("  roles: " + "; ".join(f"{k} {format_ranks(v)}" for k, v in sorted(roles.items())))
    if d.fix:
        out.append(paint("  fix: ", "bold") + shown(" ".join(d.fix.split())))
    plan = render(d.verify, None, evidence=d.evidence, live=False)
    if plan is not None:
        out.append(paint("  verify: ", "bold") + shown(plan.command))
        out.extend(f"    where {var} is {shown(meaning)}" for var, meaning in plan.variables.items())
    if a.context:
        out.append(f"  context ({len(a.context) - 1} lines before the decisive line):")
        out.extend(f"    | {shown(line)}" for line in a.context[-12:])
    if a.known_good is not None:
        from elastic_diag.report.known_good import format_known_good

        out.extend(format_known_good(a.known_good, a.known_good.get("first_divergence", []), shown))
    out.append(f"  read {len(a.files)} file(s)" + (f"; skipped {len(a.skipped)}:" if a.skipped else ""))
    out.extend(f"    {shown(s)}" for s in a.skipped[:20])
    return "\n".join(out)
