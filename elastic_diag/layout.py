"""The evidence folder, the one on-disk contract: every file's name, every environment variable that
carries the diagnosis into a rank, and the reader of each file. The worker writes these files, the
live agent and the offline analyzer read them through the same readers, so the two cannot drift.

::

    <diag-dir>/
        report.json  report.html          the run's verdict (schema elastic_diag.report/1) and its page
        attempt_<N>/
            report.json                   the attempt's own report
            environment.json              versions, memory, disks, ulimits, variables, GPUs at the first failure
            stall_<K>/                    the K-th stall the health monitor saw (nothing was stopped for it)
                stall.json                who waited inside a collective, who was outside it, since when, where
                rank_<global rank>/       stacks.txt, fr_trace.json, pyspy.txt as the rank was at the stall
            filtered_stdout.log  filtered_stderr.log   torch's --local-ranks-filter streams
            gate/                         the restart gate's controls and their output
            rank_<global rank>/
                stdout.log  stderr.log    every byte the rank wrote, always kept
                error.json                torchelastic's error file (written by @record or our bootstrap)
                exception.json            the bootstrap's record of an uncaught exception (precise time)
                thread_exception.json     the first uncaught exception of another thread
                stacks.txt                faulthandler dumps taken on the dump signal or a dump request
                worker.json               pid and start time
                progress.json             the progress beacon the health monitor reads
                fr_trace.json             the flight recorder's entries (on a dump request, an exception, exit)
                nccl_trace_rank_<R>       NCCL's own flight-recorder dump on a watchdog timeout (a pickle)
                nonfinite.json            the first non-finite loss the rank backpropagated
                dump.request  dump.done   the agent's request for stacks and the beacon's answer
                pyspy.txt                 native stacks (py-spy, when installed) taken on a hang alarm
                first_error.json          the first error of its own the rank printed, with when (the line clock)
                root_cause.json           the error file torch's "Root Cause" block is pointed at

Torch-free and cheap to import (every rank imports it before the user's script): the readers import
the core's record types when they are first called. Every reader is bounded and never raises on a
missing or garbled file.
"""

from __future__ import annotations

import json
import os
import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from elastic_diag.core.evidence import ErrorLine, ExceptionRecord
    from elastic_diag.core.flight_recorder import RankRecord
    from elastic_diag.core.stall import StallRecord

# --- the documents (their JSON Schemas: elastic_diag/report/schemas/) -------------------------------
REPORT_SCHEMA = "elastic_diag.report/1"
ANALYSIS_SCHEMA = "elastic_diag.analysis/1"
NODE_RECORD_SCHEMA = "elastic_diag.node_record/1"
NODE_VERDICT_SCHEMA = "elastic_diag.node_verdict/1"

# --- the folder ------------------------------------------------------------------------------------
REPORT_FILE = "report.json"
HTML_FILE = "report.html"
GATE_DIR = "gate"
FILTERED_STDOUT_FILE = "filtered_stdout.log"
FILTERED_STDERR_FILE = "filtered_stderr.log"

STDOUT_FILE = "stdout.log"
STDERR_FILE = "stderr.log"
STREAM_FILES = (STDERR_FILE, STDOUT_FILE)
ERROR_FILE = "error.json"  # torchelastic's own error-file format
EXCEPTION_FILE = "exception.json"  # ours: precise time, type, message, class hierarchy, chain, traceback
THREAD_EXCEPTION_FILE = "thread_exception.json"
STACKS_FILE = "stacks.txt"
WORKER_FILE = "worker.json"
PROGRESS_FILE = "progress.json"
FR_FILE = "fr_trace.json"
NCCL_TRACE_PREFIX = "nccl_trace_rank_"
NONFINITE_FILE = "nonfinite.json"
DUMP_REQUEST_FILE = "dump.request"
DUMP_DONE_FILE = "dump.done"
DUMP_WAKE_FILE = "dump.wake"  # a FIFO the beacon waits on: a dump request wakes it at once (removed at exit)
PYSPY_FILE = "pyspy.txt"
FIRST_ERROR_FILE = "first_error.json"
ROOT_CAUSE_FILE = "root_cause.json"
STALL_FILE = "stall.json"
STALL_MAX_BYTES = 1 << 20
STALL_FR_MAX_BYTES = 8 << 20  # a stall keeps a copy of each rank's flight recorder up to this size
ENVIRONMENT_FILE = (
    "environment.json"  # attempt_N/: versions, memory, disks, ulimits, variables, GPUs at the first failure
)

