"""Worker-side bootstrap: evidence a rank records about itself, with no change to the user's script.

The launcher puts ``elastic_diag/_boot`` first on each worker's ``PYTHONPATH``; its
``sitecustomize`` calls :func:`install` when ``ELASTIC_DIAG_RANK_DIR`` is set, then chains to any
``sitecustomize`` the environment already had. :func:`install`:

* enables :mod:`faulthandler` for fatal signals (SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT) into the
  rank's stderr, which the launcher keeps on disk;
* registers a stack dump of all threads on :data:`DUMP_SIGNAL` (SIGURG, whose default action is
  *ignore*, so a rank that is already finalizing is not killed by it). faulthandler writes from C,
  so the dump works while the main thread is blocked inside a C++ collective;
* wraps :data:`sys.excepthook` to record the exception type, message, traceback and a
  sub-millisecond timestamp in ``exception.json``, and the torchelastic error file when the script
  has no ``@record`` of its own;
* starts the progress beacon (:mod:`elastic_diag.beacon`) that the agent's health monitor reads,
  and writes the flight recorder's entries when the rank dies of an exception or exits;
* removes its own variables from the environment, so that subprocesses of the rank do not write
  into the rank's evidence.

This module imports only the standard library: it runs before the user's script, on every rank.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import json
import os
import signal
import sys
import time
import traceback
from types import TracebackType
from typing import IO, Any

from elastic_diag import beacon

ENV_RANK_DIR = "ELASTIC_DIAG_RANK_DIR"
ENV_BOOT_PATH = "ELASTIC_DIAG_BOOT_PATH"
DUMP_SIGNAL = signal.SIGURG

STDOUT_FILE = "stdout.log"
STDERR_FILE = "stderr.log"
ERROR_FILE = "error.json"  # torchelastic's own error-file format
EXCEPTION_FILE = "exception.json"  # ours: precise time, type, message, traceback
STACKS_FILE = "stacks.txt"  # faulthandler dumps taken on DUMP_SIGNAL
WORKER_FILE = "worker.json"  # pid and start time

_state: dict[str, Any] = {}


def exception_type_name(etype: type[BaseException]) -> str:
    """The exception's name as Python prints it on the last traceback line."""
    module = etype.__module__
    if module in ("builtins", "__main__"):
        return etype.__qualname__
    return f"{module}.{etype.__qualname__}"


def _write_json(path: str, data: dict[str, Any]) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as fp:
        json.dump(data, fp)
    os.replace(tmp, path)


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
            _record_exception(etype, value, tb, now)
    except Exception:  # never let the evidence hide the user's own traceback
        pass
    try:
        b = beacon.current()
        if b is not None and os.getpid() == _state.get("pid"):
            b.at_exit("exception")
    except Exception:
        pass
    previous = _state.get("previous_excepthook") or sys.__excepthook__
    previous(etype, value, tb)


def _record_exception(etype: type[BaseException], value: BaseException, tb: TracebackType | None, now: float) -> None:
    rank_dir = _state["rank_dir"]
    formatted = "".join(traceback.format_exception(etype, value, tb))
    name = exception_type_name(etype)
    message = str(value)
    _write_json(
        os.path.join(rank_dir, EXCEPTION_FILE),
        {"type": name, "message": message, "traceback": formatted, "time": now, "pid": os.getpid()},
    )
    error_file = _state.get("error_file")
    if error_file and not os.path.exists(error_file):
        # The same shape torch's @record writes, so torchrun's own summary shows the traceback.
        _write_json(
            error_file,
            {
                "message": {
                    "message": f"{name}: {message}",
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


def install(rank_dir: str) -> None:
    """Install the hooks for this rank; idempotent, and silent on failure (the job comes first)."""
    if _state:
        return
    os.makedirs(rank_dir, exist_ok=True)
    _state.update(
        pid=os.getpid(),
        rank_dir=rank_dir,
        error_file=os.environ.get("TORCHELASTIC_ERROR_FILE"),
        previous_excepthook=sys.excepthook,
    )
    os.environ.pop(ENV_RANK_DIR, None)
    _drop_boot_path_from_env()

    faulthandler.enable(file=sys.stderr, all_threads=True)
    stacks: IO[str] = open(os.path.join(rank_dir, STACKS_FILE), "a")  # noqa: SIM115 - kept open for life
    _state["stacks_file"] = stacks
    faulthandler.register(DUMP_SIGNAL, file=stacks, all_threads=True, chain=False)
    sys.excepthook = _excepthook
    b = beacon.start(rank_dir, stacks)
    atexit.register(_at_exit, b)
    _write_json(
        os.path.join(rank_dir, WORKER_FILE),
        {"pid": os.getpid(), "start_time": _now(), "argv": sys.argv, "executable": sys.executable},
    )


def _at_exit(b: beacon.Beacon) -> None:
    if os.getpid() == _state.get("pid"):
        b.stop.set()
        with contextlib.suppress(Exception):
            b.at_exit("exit")


def install_from_env() -> None:
    rank_dir = os.environ.get(ENV_RANK_DIR)
    if not rank_dir:
        return
    try:
        install(rank_dir)
    except Exception as e:  # report, never break the worker
        print(f"elastic_diag: worker bootstrap failed, rank evidence will be partial: {e!r}", file=sys.stderr)
