"""Worker-side bootstrap: evidence a rank records about itself, with no change to the user's script.

The launcher puts ``elastic_diag/worker/_boot`` first on each worker's ``PYTHONPATH``; its
``sitecustomize`` calls :func:`install` when ``ELASTIC_DIAG_RANK_DIR`` is set, then chains to any
``sitecustomize`` the environment already had. :func:`install`:

* enables :mod:`faulthandler` for fatal signals (SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT) into the
  rank's stderr, which the launcher keeps on disk;
* registers a stack dump of all threads on :data:`DUMP_SIGNAL` (SIGURG, whose default action is
  *ignore*, so a rank that is already finalizing is not killed by it). faulthandler writes from C,
  so the dump works while the main thread is blocked inside a C++ collective;
* wraps :data:`sys.excepthook` to record the exception type, its class's bases (so a numpy
  ``_ArrayMemoryError`` is known for a ``MemoryError``), the exceptions it was raised while handling,
  message, traceback and a sub-millisecond timestamp in ``exception.json``, and the torchelastic
  error file when the script has no ``@record`` of its own; an exception whose ``__str__`` raises,
  or whose message is megabytes long, is recorded with what can be said of it;
* wraps :data:`threading.excepthook` to record the first uncaught exception of another thread in
  ``thread_exception.json`` (a prefetch thread that dies leaves its main thread waiting forever);
* starts the progress beacon (:mod:`elastic_diag.worker.beacon`) that the agent's health monitor reads,
  and writes the flight recorder's entries when the rank dies of an exception or exits;
* masks secrets in what the rank prints through ``sys.stdout`` / ``sys.stderr``
  (:class:`elastic_diag.redaction.RedactingStream`);
* asks the kernel for a SIGTERM when the launcher dies (``prctl(PR_SET_PDEATHSIG)``, Linux): a rank whose
  launcher was SIGKILLed (the OOM killer, a scheduler) does not wait forever on peers that are gone;
* puts the rank's ``sys.stdout`` and ``sys.stderr`` (files in the rank's folder) behind
  :class:`DiskFullGuard`: on a full disk a print is dropped and counted, never raised into the script
  (under plain torchrun it would have gone to the console and the job would not have noticed);
* removes its own variables from the environment, so that subprocesses of the rank do not write
  into the rank's evidence.

This module imports only the standard library: it runs before the user's script, on every rank.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import faulthandler
import io
import os
import signal
import stat
import sys
import threading
import time
import traceback
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from elastic_diag import redaction
from elastic_diag.layout import (
    ENV_BOOT_PATH,
    ENV_LAUNCHER_PID,
    ENV_NO_TORCH_HOOKS,
    ENV_RANK_DIR,
    ENV_STACK_ON_TERM,
    EXCEPTION_FILE,
    PRIVATE_FILE_MODE,
    STACKS_FILE,
    TERM_STACKS_FILE,
    THREAD_EXCEPTION_FILE,
    WORKER_FILE,
    make_private_dir,
    write_json_atomic,
)
from elastic_diag.worker import beacon, calls

DUMP_SIGNAL = signal.SIGURG
ORPHAN_SIGNAL = signal.SIGTERM  # what an orphan rank gets: its own handler (a checkpoint on SIGTERM) still runs
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

MESSAGE_LIMIT = 64 * 1024  # characters of an exception's message kept (a 1 MB message is cut, and says so)
TRACEBACK_LIMIT = 256 * 1024
CHAIN_LIMIT = 8

_state: dict[str, Any] = {}


def exception_type_name(etype: type[BaseException]) -> str:
    """The exception's name as Python prints it on the last traceback line."""
    module = etype.__module__
    if module in ("builtins", "__main__"):
        return etype.__qualname__
    return f"{module}.{etype.__qualname__}"


def _write_json(path: str, data: dict[str, Any]) -> None:
    write_json_atomic(Path(path), data, indent=None)  # masked: a token in argv or a message never reaches the disk