# a rank folder reused (the same --diag-dir again) starts without the last run's records
STALE_FILES = (EXCEPTION_FILE, ERROR_FILE, STACKS_FILE, PROGRESS_FILE, FR_FILE, NONFINITE_FILE, DUMP_REQUEST_FILE,
               DUMP_DONE_FILE, DUMP_WAKE_FILE, PYSPY_FILE, THREAD_EXCEPTION_FILE, FIRST_ERROR_FILE)  # fmt: skip


def attempt_dir_name(attempt: int) -> str:
    return f"attempt_{attempt}"


def rank_dir_name(rank: int) -> str:
    return f"rank_{rank}"


def stall_dir_name(number: int) -> str:
    return f"stall_{number}"


# --- the environment ---------------------------------------------------------------------------------
# set by the launcher for every rank
ENV_RANK_DIR = "ELASTIC_DIAG_RANK_DIR"  # the rank's folder (above): the bootstrap writes there
ENV_BOOT_PATH = "ELASTIC_DIAG_BOOT_PATH"  # the bootstrap's folder put first on PYTHONPATH (removed in the rank)
ENV_ATTEMPT = "ELASTIC_DIAG_ATTEMPT"
ENV_RESUME_FROM = "ELASTIC_DIAG_RESUME_FROM"  # the restart gate: the newest verified checkpoint
ENV_PREVIOUS_DIAGNOSIS = "ELASTIC_DIAG_PREVIOUS_DIAGNOSIS"  # the restart gate: the verdict that ended the last attempt
# read by the ranks (the user's settings)
ENV_PROGRESS_INTERVAL = "ELASTIC_DIAG_PROGRESS_INTERVAL"
ENV_NO_TORCH_HOOKS = "ELASTIC_DIAG_NO_TORCH_HOOKS"
ENV_BEACON = "ELASTIC_DIAG_BEACON"
# read by the launcher and the analyzer (the settings' own variables are in elastic_diag.config)
ENV_CLOCK_SKEW = "ELASTIC_DIAG_CLOCK_SKEW"  # a test hook: seconds added to this host's clock (agent and ranks)
ENV_SWITCH = "ELASTIC_DIAG"  # "1": torch's own c10d and static rendezvous run with diagnosis (plain torchrun)
ENV_NO_GREP = "ELASTIC_DIAG_NO_GREP"  # "1": the analyzer never uses the system grep as its prefilter
# the analyzer's first stage: "hyperscan", "grep", "python" or "auto" (the fastest that works here)
ENV_PREFILTER = "ELASTIC_DIAG_PREFILTER"
# torch's own
ENV_TORCHELASTIC_ERROR_FILE = "TORCHELASTIC_ERROR_FILE"
ENV_TORCHELASTIC_RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
ENV_DISABLE_SHARED_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
ENV_FR_BUFFER_SIZE = "TORCH_FR_BUFFER_SIZE"  # the old name TORCH_NCCL_TRACE_BUFFER_SIZE warns in every rank (2.13)
ENV_NCCL_DUMP_ON_TIMEOUT = "TORCH_NCCL_DUMP_ON_TIMEOUT"
ENV_NCCL_DEBUG_INFO_TEMP_FILE = "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"


def flight_recorder_env(rank_dir: Path) -> dict[str, str]:
    """The flight recorder on, for gloo (on by default in torch 2.13) and NCCL, NCCL's own dump on a
    watchdog timeout into the rank's folder (``nccl_trace_rank_<rank>``). A value the user set wins."""
    return {
        ENV_FR_BUFFER_SIZE: "2000",
        ENV_NCCL_DUMP_ON_TIMEOUT: "1",
        ENV_NCCL_DEBUG_INFO_TEMP_FILE: str(rank_dir / NCCL_TRACE_PREFIX),
    }


@dataclass(slots=True)
class RankLayout:
    rank: int
    local_rank: int
    dir: Path

    def path(self, name: str) -> Path:
        return self.dir / name


@dataclass(slots=True)
class AttemptLayout:
    attempt: int
    dir: Path
    ranks: dict[int, RankLayout] = field(default_factory=dict)  # by local rank


# --- the readers: bounded, never raise on a missing or garbled file ---------------------------------
TAIL_BYTES = 64 * 1024
STACK_BYTES = 256 * 1024
FR_MAX_BYTES = 64 << 20  # a flight-recorder dump larger than this is neither written nor read
PROGRESS_MAX_BYTES = 1 << 20
FR_ERRORS = (ValueError, pickle.UnpicklingError, EOFError, TypeError, KeyError, IndexError)


