"""Where a rank's evidence lives, and how it gets there.

:class:`DiagLogsSpecs` is a torchelastic ``LogsSpecs`` (registered as the ``diag`` entry point of
``torchrun.logs_specs``). On every attempt its ``reify`` lays out::

    <diag-dir>/attempt_<N>/rank_<global rank>/
        stdout.log  stderr.log   every byte the rank wrote, always kept
        error.json               torchelastic's error file (written by @record or our bootstrap)
        exception.json           the bootstrap's record of an uncaught exception (precise time)
        stacks.txt               faulthandler dumps taken on the dump signal or a dump request
        worker.json              pid and start time
        progress.json            the progress beacon the health monitor reads
        thread_exception.json    the first uncaught exception of another thread
        first_error.json         the first error of its own the rank printed, with when (the line clock)
        fr_trace.json            the flight recorder's entries (on a dump request, an exception, exit)
        nonfinite.json           the first non-finite loss the rank backpropagated
        pyspy.txt                native stacks (py-spy, when installed) taken on a hang alarm

and sets each rank's environment so the worker bootstrap (``elastic_diag/_boot``) loads with no
change to the script. The console still shows every rank's output, through torch's own tailer,
unless the user's ``--redirects`` / ``--local-ranks-filter`` asked to hide it.

The readers at the bottom turn a rank folder into :class:`~elastic_diag.evidence.RankEvidence`
pieces, reading only bounded tails: a rank that floods stderr costs disk, not agent memory.
"""

from __future__ import annotations

import json
import os
import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs, Std, to_map

from elastic_diag import beacon, bootstrap
from elastic_diag.error_lines import error_line_from_json
from elastic_diag.evidence import ErrorLine, ExceptionRecord, exception_from_json
from elastic_diag.flight_recorder import RankRecord, load_dump, parse_record
from elastic_diag.tailer import FIRST_ERROR_FILE

BOOT_DIR = str(Path(__file__).with_name("_boot"))
TAIL_BYTES = 64 * 1024
STACK_BYTES = 256 * 1024
FR_BYTES = beacon.FR_MAX_BYTES
# a rank folder reused (the same --diag-dir again) starts without the last run's records
STALE_FILES = (bootstrap.EXCEPTION_FILE, bootstrap.ERROR_FILE, bootstrap.STACKS_FILE, beacon.PROGRESS_FILE,
               beacon.FR_FILE, beacon.NONFINITE_FILE, beacon.DUMP_REQUEST_FILE, beacon.DUMP_DONE_FILE,
               "pyspy.txt", bootstrap.THREAD_EXCEPTION_FILE, FIRST_ERROR_FILE)  # fmt: skip


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