def _now() -> float:
    """Wall clock, plus ELASTIC_DIAG_CLOCK_SKEW (a test hook that shifts a whole host's clock)."""
    try:
        return time.time() + float(os.environ.get("ELASTIC_DIAG_CLOCK_SKEW", "") or 0.0)
    except ValueError:
        return time.time()


def _excepthook(etype: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
    now = _now()
    try:
        if os.getpid() == _state.get("pid"):
            record_exception(etype, value, tb, now)
    except BaseException:  # never let the evidence hide the user's own traceback (a signal mid-hook included)
        pass
    try:
        b = beacon.current()
        if b is not None and os.getpid() == _state.get("pid"):
            b.at_exit("exception")
    except BaseException:
        pass
    previous = _state.get("previous_excepthook") or sys.__excepthook__
    previous(etype, value, tb)


def _thread_excepthook(args: threading.ExceptHookArgs) -> None:
    now = _now()
    try:
        if os.getpid() == _state.get("pid") and args.exc_type is not SystemExit and not _state.get("thread_recorded"):
            _state["thread_recorded"] = True
            record = exception_record(args.exc_type, args.exc_value, args.exc_traceback, now)
            record["thread"] = args.thread.name if args.thread is not None else None
            _write_json(os.path.join(_state["rank_dir"], THREAD_EXCEPTION_FILE), record)
    except BaseException:
        pass
    previous = _state.get("previous_thread_excepthook") or threading.__excepthook__
    previous(args)


def _text(fn: Any, what: str, problems: list[str]) -> str:
    """``fn()`` as text; what could be said when it raised (a ``__str__`` that raises)."""
    try:
        return str(fn())
    except BaseException as e:  # any user code may run here
        problems.append(f"{what} raised {type(e).__name__}")
        return f"<{what} raised {type(e).__name__}>"


def _chain(value: BaseException | None) -> list[list[str]]:
    """The exceptions ``value`` was raised while handling or from, oldest first."""
    out: list[list[str]] = []
    seen = {id(value)}
    cur = _before(value) if value is not None else None
    while cur is not None and id(cur) not in seen and len(out) < CHAIN_LIMIT:
        seen.add(id(cur))
        out.append([exception_type_name(type(cur)), _text(lambda c=cur: c, "str()", [])[:2000]])
        cur = _before(cur)
    return out[::-1]


def _before(e: BaseException) -> BaseException | None:
    """The exception ``e`` was raised from or while handling (``raise ... from None`` hides it)."""
    if e.__cause__ is not None:
        return e.__cause__
    return None if e.__suppress_context__ else e.__context__


def exception_record(
    etype: type[BaseException], value: BaseException | None, tb: TracebackType | None, now: float
) -> dict[str, Any]:
    """What exception.json holds: bounded, and written even when the exception resists printing."""
    problems: list[str] = []
    message = _text(lambda: value, "str()", problems) if value is not None else ""
    if len(message) > MESSAGE_LIMIT:
        problems.append(f"message of {len(message)} characters cut to {MESSAGE_LIMIT}")
        message = message[:MESSAGE_LIMIT]
    formatted = _text(lambda: "".join(traceback.format_exception(etype, value, tb)), "the traceback", problems)
    if len(formatted) > TRACEBACK_LIMIT:
        formatted = formatted[: TRACEBACK_LIMIT // 2] + "\n[... cut ...]\n" + formatted[-TRACEBACK_LIMIT // 2 :]
    try:
        mro = [exception_type_name(c) for c in etype.__mro__ if issubclass(c, BaseException)]
    except BaseException:
        mro = []
    try:
        chain = _chain(value)
    except BaseException:
        chain = []
    return {"type": exception_type_name(etype), "message": message, "traceback": formatted, "time": now,
            "pid": os.getpid(), "mro": mro, "chain": chain, "problems": problems}  # fmt: skip


def record_exception(etype: type[BaseException], value: BaseException, tb: TracebackType | None, now: float) -> None:
    rank_dir = _state["rank_dir"]
    record = exception_record(etype, value, tb, now)
    _write_json(os.path.join(rank_dir, EXCEPTION_FILE), record)
    name, message, formatted = record["type"], record["message"], record["traceback"]
    error_file = _state.get("error_file")
    if error_file and not os.path.exists(error_file):
        # The same shape torch's @record writes, so torchrun's own summary shows the traceback.
        _write_json(
            error_file,
            {
                "message": {
                    "message": f"{name}: {message[:4000]}",
                    "extraInfo": {"py_callstack": formatted, "timestamp": str(int(now))},
                }
            },
        )


def _drop_boot_path_from_env() -> None:
    boot = os.environ.pop(ENV_BOOT_PATH, None)
    if not boot:
        return
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != boot]
    if parts:
        os.environ["PYTHONPATH"] = os.pathsep.join(parts)
    else:
        os.environ.pop("PYTHONPATH", None)


DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class DiskFullGuard(io.RawIOBase):
    """A rank's stream file as the script's ``sys.stdout`` / ``sys.stderr`` write it: bytes the disk refuses
    (full, over quota) are dropped and counted instead of raising ``OSError`` in the user's ``print`` (or
    turning a clean exit into 120 when the interpreter's last flush fails). Once the disk takes bytes again, a
    line says how many were lost. Any other error is raised as before."""

    def __init__(self, fd: int) -> None:
        super().__init__()
        self._fd = fd
        self.lost = 0

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd

    def isatty(self) -> bool:
        return False  # a regular file (only those are guarded)

    def write(self, data: Any) -> int:
        size = len(memoryview(data).cast("B"))
        try:
            if self.lost:
                os.write(self._fd, f"\n[elastic_diag: {self.lost} bytes of this stream were lost: the disk was "
                                   "full]\n".encode())  # fmt: skip
                self.lost = 0
            return os.write(self._fd, data)
        except OSError as e:
            if e.errno not in DISK_FULL:
                raise
            self.lost += size
            return size


def guard_stream(name: str) -> bool:
    """``sys.<name>`` behind a :class:`DiskFullGuard` when it writes to a regular file (the launcher's
    redirect into the rank's folder), with the same encoding, errors and buffering; False: left as it was."""
    old = getattr(sys, name, None)
    if not isinstance(old, io.TextIOWrapper):
        return False
    try:
        fd = old.fileno()
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        old.flush()
    except (OSError, ValueError):
        return False
    raw = DiskFullGuard(fd)
    # python -u (torchrun's default) writes unbuffered bytes
    binary: Any = io.BufferedWriter(raw) if isinstance(old.buffer, io.BufferedWriter) else raw
    stream = io.TextIOWrapper(binary, encoding=old.encoding, errors=old.errors, line_buffering=old.line_buffering,
                              write_through=old.write_through)  # fmt: skip
    _state.setdefault("streams", []).append(old)  # the original stays open: it owns the descriptor
    setattr(sys, name, stream)
    return True


def exit_with_launcher(launcher_pid: str | None) -> bool:
    """Have the kernel send :data:`ORPHAN_SIGNAL` to this rank when the process that started it dies (torch's
    agent, the launcher). The signal is sent only for a death after the call: a launcher already gone
    (``launcher_pid`` no longer alive, and no longer our parent) gets the rank the same signal now. False
    where the kernel has no such call (not Linux). A rank started by a wrapper (``--no-python bash run.sh``)
    follows its wrapper."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes  # 2 ms, Linux only

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(ORPHAN_SIGNAL), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if launcher_pid and launcher_pid.isdigit() and os.getppid() != int(launcher_pid):
        try:
            os.kill(int(launcher_pid), 0)
        except ProcessLookupError:  # it died between starting us and the call above
            os.kill(os.getpid(), ORPHAN_SIGNAL)
        except OSError:
            pass
    return True


def install(rank_dir: str, cpu_at_start: float | None = None) -> None:
    """Install the hooks for this rank; idempotent, and silent on failure (the job comes first).
    ``cpu_at_start``: the process's CPU time when the bootstrap began (worker.json says what it cost)."""
    if _state:
        return
    make_private_dir(Path(rank_dir))
    _state.update(
        pid=os.getpid(),
        rank_dir=rank_dir,
        error_file=os.environ.get("TORCHELASTIC_ERROR_FILE"),
        previous_excepthook=sys.excepthook,
        previous_thread_excepthook=threading.excepthook,
    )
    os.environ.pop(ENV_RANK_DIR, None)
    launcher_pid = os.environ.pop(ENV_LAUNCHER_PID, None)
    _drop_boot_path_from_env()
    if launcher_pid is not None:  # started by our launcher (not a bootstrap installed by hand)
        exit_with_launcher(launcher_pid)

    if launcher_pid is not None:
        guard_stream("stdout")
        guard_stream("stderr")
    faulthandler.enable(file=sys.stderr, all_threads=True)
    mask_streams()
    stacks_path = os.path.join(rank_dir, STACKS_FILE)
    # kept open for life; 0600 whatever the umask, as every file of the folder
    stacks: IO[str] = open(os.open(stacks_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, PRIVATE_FILE_MODE), "a")  # noqa: SIM115
    os.fchmod(stacks.fileno(), PRIVATE_FILE_MODE)
    _state["stacks_file"] = stacks
    faulthandler.register(DUMP_SIGNAL, file=stacks, all_threads=True, chain=False)
    if os.environ.pop(ENV_STACK_ON_TERM, "") == "1":  # elastic-diag exec: srun / mpirun stop a step with SIGTERM
        term_path = os.path.join(rank_dir, TERM_STACKS_FILE)
        term: IO[str] = open(os.open(term_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, PRIVATE_FILE_MODE), "a")  # noqa: SIM115
        _state["term_file"] = term
        # from C, then the signal's previous action (the default: the rank ends by SIGTERM as before); a handler
        # the script installs later replaces this one
        faulthandler.register(signal.SIGTERM, file=term, all_threads=True, chain=True)
    sys.excepthook = _excepthook
    threading.excepthook = _thread_excepthook
    b = beacon.start(rank_dir, stacks)
    if os.environ.get(ENV_NO_TORCH_HOOKS, "") in ("", "0"):
        calls.install_on_import()  # roots and peers of the collective calls, from the script's first call
    atexit.register(_at_exit, b)
    _write_json(
        os.path.join(rank_dir, WORKER_FILE),
        {
            "pid": os.getpid(),
            "start_time": _now(),
            "argv": redaction.redact_argv(sys.argv),
            "executable": sys.executable,
            # the bootstrap's own cost, its imports included (benchmarks/launcher.py phases reads it)
            "bootstrap_cpu_s": round(time.process_time() - cpu_at_start, 4) if cpu_at_start is not None else None,
        },
    )


def mask_streams() -> None:
    """The rank's stdout and stderr mask secrets as they are written (the job's own secret values and
    secrets of a known shape: :mod:`elastic_diag.redaction`), so that none reaches the stream files
    even when the launcher is killed before it masks them on exit."""
    redactor = redaction.current()
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, redaction.RedactingStream):
            setattr(sys, name, redaction.RedactingStream(stream, redactor))


def _at_exit(b: beacon.Beacon) -> None:
    if os.getpid() == _state.get("pid"):
        b.stop.set()
        with contextlib.suppress(Exception):
            b.at_exit("exit")
        b.close_wake()


def install_from_env(cpu_at_start: float | None = None) -> None:
    """The rank's hooks when the launcher named its folder (``ELASTIC_DIAG_RANK_DIR``)."""
    rank_dir = os.environ.get(ENV_RANK_DIR)
    if not rank_dir:
        return
    try:
        install(rank_dir, cpu_at_start)
    except Exception as e:  # report, never break the worker
        print(f"elastic_diag: worker bootstrap failed, rank evidence will be partial: {e!r}", file=sys.stderr)
