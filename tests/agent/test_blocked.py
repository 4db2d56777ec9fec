"""What /proc shows a blocked process waiting on (agent/blocked.py), with real processes: a flock held by
another "rank", a child that fills its output pipe while its parent waits, a read on a pipe whose writer
is a sleeping child, a socket nobody answers, a FIFO nobody opens. No torch: plain Python processes, each
killed at the end."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elastic_diag.agent.blocked import probe_blocked

pytestmark = [pytest.mark.skipif(not Path("/proc/self/wchan").exists(), reason="Linux /proc only"),
              pytest.mark.timeout(60)]  # fmt: skip


def _start(code: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", code], start_new_session=True)


def _wait_for(pred, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, "the process never blocked"
        time.sleep(0.05)


def _wchan(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/wchan").read_text()
    except OSError:
        return ""


def test_what_each_blocked_process_waits_on(tmp_path: Path) -> None:
    lock, fifo = tmp_path / "cache.lock", tmp_path / "ready.fifo"
    os.mkfifo(fifo)
    holder = _start(f"import fcntl, subprocess; f = open({str(lock)!r}, 'w'); fcntl.flock(f, fcntl.LOCK_EX); "
                    "subprocess.run(['sleep', '30'])")  # fmt: skip
    procs = [holder]
    try:
        _wait_for(lambda: "do_wait" in _wchan(holder.pid))
        procs.append(waiter := _start(f"import fcntl; f = open({str(lock)!r}, 'w'); fcntl.flock(f, fcntl.LOCK_EX)"))
        procs.append(
            deadlock := _start(
                "import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', 'print(\"x\" * 300000)'], "
                "stdout=subprocess.PIPE); p.wait()"
            )
        )
        procs.append(
            reader := _start(
                "import os, subprocess; r, w = os.pipe(); subprocess.Popen(['sleep', '30'], stdout=w, pass_fds=(w,)); "
                "os.close(w); os.read(r, 1)"
            )
        )
        procs.append(
            sock := _start(
                "import socket; s = socket.create_server(('127.0.0.1', 0)); "
                "c = socket.create_connection(s.getsockname()); c.recv(10)"
            )
        )
        procs.append(opener := _start(f"open({str(fifo)!r})"))
        ranks = {holder.pid: 2, waiter.pid: 1, deadlock.pid: 3, reader.pid: 4, sock.pid: 5, opener.pid: 6}
        for p in procs:
            _wait_for(lambda p=p: _wchan(p.pid) not in ("", "0") and "do_sys" not in _wchan(p.pid))
        time.sleep(0.3)
        got = probe_blocked({r: pid for pid, r in ranks.items()}, ranks)
    finally:
        for p in procs:
            os.killpg(p.pid, 9)
            p.wait()
    assert (got[1].waits_for, got[1].what, got[1].holder_rank) == ("lock", str(lock), 2)
    assert (got[2].waits_for, got[2].what, got[2].holder_rank) == ("child", "sleep 30", 2)
    assert got[3].waits_for == "child" and "pipe that nobody read" in (got[3].holder_waits or "")
    assert (got[4].waits_for, got[4].holder_rank) == ("pipe", 4) and "sleeping" in (got[4].holder_waits or "")
    assert got[5].waits_for == "socket" and (got[5].what or "").startswith("TCP 127.0.0.1:")
    assert got[6].waits_for == "fifo"


def test_a_process_that_is_gone_or_unreadable_is_left_out(tmp_path: Path) -> None:
    assert probe_blocked({0: 2**22 + 12345}, {}) == {}
    assert probe_blocked({0: os.getpid()}, {}, proc=tmp_path) == {}  # no /proc there
