"""Ranks that a command started by ``elastic-diag exec`` spawns itself (``torch.multiprocessing.spawn``,
``multiprocessing``, a script that starts its own workers).

With no rank in its environment, ``elastic-diag exec -- python train.py`` watches the command as the parent
of its ranks: it sets ``ELASTIC_DIAG_SPAWN_DIR`` (the attempt folder) and the bootstrap's path, so every
Python process of the tree runs :func:`install`, which

* wraps ``init_process_group``: a process that joins a group becomes rank R (the rank it passed, or took
  from the variables it set), claims ``rank_<R>/`` (:func:`elastic_diag.layout.claim_rank_dir`), writes
  ``joined.json`` (pid, rank, world size, spawn index, host), sends its stdout and stderr (the descriptors:
  C++ lines too) to the folder's ``stdout.log`` / ``stderr.log`` (the watch copies them to its console), and
  installs the rank's evidence as under ``torchrun-diag`` (exception records, stacks on a signal, the
  progress beacon, the flight recorder): :func:`elastic_diag.worker.bootstrap.install`;
* wraps ``torch.multiprocessing.spawn._wrap``: torch catches a child's exception there and only pickles its
  text to the parent, so the excepthook never sees it; the wrapper records it first (in the rank's folder;
  a child that failed before joining any group is recorded under its spawn index, and says so);
* wraps ``multiprocessing.Process.run`` the same way for plain ``multiprocessing`` children;
* records, in the process that reaps them, how each child process ended
  (``multiprocessing.popen_fork.Popen.poll``: ``exits/<pid>.json``, exit code or signal, and whether this
  process had sent it SIGTERM / SIGKILL itself: torch's ``ProcessContext.join`` stops the other children
  after the first one fails, so those are collateral).

The ``forkserver`` start method reaps its children elsewhere: their exits are not recorded (the verdict
says the exit is unknown). Standard library only; every hook is silent on failure (the job comes first).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import time
from pathlib import Path
from typing import Any

from elastic_diag.config import host_name
from elastic_diag.layout import (
    EXITS_DIR,
    JOINED_FILE,
    PRIVATE_FILE_MODE,
    STACKS_FILE,
    STDERR_FILE,
    STDOUT_FILE,
    claim_rank_dir,
    write_json_atomic,
)
from elastic_diag.worker import imports

_state: dict[str, Any] = {}
_signalled: dict[int, int] = {}  # pid -> the signal this process sent it (terminate / kill)
_stack_offsets: dict[int, int] = {}  # pid -> where the stack taken before stopping it begins in its stacks.txt
STACK_WAIT_S = 1.5  # all ranks together: what the stacks taken before the teardown may cost


def install(attempt_dir: str) -> None:
    """The hooks of a process in the tree of a command watched as the parent of its ranks."""
    if _state:
        return
    _state.update(attempt_dir=Path(attempt_dir), pid=os.getpid(), rank=None, spawn_index=None)
    from elastic_diag.worker import bootstrap

    bootstrap.mask_streams()
    _hook_multiprocessing()
    imports.when_imported("torch.distributed.distributed_c10d", _wrap_init_process_group)
    imports.when_imported("torch.multiprocessing.spawn", _wrap_spawn)


def joined_rank() -> int | None:
    return _state.get("rank") if _state.get("pid") == os.getpid() else None


# --- becoming a rank -------------------------------------------------------------------------------------


def _wrap_init_process_group(module: Any) -> None:
    original = getattr(module, "init_process_group", None)
    if original is None or getattr(original, "__elastic_diag__", False):
        return

    @functools.wraps(original)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        with contextlib.suppress(Exception):
            _joined(int(module.get_rank()), int(module.get_world_size()), "init_process_group")
        return result

    init_process_group.__elastic_diag__ = True  # type: ignore[attr-defined]
    module.init_process_group = init_process_group
    dist = sys.modules.get("torch.distributed")
    if dist is not None and getattr(dist, "init_process_group", None) is original:
        setattr(dist, "init_process_group", init_process_group)  # noqa: B010 - the package re-exports it


def _joined(rank: int, world_size: int | None, how: str) -> Path | None:
    """This process is rank ``rank``: its folder, its streams there, the rank's evidence installed."""
    if _state.get("pid") != os.getpid():  # a fork of a process that had installed: start afresh
        _state.update(pid=os.getpid(), rank=None)
    if _state.get("rank") is not None or rank < 0:
        return None
    from elastic_diag.worker import bootstrap

    attempt_dir: Path = _state["attempt_dir"]
    host = host_name()
    folder, claimed = claim_rank_dir(attempt_dir, rank, host)
    _state["rank"] = rank
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    for fd, name in ((1, STDOUT_FILE), (2, STDERR_FILE)):
        with contextlib.suppress(OSError):
            target = os.open(folder / name, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, PRIVATE_FILE_MODE)
            os.dup2(target, fd)  # the copy at 1 / 2 is inheritable: the rank's own subprocesses write there too
            os.close(target)
    write_json_atomic(folder / JOINED_FILE, {
        "pid": os.getpid(), "ppid": os.getppid(), "rank": rank, "world_size": world_size, "how": how,
        "spawn_index": _state.get("spawn_index"), "local_rank": _local_rank(), "host": host, "time": time.time(),
        "claimed_by": claimed,
    }, indent=None)  # fmt: skip
    bootstrap.install(str(folder))
    return folder