class DiagLogsSpecs(LogsSpecs):
    """LogsSpecs that always keeps every rank's stdout/stderr in the diag dir and shows them too."""

    def __init__(
        self,
        log_dir: str | None = None,
        redirects: Std | dict[int, Std] = Std.NONE,
        tee: Std | dict[int, Std] = Std.NONE,
        local_ranks_filter: set[int] | None = None,
        *,
        diag_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        super().__init__(log_dir, redirects, tee, local_ranks_filter)
        if diag_dir is None:
            from elastic_diag.config import default_diag_dir

            diag_dir = os.environ.get("ELASTIC_DIAG_DIR") or default_diag_dir()
        self.diag_dir = Path(diag_dir).absolute()
        self.attempts: dict[int, AttemptLayout] = {}
        self.current: AttemptLayout | None = None  # the layout of the attempt being started, if any
        self.errors: list[str] = []  # failures to lay out the evidence; drained by the agent
        self.extra_env: dict[str, str] = {}  # the restart gate's resume variables for the next attempt

    @classmethod
    def replacing(cls, old: object, diag_dir: str | os.PathLike[str]) -> DiagLogsSpecs:
        """Ours in place of the launch's own LogsSpecs, keeping its --log-dir, --redirects, --tee and
        --local-ranks-filter (for the console; every stream is kept on disk anyway)."""
        if isinstance(old, DiagLogsSpecs):
            return old
        return cls(
            log_dir=getattr(old, "_root_log_dir", None),
            redirects=getattr(old, "_redirects", None) or Std.NONE,
            tee=getattr(old, "_tee", None) or Std.NONE,
            local_ranks_filter=getattr(old, "_local_ranks_filter", None),
            diag_dir=diag_dir,
        )

    @property
    def root_log_dir(self) -> str:
        return str(self.diag_dir)

    def _on_console(self, local_rank: int, std: Std, redirs: dict[int, Std], tees: dict[int, Std]) -> bool:
        if self._local_ranks_filter and local_rank not in self._local_ranks_filter:
            return False
        return not (redirs[local_rank] & std) or bool(tees[local_rank] & std)

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        """Lay out the attempt's evidence; if that fails, run on as plain torchrun would (console only)."""
        self.current = None
        try:
            return self._reify(envs)
        except OSError as e:
            attempt = envs[0].get("TORCHELASTIC_RESTART_COUNT", "?") if envs else "?"
            self.errors.append(f"laying out the evidence of attempt {attempt} in {self.diag_dir}: {e}")
            return self._console_only(envs)

    def _console_only(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        dest = LogsDest(filtered_stdout=os.devnull, filtered_stderr=os.devnull)
        for local_rank, env in envs.items():
            dest.stdouts[local_rank] = ""  # "" is torch's "the console"
            dest.stderrs[local_rank] = ""
            dest.error_files[local_rank] = os.devnull
            env["TORCHELASTIC_ERROR_FILE"] = ""
        return dest

    def _reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        nprocs = len(envs)
        first = envs[0] if nprocs else {}
        attempt = int(first.get("TORCHELASTIC_RESTART_COUNT", "0"))
        attempt_dir = self.diag_dir / f"attempt_{attempt}"
        attempt_dir.mkdir(parents=True, exist_ok=True)
        layout = AttemptLayout(attempt=attempt, dir=attempt_dir)

        redirs = to_map(self._redirects, nprocs)
        tees = to_map(self._tee, nprocs)
        dest = LogsDest(
            filtered_stdout=str(attempt_dir / "filtered_stdout.log"),
            filtered_stderr=str(attempt_dir / "filtered_stderr.log"),
        )
        python_path = os.environ.get("PYTHONPATH", "")
        for local_rank in range(nprocs):
            env = envs[local_rank]
            rank = int(env.get("RANK", local_rank))
            rank_dir = attempt_dir / f"rank_{rank}"
            rank_dir.mkdir(parents=True, exist_ok=True)
            for stale in STALE_FILES:
                (rank_dir / stale).unlink(missing_ok=True)
            layout.ranks[local_rank] = RankLayout(rank=rank, local_rank=local_rank, dir=rank_dir)

            dest.stdouts[local_rank] = str(rank_dir / bootstrap.STDOUT_FILE)
            dest.stderrs[local_rank] = str(rank_dir / bootstrap.STDERR_FILE)
            if self._on_console(local_rank, Std.OUT, redirs, tees):
                dest.tee_stdouts[local_rank] = dest.stdouts[local_rank]
            if self._on_console(local_rank, Std.ERR, redirs, tees):
                dest.tee_stderrs[local_rank] = dest.stderrs[local_rank]
            error_file = str(rank_dir / bootstrap.ERROR_FILE)
            dest.error_files[local_rank] = error_file

            env["TORCHELASTIC_ERROR_FILE"] = error_file
            for key, value in flight_recorder_env(rank_dir).items():
                env.setdefault(key, os.environ.get(key, value))
            env[bootstrap.ENV_RANK_DIR] = str(rank_dir)
            env["ELASTIC_DIAG_ATTEMPT"] = str(attempt)
            env.update(self.extra_env)
            env[bootstrap.ENV_BOOT_PATH] = BOOT_DIR
            env["PYTHONPATH"] = os.pathsep.join(p for p in (BOOT_DIR, env.get("PYTHONPATH", python_path)) if p)
        self.attempts[attempt] = layout
        self.current = layout
        return dest

    def __repr__(self) -> str:
        return f"DiagLogsSpecs(diag_dir={str(self.diag_dir)!r}, redirects={self._redirects}, tee={self._tee})"


def flight_recorder_env(rank_dir: Path) -> dict[str, str]:
    """The flight recorder on, for gloo (on by default in torch 2.13) and NCCL, NCCL's own dump on a
    watchdog timeout into the rank's folder (``nccl_trace_rank_<rank>``). A value the user set wins."""
    return {
        "TORCH_FR_BUFFER_SIZE": "2000",  # the old name TORCH_NCCL_TRACE_BUFFER_SIZE warns in every rank (2.13)
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(rank_dir / "nccl_trace_rank_"),
    }


# --- readers: bounded, never raise on a missing or garbled file ---------------------------------


def read_tail(path: Path, max_lines: int, max_bytes: int = TAIL_BYTES) -> tuple[str, ...]:
    """The last ``max_lines`` lines of a text file, reading at most ``max_bytes`` from its end."""
    try:
        with open(path, "rb") as fp:
            fp.seek(0, os.SEEK_END)
            size = fp.tell()
            start = max(0, size - max_bytes)
            fp.seek(start)
            data = fp.read(max_bytes)
    except OSError:
        return ()
    text = data.decode("utf-8", errors="replace")
    lines = text.splitlines()
    if start > 0 and lines:
        lines = lines[1:]  # the first line was cut by the window
    return tuple(line[:4000] for line in lines[-max_lines:])


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as fp:
            data = json.load(fp)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def read_exception(rank_dir: Path) -> ExceptionRecord | None:
    """The uncaught exception of a rank: the bootstrap's record, else torchelastic's error file."""
    record = exception_from_json(read_json(rank_dir / bootstrap.EXCEPTION_FILE))
    if record is not None:
        return record
    err = read_json(rank_dir / bootstrap.ERROR_FILE)
    msg = err.get("message") if err else None
    if isinstance(msg, dict) and isinstance(msg.get("message"), str):
        first = msg["message"]
        etype, _, text = first.partition(": ")
        extra = msg.get("extraInfo") or {}
        ts = extra.get("timestamp")
        return ExceptionRecord(
            type=etype or "Exception",
            message=text,
            traceback=str(extra.get("py_callstack", ""))[:100_000],
            time=float(ts) if isinstance(ts, str) and ts.isdigit() else None,
        )
    return None


def read_thread_exception(rank_dir: Path) -> ExceptionRecord | None:
    return exception_from_json(read_json(rank_dir / bootstrap.THREAD_EXCEPTION_FILE))


def read_error_line(rank_dir: Path) -> ErrorLine | None:
    """The first own error the launcher's line clock saw (first_error.json)."""
    return error_line_from_json(read_json(rank_dir / FIRST_ERROR_FILE))


def stack_file_size(rank_dir: Path) -> int:
    try:
        return (rank_dir / bootstrap.STACKS_FILE).stat().st_size
    except OSError:
        return 0


def read_stack_since(rank_dir: Path, offset: int) -> str:
    try:
        with open(rank_dir / bootstrap.STACKS_FILE, "rb") as fp:
            fp.seek(offset)
            return fp.read(STACK_BYTES).decode("utf-8", errors="replace")
    except OSError:
        return ""


def read_flight_record(rank_dir: Path, rank: int) -> tuple[RankRecord | None, str | None]:
    """The rank's flight-recorder dump (``fr_trace.json``) and, when it cannot be used, why."""
    path = rank_dir / beacon.FR_FILE
    if not path.exists():  # NCCL's own dump on a watchdog timeout (a pickle), when ours is absent
        path = next(iter(sorted(rank_dir.glob("nccl_trace_rank_*"))), path)
    try:
        size = path.stat().st_size
        if size > FR_BYTES:
            return None, f"rank {rank}: flight-recorder dump of {size} bytes is over the {FR_BYTES}-byte limit"
        raw = path.read_bytes()
    except FileNotFoundError:
        return None, None
    except OSError as e:
        return None, f"rank {rank}: flight-recorder dump unreadable ({e.strerror or e})"
    try:
        return parse_record(rank, load_dump(raw)), None
    except (ValueError, pickle.UnpicklingError, EOFError, TypeError, KeyError) as e:
        return None, f"rank {rank}: flight-recorder dump not usable ({e})"