def read_tail_bytes(path: Path, max_lines: int, max_bytes: int = TAIL_BYTES) -> list[bytes]:
    """The last ``max_lines`` lines of a file split at ``\n`` alone, undecoded (the offline analyzer
    decodes only the few it reads), from at most ``max_bytes`` at its end."""
    try:
        with open(path, "rb") as fp:
            fp.seek(0, os.SEEK_END)
            fp.seek(max(0, fp.tell() - max_bytes))
            return last_lines_of(fp.read(max_bytes), max_lines)
    except OSError:
        return []


def last_lines_of(data: bytes, max_lines: int) -> list[bytes]:
    return data.rstrip(b"\r\n").rsplit(b"\n", max_lines)[-max_lines:] if data.strip() else []


def read_tail(
    path: Path, max_lines: int, max_bytes: int = TAIL_BYTES, *, newline_only: bool = False
) -> tuple[str, ...]:
    """The last ``max_lines`` lines of a text file, reading at most ``max_bytes`` from its end.

    Live (the default), a line ends at any line break Python knows (a progress bar's ``\r`` too), a line cut
    by the window is dropped and each line is cut at 4,000 characters. ``newline_only`` (the offline
    analyzer, which reads the ``\r`` frames with its own line parser) splits at ``\n`` alone and keeps
    every line whole."""
    try:
        with open(path, "rb") as fp:
            fp.seek(0, os.SEEK_END)
            size = fp.tell()
            start = max(0, size - max_bytes)
            fp.seek(start)
            data = fp.read(max_bytes)
    except OSError:
        return ()
    if newline_only:
        return tuple(line.decode("utf-8", errors="replace").rstrip("\r") for line in last_lines_of(data, max_lines))
    text = data.decode("utf-8", errors="replace")
    lines = text.splitlines()
    if start > 0 and lines:
        lines = lines[1:]  # the first line was cut by the window
    return tuple(line[:4000] for line in lines[-max_lines:])


