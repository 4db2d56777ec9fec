"""Evidence taken from ranks that are still alive: their Python stacks (the beacon's answer to a
``dump.request`` file, or faulthandler's dump on SIGURG when the beacon is silent) and py-spy's native
stacks. Every wait is bounded; a rank that does not answer is named, never waited for.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from elastic_diag.agent.clock import Clock, Sleep
from elastic_diag.layout import (
    DUMP_DONE_FILE,
    DUMP_REQUEST_FILE,
    PYSPY_FILE,
    RankLayout,
    read_json,
    read_stack_since,
    stack_file_size,
    wake_address,
    write_atomic,
)
from elastic_diag.worker import bootstrap

POLL_S = 0.02


NATIVE_STACKS_S = 5.0  # py-spy, all ranks together


STACK_LIMIT = 256 * 1024


def dump_stacks(
    targets: dict[int, tuple[int, RankLayout]], timeout: float, clock: Clock = time.monotonic, sleep: Sleep = time.sleep
) -> dict[int, str]:
    """Ask each live rank for a faulthandler dump of all threads; wait at most ``timeout``."""
    before = {k: stack_file_size(layout.dir) for k, (_, layout) in targets.items()}
    pending = set()
    for k, (pid, _) in targets.items():
        try:
            os.kill(pid, bootstrap.DUMP_SIGNAL)
            pending.add(k)
        except OSError:
            pass
    last: dict[int, int] = {}
    deadline = clock() + timeout
    while pending and clock() < deadline:
        sleep(POLL_S)
        for k in list(pending):
            size = stack_file_size(targets[k][1].dir)
            if size > before[k] and last.get(k) == size:
                pending.discard(k)
            last[k] = size
    return {k: read_stack_since(layout.dir, before[k]) for k, (_, layout) in targets.items()}


def request_dumps(
    targets: dict[int, tuple[int, RankLayout]],
    timeout: float,
    request_id: str,
    clock: Clock = time.monotonic,
    sleep: Sleep = time.sleep,
) -> tuple[dict[int, str], set[int]]:
    """Ask each live rank's beacon for its stacks and flight recorder (a ``dump.request`` file); the
    ranks that do not answer within ``timeout`` get the faulthandler signal instead. Returns the
    stack text per rank and the ranks whose beacon answered."""
    before = {k: stack_file_size(layout.dir) for k, (_, layout) in targets.items()}
    pending = set()
    for k, (_, layout) in targets.items():
        try:
            (layout.dir / DUMP_DONE_FILE).unlink(missing_ok=True)
            write_atomic(layout.dir / DUMP_REQUEST_FILE, request_id, redact=False)
            pending.add(k)
        except OSError:
            pass
        else:
            wake_beacon(layout.dir)
    answered: set[int] = set()
    deadline = clock() + timeout
    while pending and clock() < deadline:
        sleep(POLL_S)
        for k in list(pending):
            done = read_json(targets[k][1].dir / DUMP_DONE_FILE)
            if done and done.get("id") == request_id:
                pending.discard(k)
                answered.add(k)
    stacks = {k: read_stack_since(layout.dir, before[k]) for k, (_, layout) in targets.items() if k in answered}
    silent = {k: v for k, v in targets.items() if k not in answered}
    if silent:  # the beacon thread never ran (the GIL held in C, or no bootstrap): faulthandler's signal
        stacks.update(dump_stacks(silent, timeout, clock=clock, sleep=sleep))
    return stacks, answered


def wake_beacon(rank_dir: Path) -> bool:
    """Wake the rank's beacon thread now (a byte to its socket, :func:`~elastic_diag.layout.wake_address`),
    rather than at its next tick; False when nobody listens (the rank is gone, or its beacon has no socket): the
    request file waits for the next tick. Never blocks."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.setblocking(False)
            sock.sendto(b"!", wake_address(rank_dir))
    except BlockingIOError:  # its queue is full: a wake-up is already pending
        return True
    except (OSError, ValueError):  # ECONNREFUSED: no socket bound to the name
        return False
    return True


def find_py_spy() -> str | None:
    """py-spy on PATH, or beside this interpreter (a virtual environment that was not activated)."""
    beside = Path(sys.executable).with_name("py-spy")
    return shutil.which("py-spy") or (str(beside) if os.access(beside, os.X_OK) else None)


def native_stacks_of(workers: list[tuple[int, Path]], deadline_s: float = NATIVE_STACKS_S) -> int:
    """py-spy's native stacks of several ranks at once (threads), all within ``deadline_s``; returns
    how many were written (``pyspy.txt`` in each rank's folder). Nothing when py-spy is absent."""
    exe = find_py_spy()
    if exe is None or not workers:
        return 0
    threads = [
        threading.Thread(target=native_stacks, args=(pid, d, deadline_s, exe), daemon=True) for pid, d in workers
    ]
    for t in threads:
        t.start()
    end = time.monotonic() + deadline_s + 0.5
    for t in threads:
        t.join(max(0.0, end - time.monotonic()))
    return sum(1 for _, d in workers if (d / PYSPY_FILE).exists())


def native_stacks(pid: int, rank_dir: Path, timeout: float = NATIVE_STACKS_S, exe: str | None = None) -> str | None:
    """py-spy's dump with native frames, when py-spy is installed (saved beside the other evidence)."""
    exe = exe or find_py_spy()
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "dump", "--native", "--pid", str(pid)], capture_output=True, timeout=timeout,
                             check=False, text=True, errors="replace")  # fmt: skip
    except (OSError, subprocess.SubprocessError) as e:
        return f"py-spy failed: {e}"
    text = (out.stdout or out.stderr)[:STACK_LIMIT]
    with contextlib.suppress(OSError):  # a full disk: no partial file left
        write_atomic(rank_dir / PYSPY_FILE, text)
    return text