def _local_rank() -> int | None:
    raw = os.environ.get("LOCAL_RANK", "")
    if raw.isdigit():
        return int(raw)
    index = _state.get("spawn_index")
    return index if isinstance(index, int) else None


# --- a child's exception, before its wrapper swallows it -------------------------------------------------


def _record_failure(etype: type[BaseException], value: BaseException, tb: Any) -> None:
    from elastic_diag.worker import beacon, bootstrap

    now = time.time()
    if joined_rank() is None:
        index = _state.get("spawn_index")
        if not isinstance(index, int) or _joined(index, None, "spawn index (no process group joined)") is None:
            return
    bootstrap.record_exception(etype, value, tb, now)
    b = beacon.current()
    if b is not None:
        b.at_exit("exception")


def _recording(fn: Any) -> Any:
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception:
            with contextlib.suppress(BaseException):
                _record_failure(*sys.exc_info())
            raise

    return run


def _wrap_spawn(module: Any) -> None:
    original = getattr(module, "_wrap", None)
    if original is None or getattr(original, "__elastic_diag__", False):
        return

    def _wrap(fn: Any, i: int, args: Any, error_file: Any) -> Any:
        _state["spawn_index"] = i
        return original(_recording(fn), i, args, error_file)

    _wrap.__elastic_diag__ = True  # type: ignore[attr-defined]
    # pickled by reference by the spawn start method: the child finds this one under the same name
    _wrap.__module__, _wrap.__qualname__, _wrap.__name__ = original.__module__, original.__qualname__, original.__name__
    module._wrap = _wrap


# --- how each child ended, in the process that reaps it ---------------------------------------------------


def _hook_multiprocessing() -> None:
    import multiprocessing.popen_fork as popen_fork
    import multiprocessing.process as process

    popen = popen_fork.Popen
    if getattr(popen.poll, "__elastic_diag__", False):
        return
    poll, terminate, kill = popen.poll, popen.terminate, popen.kill
    run = process.BaseProcess.run

    def poll_(self: Any, flag: int = os.WNOHANG) -> Any:
        before = self.returncode
        code = poll(self, flag)
        if before is None and code is not None:
            with contextlib.suppress(Exception):
                _record_exit(self.pid, code)
        return code

    def terminate_(self: Any) -> None:
        with contextlib.suppress(Exception):
            _stacks_before_stopping()
        _signalled.setdefault(self.pid, 15)
        terminate(self)

    def kill_(self: Any) -> None:
        with contextlib.suppress(Exception):
            _stacks_before_stopping()
        _signalled.setdefault(self.pid, 9)
        kill(self)

    def run_(self: Any) -> None:
        _recording(run)(self)

    for fn in (poll_, terminate_, kill_, run_):
        setattr(fn, "__elastic_diag__", True)  # noqa: B010
    popen.poll, popen.terminate, popen.kill = poll_, terminate_, kill_  # type: ignore[method-assign]
    process.BaseProcess.run = run_  # type: ignore[method-assign]


def _record_exit(pid: int, code: int) -> None:
    attempt_dir: Path = _state["attempt_dir"]
    write_json_atomic(attempt_dir / EXITS_DIR / f"{pid}.json", {
        "pid": pid, "exit_code": code, "time": time.time(), "signalled_by_parent": _signalled.get(pid),
        "parent_pid": os.getpid(), "stack_offset": _stack_offsets.get(pid),
    }, indent=None)  # fmt: skip


def _stacks_before_stopping() -> None:
    """Before this process stops its first child (torch's ``ProcessContext.join`` after a failure): the stacks
    of every live rank among its children, as ``torchrun-diag``'s agent takes them before a teardown (a rank
    stuck outside the collective its peers timed out in shows where). Once; at most :data:`STACK_WAIT_S`."""
    if _state.get("stacks_taken"):
        return
    _state["stacks_taken"] = True
    from elastic_diag.layout import read_json
    from elastic_diag.worker.bootstrap import DUMP_SIGNAL

    me = os.getpid()
    before: dict[int, tuple[Path, int]] = {}
    for path in Path(_state["attempt_dir"]).glob(f"rank_*/{JOINED_FILE}"):
        record = read_json(path)
        pid = record.get("pid") if isinstance(record, dict) else None
        if isinstance(pid, int) and _parent_of(pid) == me:
            before[pid] = (path.parent / STACKS_FILE, _size(path.parent / STACKS_FILE))
            with contextlib.suppress(OSError):
                os.kill(pid, DUMP_SIGNAL)
    pending, last = set(before), dict[int, int]()
    deadline = time.monotonic() + STACK_WAIT_S
    while pending and time.monotonic() < deadline:
        time.sleep(0.02)
        for pid in list(pending):
            size = _size(before[pid][0])
            if size > before[pid][1] and last.get(pid) == size:
                pending.discard(pid)
            last[pid] = size
    _stack_offsets.update({pid: offset for pid, (_, offset) in before.items()})


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _parent_of(pid: int) -> int | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
        return int(fields[1]) if fields[0] != "Z" else None
    except (OSError, IndexError, ValueError):
        return None