def read_json(path: Path, max_bytes: int | None = None) -> dict[str, Any] | None:
    """A JSON object, or None (missing, unreadable, not JSON, not an object, over ``max_bytes``)."""
    try:
        with open(path, "rb") as fp:
            raw = fp.read() if max_bytes is None else fp.read(max_bytes + 1)
        if max_bytes is not None and len(raw) > max_bytes:
            return None
        data = json.loads(raw.decode("utf-8", errors="replace"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def read_progress(path: Path) -> dict[str, Any] | None:
    """The beacon's progress.json (written every half second by the rank; a partial write reads as None)."""
    return read_json(path, PROGRESS_MAX_BYTES)


def exception_from_error_file(data: dict[str, Any] | None) -> ExceptionRecord | None:
    """The exception in torchelastic's error file (``{"message": {"message": "T: msg", "extraInfo": {...}}}``)."""
    from elastic_diag.core.evidence import ExceptionRecord

    msg = data.get("message") if data else None
    if not isinstance(msg, dict) or not isinstance(msg.get("message"), str):
        return None
    etype, _, text = msg["message"].partition(": ")
    extra = msg.get("extraInfo") or {}
    ts = extra.get("timestamp") if isinstance(extra, dict) else None
    callstack = extra.get("py_callstack", "") if isinstance(extra, dict) else ""
    return ExceptionRecord(
        type=etype or "Exception",
        message=text,
        traceback=str(callstack)[:100_000],
        time=float(ts) if isinstance(ts, str) and ts.isdigit() else None,
    )


def exception_from_file_data(data: dict[str, Any] | None) -> ExceptionRecord | None:
    """Either file's exception, told apart by its shape: ours (exception.json) or torchelastic's (error.json)."""
    from elastic_diag.core.evidence import exception_from_json

    if data is not None and "type" in data:
        return exception_from_json(data)
    return exception_from_error_file(data)


def read_exception(rank_dir: Path) -> ExceptionRecord | None:
    """The uncaught exception of a rank: the bootstrap's record, else torchelastic's error file."""
    from elastic_diag.core.evidence import exception_from_json

    record = exception_from_json(read_json(rank_dir / EXCEPTION_FILE))
    if record is not None:
        return record
    return exception_from_error_file(read_json(rank_dir / ERROR_FILE))


def read_thread_exception(rank_dir: Path) -> ExceptionRecord | None:
    from elastic_diag.core.evidence import exception_from_json

    return exception_from_json(read_json(rank_dir / THREAD_EXCEPTION_FILE))


def read_error_line(rank_dir: Path) -> ErrorLine | None:
    """The first own error the launcher's line clock saw (first_error.json)."""
    from elastic_diag.core.error_lines import error_line_from_json

    return error_line_from_json(read_json(rank_dir / FIRST_ERROR_FILE))


def stack_file_size(rank_dir: Path) -> int:
    try:
        return (rank_dir / STACKS_FILE).stat().st_size
    except OSError:
        return 0


def read_stack_since(rank_dir: Path, offset: int) -> str:
    try:
        with open(rank_dir / STACKS_FILE, "rb") as fp:
            fp.seek(offset)
            return fp.read(STACK_BYTES).decode("utf-8", errors="replace")
    except OSError:
        return ""


@dataclass(frozen=True, slots=True)
class FlightRecordRead:
    """What reading a flight-recorder file gave: the record, or why there is none. ``is_dump`` is False
    when the file is not a dump at all (the analyzer then reads it as a log)."""

    record: RankRecord | None = None
    problem: str | None = None
    is_dump: bool = True


def load_flight_record(path: Path, rank: int | None, max_bytes: int = FR_MAX_BYTES) -> FlightRecordRead:
    """A flight-recorder dump (torch's JSON or pickle, or elastic_diag's fr_trace.json) as a rank's record."""
    from elastic_diag.core.flight_recorder import load_dump, parse_record

    try:
        size = path.stat().st_size
        if size > max_bytes:
            return FlightRecordRead(problem=f"flight-recorder dump of {size} bytes is over the {max_bytes}-byte limit")
        raw = path.read_bytes()
    except FileNotFoundError:
        return FlightRecordRead(is_dump=False)
    except OSError as e:
        return FlightRecordRead(problem=f"flight-recorder dump unreadable ({e.strerror or e})")
    try:
        data = load_dump(raw)
    except FR_ERRORS as e:
        if raw[:1] in (b"{", b"\x80"):
            return FlightRecordRead(problem=f"not a usable flight-recorder dump ({str(e)[:200]})")
        return FlightRecordRead(is_dump=False)
    if rank is None:
        return FlightRecordRead(problem="flight-recorder dump with no rank in its name")
    try:
        return FlightRecordRead(record=parse_record(rank, data))
    except FR_ERRORS as e:
        return FlightRecordRead(problem=f"not a usable flight-recorder dump ({str(e)[:200]})")


def read_flight_record(rank_dir: Path, rank: int) -> tuple[RankRecord | None, str | None]:
    """The rank's flight-recorder dump (``fr_trace.json``, else NCCL's own) and, when it cannot be used, why."""
    path = rank_dir / FR_FILE
    if not path.exists():  # NCCL's own dump on a watchdog timeout (a pickle), when ours is absent
        path = next(iter(sorted(rank_dir.glob(f"{NCCL_TRACE_PREFIX}*"))), path)
    got = load_flight_record(path, rank)
    if got.problem is not None:
        return None, f"rank {rank}: {got.problem}"
    return got.record, None


def read_stalls(attempt_dir: Path) -> tuple[StallRecord, ...]:
    """The attempt's stall records (``stall_<K>/stall.json``) in order, each rank's stack from its snapshot."""
    from elastic_diag.core.evidence import parse_stack_dump
    from elastic_diag.core.stall import stall_from_json

    found = []
    for folder in attempt_dir.glob("stall_*"):
        number = folder.name.removeprefix("stall_")
        data = read_json(folder / STALL_FILE, STALL_MAX_BYTES) if number.isdigit() else None
        if data is None:
            continue
        stacks = {}
        for entry in data.get("ranks") or ():
            if isinstance(entry, dict) and isinstance(entry.get("rank"), int):
                dump = parse_stack_dump(read_stack_since(folder / rank_dir_name(entry["rank"]), 0))
                if dump is not None:
                    stacks[entry["rank"]] = dump
        record = stall_from_json(data, stacks)
        if record is not None:
            found.append(record)
    return tuple(sorted(found, key=lambda r: r.number))


def latest_checkpoint(folder: Path | None) -> Path | None:
    """The newest entry (file or folder) under ``folder`` (the checkpoint dir), by modification time;
    None when empty or unreadable. The restart gate resumes from it; the reports name it."""
    if folder is None:
        return None
    stamped = []
    try:
        for p in folder.iterdir():
            if not p.name.startswith("."):
                try:
                    stamped.append((p.stat().st_mtime, p))
                except OSError:  # removed meanwhile (a rotation of old checkpoints)
                    continue
    except OSError:
        return None
    return max(stamped, key=lambda x: x[0])[1] if stamped else None
