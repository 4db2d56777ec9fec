"""The evidence folder, the one on-disk contract: every file's name, every environment variable that
carries the diagnosis into a rank, and the reader of each file. The worker writes these files, the
live agent and the offline analyzer read them through the same readers, so the two cannot drift.

::

    <diag-dir>/                           folders 0700, files 0600 (private to the user, whatever the umask)
        report.json  report.html          the run's verdict (schema elastic_diag.report/1) and its page
        launcher_alive.<node>.json        the launcher's pid while it runs, removed once its final report is
                                          written: left behind, it says the launcher died (launcher_deaths)
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
                dump.request  dump.done   the agent's request for stacks and the beacon's answer (the agent
                                          wakes the beacon through a socket with no file: wake_address)
                pyspy.txt                 native stacks (py-spy, when installed) taken on a hang alarm
                first_error.json          the first error of its own the rank printed, with when (the line clock)
                root_cause.json           the error file torch's "Root Cause" block is pointed at
                launcher.json             what the launcher saw of the rank: its exit (code, time, stopped by it),
                                          where the stack taken at the verdict begins in stacks.txt, what the
                                          kernel said of a SIGKILL; when its node took the verdict, the alarm

:func:`read_attempt` reads an attempt's folder into the core's evidence model, for the live agent and for
``elastic-diag analyze`` alike: the live verdict is the verdict on what is on disk. :func:`write_atomic` is
the one way a file of the folder is written (a temporary file, then a rename; secrets masked; on a full disk
the temporary file is removed and the old file, if any, stays whole), :func:`make_private_dir` and
:func:`create_private_file` the way a folder or a file someone else writes into (torch, the ranks' streams)
is made.

Torch-free and cheap to import (every rank imports it before the user's script): the readers import
the core's record types when they are first called. Every reader is bounded and never raises on a
missing or garbled file.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from elastic_diag.core.calls import RankCalls
    from elastic_diag.core.evidence import AttemptEvidence, ErrorLine, LogLine, RankEvidence
    from elastic_diag.core.exceptions import ExceptionRecord
    from elastic_diag.core.flight_recorder import RankRecord
    from elastic_diag.core.progress import NonFinite, Progress
    from elastic_diag.core.stall import StallRecord
    from elastic_diag.core.taxonomy import Taxonomy


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
TERM_STACKS_FILE = "stacks_at_sigterm.txt"  # elastic-diag exec: the stack a rank wrote when a launcher's SIGTERM hit it
WORKER_FILE = "worker.json"
PROGRESS_FILE = "progress.json"
FR_FILE = "fr_trace.json"
CALLS_FILE = "calls.json"  # the roots and peers of its collective calls, its new_group calls (worker/calls.py)
CALLS_MAX_BYTES = 4 << 20
NCCL_TRACE_PREFIX = "nccl_trace_rank_"
NONFINITE_FILE = "nonfinite.json"
DUMP_REQUEST_FILE = "dump.request"
DUMP_DONE_FILE = "dump.done"
DUMP_WAKE_FILE = "dump.wake"  # an earlier version's FIFO: removed when a folder is reused (see wake_address)
PYSPY_FILE = "pyspy.txt"
FIRST_ERROR_FILE = "first_error.json"
ROOT_CAUSE_FILE = "root_cause.json"
STALL_FILE = "stall.json"
LAUNCHER_FILE = "launcher.json"  # rank_R/: what the launcher saw of the rank (its exit, the verdict's time)
LAUNCHER_SCHEMA = "elastic_diag.launcher/1"
CLAIM_FILE = "exec.claim"  # rank_R/ under elastic-diag exec: which watch or process has the rank (host, pid)
JOINED_FILE = "joined.json"  # rank_R/: a process that became rank R by joining a process group (worker/spawned.py)
EXITS_DIR = "exits"  # attempt_N/exits/<pid>.json: a spawned rank's exit, as the process that reaped it saw it
PARENT_DIR = "exec_parent"  # attempt_N/exec_parent/: the streams of a command whose children are the ranks
_REPORT_SCHEMA = "elastic_diag.report/1"  # core/schema_ids.py's; layout reads an older report's facts
STALL_MAX_BYTES = 1 << 20
MAX_STALL_PARTS = 4096  # stall.<part>.json files read in one stall folder (a watch each under elastic-diag exec)
STALL_FR_MAX_BYTES = 8 << 20  # a stall keeps a copy of each rank's flight recorder up to this size
ENVIRONMENT_FILE = (
    "environment.json"  # attempt_N/: versions, memory, disks, ulimits, variables, GPUs at the first failure
)

# a rank folder reused (the same --diag-dir again) starts without the last run's records
STALE_FILES = (EXCEPTION_FILE, ERROR_FILE, STACKS_FILE, PROGRESS_FILE, FR_FILE, CALLS_FILE, NONFINITE_FILE,
               DUMP_REQUEST_FILE, DUMP_DONE_FILE, DUMP_WAKE_FILE, PYSPY_FILE, THREAD_EXCEPTION_FILE,
               FIRST_ERROR_FILE)  # fmt: skip


def wake_address(rank_dir: str | os.PathLike[str]) -> bytes:
    """Where the agent wakes a rank's beacon (a dump request answered at once, not at the next tick): a Unix
    datagram socket in Linux's abstract namespace named after the rank's folder. Nothing on disk: the kernel
    takes the name away when the rank dies, however it dies (a FIFO in the folder outlived a rank killed with
    its launcher, and a reader that opened it waited forever for a writer)."""
    import hashlib  # only where a beacon starts or the agent wakes one

    digest = hashlib.sha256(os.fsencode(os.path.abspath(rank_dir))).hexdigest()[:32]
    return b"\0elastic_diag-wake-" + digest.encode()


PRIVATE_DIR_MODE = 0o700  # the evidence holds paths, command lines, host names, the job's output
PRIVATE_FILE_MODE = 0o600
LAUNCHER_ALIVE_PREFIX = "launcher_alive."
LAUNCHER_ALIVE_MAX_BYTES = 4096


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
ENV_STACK_ON_TERM = "ELASTIC_DIAG_STACK_ON_TERM"  # "1": the rank writes its stacks when SIGTERM reaches it (exec)
ENV_SPAWN_DIR = "ELASTIC_DIAG_SPAWN_DIR"  # elastic-diag exec: the attempt folder a process joining a group writes into
ENV_LAUNCHER_PID = "ELASTIC_DIAG_LAUNCHER_PID"  # the rank exits when this process dies (worker/bootstrap.py)
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


# --- the writers ----------------------------------------------------------------------------------


def make_private_dir(path: Path) -> None:
    """``path`` and the parents it lacks, each new one 0700 whatever the umask (a folder that was there is
    left as it is: the user's own choice)."""
    missing = []
    for folder in (path, *path.parents):
        if folder.is_dir():
            break
        missing.append(folder)
    for folder in reversed(missing):
        try:
            os.mkdir(folder, PRIVATE_DIR_MODE)
        except FileExistsError:  # made meanwhile (another rank, another node's agent)
            continue
        os.chmod(folder, PRIVATE_DIR_MODE)  # mkdir's mode passes through the umask


def create_private_file(path: Path) -> None:
    """An empty file, 0600 whatever the umask, for another writer to open later (torch opens the ranks' streams
    with ``open(path, "w")``: that keeps the mode). A file already there keeps its content and becomes 0600."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, PRIVATE_FILE_MODE)
    try:
        os.fchmod(fd, PRIVATE_FILE_MODE)
    finally:
        os.close(fd)


def claim_rank_dir(attempt_dir: Path, rank: int, node: str) -> tuple[Path, str | None]:
    """``attempt_dir/rank_<R>/`` claimed for this process (``exec.claim``: host and pid, created exclusively),
    and None; or, when another process holds it (two launchers' variables that disagree, a task started twice,
    two children passing the same rank), a folder beside it, ``rank_<R>.<host>.<pid>/``, and the claim found.
    Either way the folder exists (0700) and nothing in the other one is touched."""
    folder = attempt_dir / rank_dir_name(rank)
    make_private_dir(folder)
    try:
        fd = os.open(folder / CLAIM_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, PRIVATE_FILE_MODE)
    except FileExistsError:
        try:
            claimed = (folder / CLAIM_FILE).read_text(errors="replace").strip()[:200]
        except OSError:
            claimed = "?"
        safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in node)[:64]
        folder = attempt_dir / f"{rank_dir_name(rank)}.{safe}.{os.getpid()}"
        make_private_dir(folder)
        return folder, claimed or "?"
    with os.fdopen(fd, "w") as f:
        f.write(f"host {node} pid {os.getpid()}\n")
    return folder, None


def write_atomic(path: Path, data: str | bytes, *, redact: bool = True) -> None:
    """A temporary file beside ``path``, then a rename: a reader never sees half a file, and a write that
    fails (a full disk: ENOSPC, EDQUOT) leaves no temporary file and the old ``path``, if any, whole. The file
    is 0600, its new folders 0700. Text has this process's secrets masked first (``redact``: off only for what
    holds none, on a hot path)."""
    from elastic_diag import redaction

    if not path.parent.is_dir():
        make_private_dir(path.parent)
    raw = data.encode("utf-8") if isinstance(data, str) else data
    if redact and isinstance(data, str):
        raw = redaction.current().text(data).encode("utf-8")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")  # threads write too
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, PRIVATE_FILE_MODE)
        with open(fd, "wb") as fp:
            os.fchmod(fd, PRIVATE_FILE_MODE)  # the mode os.open got passed through the umask
            fp.write(raw)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_json_atomic(path: Path, data: Any, *, indent: int | None = 2, redact: bool = True) -> None:
    """``data`` as JSON, atomically; with ``redact``, this process's secrets masked in every string of it (before
    it is encoded: a value JSON would escape is still found)."""
    from elastic_diag import redaction

    if redact:
        data = redaction.current().data(data)
    text = json.dumps(data, indent=indent, default=str, separators=None if indent else (",", ":"))
    write_atomic(path, text + "\n" if indent else text, redact=redact)


def write_launcher_record(
    attempt: AttemptLayout, evidence: AttemptEvidence, *, node: str, tail_lines: int, stack_offsets: dict[int, int]
) -> tuple[dict[int, dict[str, Any]], list[str]]:
    """Each rank's ``launcher.json``: what the launcher saw of it (its exit, whether the launcher stopped it, what
    the kernel said of a SIGKILL, where the stack taken at the verdict begins in stacks.txt) and of the attempt
    on its node (when the verdict was taken, the health monitor's alarm). One file a rank, in the rank's own
    folder: the agents of several nodes that share a diag dir never write the same file. With the ranks' own
    files it is all :func:`read_attempt` needs. Returns every rank's record and what could not be written (a
    full disk): :func:`read_attempt` takes the records in hand for the files that are not there."""
    folders = {r.rank: r.dir for r in attempt.ranks.values()}
    records: dict[int, dict[str, Any]] = {}
    failed: list[str] = []
    for ev in evidence.ranks:
        if ev.rank not in folders:
            continue
        records[ev.rank] = {
            "schema": LAUNCHER_SCHEMA, "attempt": evidence.attempt, "run_id": evidence.run_id, "node": node,
            "decided_at": evidence.decided_at, "hang": evidence.hang, "tail_lines": tail_lines,
            "rank": {"rank": ev.rank, "local_rank": ev.local_rank, "pid": ev.pid, "exit_code": ev.exit_code,
                     "exit_time": ev.exit_time, "alive_at_decision": ev.alive_at_decision,
                     "stopped_by_agent": ev.stopped_by_agent, "kernel": ev.kernel.to_json() if ev.kernel else None,
                     "stack_offset": stack_offsets.get(ev.rank), "node": node},
        }  # fmt: skip
        try:
            write_json_atomic(folders[ev.rank] / LAUNCHER_FILE, records[ev.rank], indent=None)
        except OSError as e:
            failed.append(f"rank {ev.rank}: {LAUNCHER_FILE} could not be written ({e.strerror or e})")
    return records, failed


# --- the launcher's own record: whether it died --------------------------------------------------------


def launcher_alive_path(diag_dir: Path, node: str) -> Path:
    import re

    return diag_dir / f"{LAUNCHER_ALIVE_PREFIX}{re.sub(r'[^A-Za-z0-9._-]', '_', node) or 'node'}.json"


def process_start_ticks(pid: int) -> int | None:
    """When the process started, in clock ticks since boot (/proc/PID/stat's 22nd field): a pid and this
    name one process, not a later one that got the pid again. None: no such process (or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fp:
            fields = fp.read(4096).rsplit(b")", 1)[1].split()
        return int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def write_launcher_alive(diag_dir: Path, node: str) -> Path:
    """The launcher's record while it runs (pid, host, when it started); the session removes it once the
    run's final report is written. Found later with no process behind it: the launcher died."""
    import socket  # the launcher's, not the ranks' (layout is imported in every rank)

    path = launcher_alive_path(diag_dir, node)
    pid = os.getpid()
    write_json_atomic(path, {"pid": pid, "host": socket.gethostname(), "node": node, "started": time.time(),
                             "start_ticks": process_start_ticks(pid)}, indent=None)  # fmt: skip
    return path


def launcher_deaths(diag_dir: Path) -> list[str]:
    """What the launchers' records left in ``diag_dir`` say: one sentence a launcher that died without writing
    its final record (SIGKILL, the OOM killer, its node gone), or that is still running."""
    import socket

    from elastic_diag.core.values import as_int, as_seconds

    said = []
    try:
        records = sorted(diag_dir.glob(f"{LAUNCHER_ALIVE_PREFIX}*.json"))
    except OSError:
        return []
    for path in records:
        data = read_json(path, LAUNCHER_ALIVE_MAX_BYTES)
        pid = as_int(data.get("pid")) if data else None
        if data is None or pid is None:
            continue
        started = as_seconds(data.get("started"))
        when = time.strftime(" at %Y-%m-%d %H:%M:%S", time.localtime(started)) if started else ""
        who = f"the launcher (pid {pid} on {data.get('node') or data.get('host')}, started{when})"
        if data.get("host") != socket.gethostname():
            said.append(f"{who} wrote no final record: it is still running, or it died (another host: its "
                        "process cannot be looked at from here)")  # fmt: skip
        elif (ticks := process_start_ticks(pid)) is not None and ticks == data.get("start_ticks"):
            said.append(f"{who} is still running: this is the evidence so far")
        else:
            said.append(f"{who} died without writing its final record (killed: SIGKILL, the OOM killer); the "
                        "kernel sent its ranks SIGTERM; what follows is the evidence as it was left")  # fmt: skip
    return said


# --- the readers: bounded, never raise on a missing or garbled file ---------------------------------
TAIL_BYTES = 64 * 1024
STACK_BYTES = 256 * 1024
FR_MAX_BYTES = 64 << 20  # a flight-recorder dump larger than this is neither written nor read
PROGRESS_MAX_BYTES = 1 << 20
# what a garbled or hostile dump raises: RecursionError for nesting deeper than Python's stack (JSON or pickle),
# OverflowError for an infinite or 400-digit number where an integer belongs, MemoryError for a pickle's huge size
FR_ERRORS = (ValueError, pickle.UnpicklingError, EOFError, TypeError, KeyError, IndexError, AttributeError,
             RecursionError, OverflowError, MemoryError)  # fmt: skip


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


def read_window(path: Path, max_bytes: int) -> tuple[list[str], bool] | None:
    """A stream's lines in its last ``max_bytes`` (a line cut by the window dropped), and whether that is the
    whole file; None when it cannot be read."""
    try:
        with open(path, "rb") as fp:
            fp.seek(0, os.SEEK_END)
            start = max(0, fp.tell() - max_bytes)
            fp.seek(start)
            data = fp.read()
    except OSError:
        return None
    if start:
        cut = data.find(b"\n")
        data = data[cut + 1 :] if cut >= 0 else data
    return data.decode(errors="replace").splitlines(), start == 0


def read_json(path: Path, max_bytes: int | None = None) -> dict[str, Any] | None:
    """A JSON object, or None (missing, unreadable, not JSON, nested too deep, not an object, over ``max_bytes``)."""
    try:
        with open(path, "rb") as fp:
            raw = fp.read() if max_bytes is None else fp.read(max_bytes + 1)
        if max_bytes is not None and len(raw) > max_bytes:
            return None
        data = json.loads(raw.decode("utf-8", errors="replace"))
    except (OSError, ValueError, RecursionError):  # RecursionError: JSON nested deeper than Python's stack
        return None
    return data if isinstance(data, dict) else None


def read_progress(path: Path) -> Progress | None:
    """The beacon's progress.json (rewritten every tick by the rank; a partial write reads as None)."""
    from elastic_diag.core.progress import progress_from_json

    return progress_from_json(read_json(path, PROGRESS_MAX_BYTES))


def read_nonfinite(rank_dir: Path) -> NonFinite | None:
    from elastic_diag.core.progress import nonfinite_from_json

    return nonfinite_from_json(read_json(rank_dir / NONFINITE_FILE, PROGRESS_MAX_BYTES))


def read_error_file(path: Path) -> ExceptionRecord | None:
    """An exception.json of ours or torchelastic's error.json, told apart by their shape."""
    from elastic_diag.core.exceptions import exception_from_file_data

    return exception_from_file_data(read_json(path))


def read_exception(rank_dir: Path) -> ExceptionRecord | None:
    """The uncaught exception of a rank: the bootstrap's record, else torchelastic's error file."""
    from elastic_diag.core.exceptions import exception_from_error_file, exception_from_json

    record = exception_from_json(read_json(rank_dir / EXCEPTION_FILE))
    if record is not None:
        return record
    return exception_from_error_file(read_json(rank_dir / ERROR_FILE))


def read_thread_exception(rank_dir: Path) -> ExceptionRecord | None:
    from elastic_diag.core.exceptions import exception_from_json

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


def read_stack_since(rank_dir: Path, offset: int, name: str = STACKS_FILE) -> str:
    try:
        with open(rank_dir / name, "rb") as fp:
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


def read_calls(rank_dir: Path) -> RankCalls | None:
    """The rank's ``calls.json`` (worker/calls.py), or None."""
    from elastic_diag.core.calls import calls_from_json

    return calls_from_json(read_json(rank_dir / CALLS_FILE, CALLS_MAX_BYTES))


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
    """The attempt's stall records (``stall_<K>/stall.json``) in order, each rank's stack from its snapshot. Under
    ``elastic-diag exec`` each watch writes its part of a stall (``stall.<part>.json``, its own ranks): the parts
    of one stall are merged into one record (the earliest start and detection, every part's ranks)."""
    import dataclasses

    from elastic_diag.core.stacks import parse_stack_dump
    from elastic_diag.core.stall import stall_from_json

    found = []
    for folder in attempt_dir.glob("stall_*"):
        number = folder.name.removeprefix("stall_")
        if not number.isdigit():
            continue
        parts = []
        for path in sorted(folder.glob("stall*.json"))[:MAX_STALL_PARTS]:
            data = read_json(path, STALL_MAX_BYTES)
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
                parts.append(record)
        if not parts:
            continue
        first = min(parts, key=lambda r: r.detected_at)
        ranks: dict[int, Any] = {}
        for part in parts:  # each part lists every rank; the watch of a rank wrote its stack and where it was
            for r in part.ranks:
                known = (r.stack is not None, r.where is not None, r.beacon is not None)
                held = ranks.get(r.rank)
                if held is None or known > (held.stack is not None, held.where is not None, held.beacon is not None):
                    ranks[r.rank] = r
        found.append(
            dataclasses.replace(first, since=min(p.since for p in parts), ranks=tuple(ranks[k] for k in sorted(ranks)))
            if len(parts) > 1
            else first
        )
    return tuple(sorted(found, key=lambda r: r.number))


LAUNCHER_MAX_BYTES = 16 << 20
DEFAULT_TAIL_LINES = 40
STDOUT_TAIL_LINES = 10
MATCH_TAIL_LINES = 400  # a rank's stderr lines searched for signatures (within TAIL_BYTES of its end)


@dataclass(slots=True)
class AttemptRead:
    """An attempt's folder as evidence, what could not be read of it, and its environment snapshot."""

    evidence: AttemptEvidence
    problems: list[str] = field(default_factory=list)
    environment: dict[str, Any] | None = None


def _number(name: str, prefix: str) -> int | None:
    """N of a folder named ``<prefix>N``; None for another name, or a number no rank or attempt has."""
    from elastic_diag.core.values import MAX_RANK

    rest = name.removeprefix(prefix)
    if not name.startswith(prefix) or not rest.isascii() or not rest.isdigit() or len(rest) > 10:
        return None
    return int(rest) if int(rest) <= MAX_RANK else None


def attempt_dirs(diag_dir: Path) -> list[Path]:
    """The attempt folders of a diag dir, in order (``attempt_0``, ``attempt_1``, ...)."""
    try:
        found = [(n, d) for d in diag_dir.iterdir() if (n := _number(d.name, "attempt_")) is not None and d.is_dir()]
    except OSError:
        return []
    return [d for _, d in sorted(found)]


def is_attempt_dir(path: Path) -> bool:
    """An attempt's evidence folder: ``attempt_N`` holding rank folders."""
    if _number(path.name, "attempt_") is None or not path.is_dir():
        return False
    return any(_number(d.name, "rank_") is not None for d in path.iterdir())


def _launcher_facts(
    attempt_dir: Path, folders: dict[int, Path], problems: list[str], in_hand: dict[int, dict[str, Any]] | None = None
) -> tuple[dict[str, Any], dict[int, dict[str, Any]]]:
    """What the launcher saw: the attempt's fields (of the first rank's record; ``decided_at`` the earliest of
    the nodes') and each rank's record, from each rank's launcher.json. An earlier version's folder has none:
    the exits its report.json recorded stand in (facts, never its roles); else nothing is known."""
    records = {r: read_json(d / LAUNCHER_FILE, LAUNCHER_MAX_BYTES) for r, d in folders.items()}
    for r, held in (in_hand or {}).items():  # the live agent's own, where the disk did not take them
        if r in records and records[r] is None:
            records[r] = held
    ranks: dict[int, dict[str, Any]] = {}
    attempt: dict[str, Any] = {}
    for r, data in sorted(records.items()):
        if data is None:
            continue
        entry = data.get("rank")
        if data.get("schema") != LAUNCHER_SCHEMA or not isinstance(entry, dict):
            problems.append(f"rank {r}: {LAUNCHER_FILE} is not one this version reads: its exit is unknown")
            continue
        ranks[r] = {**entry, "rank": r}
        attempt = attempt or dict(data)
        decided = [t for t in (attempt.get("decided_at"), data.get("decided_at")) if isinstance(t, int | float)]
        attempt["decided_at"] = min(decided) if decided else None
        attempt["hang"] = attempt.get("hang") or data.get("hang")
    if ranks:
        missing = sorted(set(folders) - set(ranks))
        if missing:
            problems.append(f"ranks {', '.join(map(str, missing))}: no {LAUNCHER_FILE}: their exits are unknown")
        return attempt, ranks
    report = read_json(attempt_dir / REPORT_FILE, LAUNCHER_MAX_BYTES)
    if report is not None and isinstance(report.get("ranks"), list):
        problems.append(
            f"no {LAUNCHER_FILE} (an earlier version's folder): the exits come from its {REPORT_FILE}"
            + (f" (schema {report.get('schema')!r})" if report.get("schema") != _REPORT_SCHEMA else "")
        )
        facts = report_rank_facts(report)
        return {"node": report.get("node"), "run_id": report.get("run_id")}, {r: facts[r] for r in facts}
    if folders:
        problems.append(f"no {LAUNCHER_FILE}: no rank's exit is known (the launcher was killed before its verdict, "
                        "or the folder was copied without it)")  # fmt: skip
    return {}, {}


def report_rank_facts(report: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """What an earlier version's report.json (or one sent alone) recorded of each rank that the launcher saw:
    its exit, pid, node, last lines, stack, exception. Never its role: a report's verdict is not evidence. A rank
    whose stack was taken while it was killed by the launcher's signal, or that was SIGTERMed while another rank
    had failed by itself (torch's teardown), was alive at the verdict."""
    entries = [r for r in report.get("ranks") or () if isinstance(r, dict) and isinstance(r.get("rank"), int)]
    # torch's teardown SIGTERMs every rank still running once one has failed by itself
    teardown = any(r.get("exit_code") not in (0, -15, -9, None) for r in entries)
    ranks: dict[int, dict[str, Any]] = {}
    for r in entries:
        signalled = r.get("exit_code") in (-15, -9)
        stopped = signalled and (isinstance(r.get("stack"), str) or (teardown and r.get("exit_code") == -15))
        ranks[r["rank"]] = {**{k: v for k, v in r.items() if k != "role"}, "alive_at_decision": stopped,
                            "stopped_by_agent": stopped}  # fmt: skip
    return ranks


def read_report(path: Path, taxonomy: Taxonomy | None = None) -> AttemptRead | None:
    """A report.json with no evidence folder beside it (someone sent it), as evidence: its ranks' facts
    (:func:`report_rank_facts`), never its verdict; None for a file that is not a report of this schema family."""
    from elastic_diag.core.evidence import AttemptEvidence
    from elastic_diag.core.schema_ids import REPORT_SCHEMA
    from elastic_diag.core.taxonomy import load_taxonomy

    data = read_json(path, LAUNCHER_MAX_BYTES)
    if data is None or data.get("schema") != REPORT_SCHEMA:
        return None
    tax = taxonomy or load_taxonomy()
    problems = [
        f"{path}: a report sent alone: each rank's exit, last lines and stack as it recorded them, no rank folder"
    ]
    node = str(data.get("node") or "")
    facts = report_rank_facts(data)
    ranks = tuple(_rank_evidence(r, None, facts[r], node, DEFAULT_TAIL_LINES, tax, []) for r in sorted(facts))
    evidence = AttemptEvidence(attempt=len(data.get("attempts") or [None]) - 1, ranks=ranks,
                               run_id=str(data.get("run_id") or ""), source="live")  # fmt: skip
    return AttemptRead(evidence=evidence, problems=problems)


def _lines_of(texts: tuple[str, ...], taxonomy: Taxonomy, start: int, source: str) -> list[LogLine]:
    """The lines of a stream's tail that match a signature, as evidence lines (one a signature matched)."""
    from elastic_diag.core.log_lines import evidence_line, parse_line, signatures_of

    out = []
    for i, raw in enumerate(texts):
        parsed = parse_line(raw, local_time=True)
        text = parsed.text.strip()
        for sig in signatures_of(text, taxonomy):
            out.append(evidence_line(text, time=parsed.time, clock=parsed.clock, order=start + i, source=source,
                                     signature=sig.id))  # fmt: skip
    return out


def _rank_evidence(
    rank: int, rank_dir: Path | None, facts: dict[str, Any], node: str, tail_lines: int, taxonomy: Taxonomy,
    problems: list[str],
) -> RankEvidence:  # fmt: skip
    from elastic_diag.core.evidence import RankEvidence
    from elastic_diag.core.exceptions import exception_from_json
    from elastic_diag.core.progress import Progress, kernel_from_json
    from elastic_diag.core.stacks import parse_stack_dump
    from elastic_diag.core.values import as_count, as_int, as_seconds

    def num(key: str) -> float | None:
        return as_seconds(facts.get(key))

    if rank_dir is None:  # only what the launcher saw (and what an earlier report.json kept)
        problems.append(f"rank {rank}: no {rank_dir_name(rank)} folder: only what the launcher saw")
        tail = tuple(str(x) for x in facts.get("last_lines") or () if isinstance(x, str))
        stack = facts.get("stack")
        exc = facts.get("exception")
        return RankEvidence(
            rank=rank, local_rank=as_count(facts.get("local_rank")) or 0, node=str(facts.get("node") or node),
            pid=as_count(facts.get("pid")), exit_code=as_int(facts.get("exit_code")), exit_time=num("exit_time"),
            start_time=num("start_time"), alive_at_decision=facts.get("alive_at_decision") is True,
            stopped_by_agent=facts.get("stopped_by_agent") is True, kernel=kernel_from_json(facts.get("kernel")),
            stderr_tail=tail, lines=tuple(_lines_of(tail, taxonomy, 0, REPORT_FILE)),
            stack=parse_stack_dump(stack) if isinstance(stack, str) and stack else None,
            exception=exception_from_json({**exc, "traceback": ""}) if isinstance(exc, dict) else None,
            progress=Progress(progress_time=num("last_progress_time"), steps=as_count(facts.get("steps")))
            if facts.get("steps") is not None or facts.get("last_progress_time") is not None
            else None,
        )  # fmt: skip
    record, problem = read_flight_record(rank_dir, rank)
    if problem:
        problems.append(problem)
    worker = read_json(rank_dir / WORKER_FILE) or {}
    stack_text = ""
    offset = as_count(facts.get("stack_offset"))
    if offset is not None:
        stack_text = read_stack_since(rank_dir, offset)
    elif isinstance(facts.get("stack"), str):  # an older version's report.json kept the stack itself
        stack_text = facts["stack"]
    if not stack_text.strip() and facts.get("alive_at_decision") is not True:
        # under elastic-diag exec, the stack the rank wrote itself when its launcher's SIGTERM reached it (srun
        # and mpirun signal every process of a step at once, and may kill its watch before it asks)
        stack_text = read_stack_since(rank_dir, 0, TERM_STACKS_FILE)
    # the signatures are looked for further back than the tail shown: a cause printed just before a long
    # traceback (a DataLoader worker's "Unexpected segmentation fault encountered in worker." above the
    # ConnectionResetError its death caused in the main process) is the rank's own evidence
    window = read_tail(rank_dir / STDERR_FILE, max(tail_lines, MATCH_TAIL_LINES))
    stderr = window[-tail_lines:] if tail_lines > 0 else ()
    stdout = read_tail(rank_dir / STDOUT_FILE, STDOUT_TAIL_LINES)
    local = as_count(facts.get("local_rank"))
    return RankEvidence(
        rank=rank,
        local_rank=local if local is not None else as_count(worker.get("local_rank")) or 0,
        node=str(facts.get("node") or node),
        pid=as_count(facts.get("pid")) or as_count(worker.get("pid")),
        exit_code=as_int(facts.get("exit_code")),
        exit_time=num("exit_time"),
        start_time=as_seconds(worker.get("start_time")),
        alive_at_decision=facts.get("alive_at_decision") is True,
        stopped_by_agent=facts.get("stopped_by_agent") is True,
        exception=read_exception(rank_dir),
        stderr_tail=stderr,
        stdout_tail=stdout,
        lines=tuple(
            _lines_of(window, taxonomy, 0, STDERR_FILE) + _lines_of(stdout, taxonomy, len(window), STDOUT_FILE)
        ),
        stack=parse_stack_dump(stack_text) if stack_text else None,
        evidence_dir=str(rank_dir),
        flight_record=record,
        calls=read_calls(rank_dir),
        nonfinite=read_nonfinite(rank_dir),
        progress=read_progress(rank_dir / PROGRESS_FILE),
        error_line=read_error_line(rank_dir),
        thread_exception=read_thread_exception(rank_dir),
        kernel=kernel_from_json(facts.get("kernel")),
    )


def read_attempt(
    attempt_dir: Path, *, tail_lines: int | None = None, taxonomy: Taxonomy | None = None, only: set[int] | None = None,
    launcher_records: dict[int, dict[str, Any]] | None = None,
) -> AttemptRead:  # fmt: skip
    """An attempt's evidence folder as the core's evidence model: what the launcher saw (``launcher.json``)
    and every rank's own files, the stalls the health monitor recorded, the environment snapshot. The live
    agent judges what this returns; so does ``elastic-diag analyze`` pointed at the folder. A folder that is
    half there (a run killed mid-write, a copy missing files, an earlier version's) gives what is there and
    says what is missing in ``problems``; nothing raises. ``only``: these ranks (the live agent of one node reads
    its own ranks; the other nodes' agents write theirs into the same folder on a shared file system).
    ``launcher_records``: the live agent's launcher.json records, for the ranks whose file a full disk refused."""
    from elastic_diag.core.evidence import AttemptEvidence
    from elastic_diag.core.taxonomy import load_taxonomy
    from elastic_diag.core.values import as_count, as_seconds

    tax = taxonomy or load_taxonomy()
    problems: list[str] = []
    try:
        folders = {n: d for d in attempt_dir.iterdir() if (n := _number(d.name, "rank_")) is not None and d.is_dir()}
    except OSError as e:
        problems.append(f"{attempt_dir}: {e.strerror or e}")
        folders = {}
    if only is not None:
        folders = {r: d for r, d in folders.items() if r in only}
    attempt_facts, rank_facts = _launcher_facts(attempt_dir, folders, problems, launcher_records)
    if only is not None:
        rank_facts = {r: f for r, f in rank_facts.items() if r in only}
    node = str(attempt_facts.get("node") or "")
    lines = tail_lines or as_count(attempt_facts.get("tail_lines")) or DEFAULT_TAIL_LINES
    ranks = tuple(
        _rank_evidence(r, folders.get(r), rank_facts.get(r, {}), node, lines, tax, problems)
        for r in sorted(set(folders) | set(rank_facts))
    )
    came_up = None
    for ev in ranks:
        if ev.progress is not None:
            came_up = bool(came_up) or ev.progress.completed_a_collective() or bool(ev.flight_record and
                                                                                   ev.flight_record.groups)  # fmt: skip
    hang = attempt_facts.get("hang")
    evidence = AttemptEvidence(
        attempt=as_count(attempt_facts.get("attempt")) or _number(attempt_dir.name, "attempt_") or 0,
        ranks=ranks,
        run_id=str(attempt_facts.get("run_id") or ""),
        source="live" if rank_facts else "logs",
        decided_at=as_seconds(attempt_facts.get("decided_at")),
        hang=hang if isinstance(hang, dict) else None,
        came_up=came_up,
        stalls=read_stalls(attempt_dir),
    )
    return AttemptRead(evidence=evidence, problems=problems, environment=read_json(attempt_dir / ENVIRONMENT_FILE))


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
