"""Stacks from live ranks: a rank that answers nothing costs at most the timeout, and a huge stack file is
read bounded."""

from __future__ import annotations

from pathlib import Path


def test_a_rank_that_answers_nothing_costs_at_most_the_timeout(tmp_path: Path):
    """No beacon and the dump signal ignored: request_dumps returns within its bound, with no stack."""
    import subprocess
    import sys
    import time

    from elastic_diag.agent.dumps import request_dumps
    from elastic_diag.layout import RankLayout

    code = "import signal, time; signal.signal(signal.SIGURG, signal.SIG_IGN); print('ready', flush=True); "
    code += "time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        layout = RankLayout(rank=0, local_rank=0, dir=tmp_path)
        t0 = time.monotonic()
        stacks, answered = request_dumps({0: (proc.pid, layout)}, 0.5, "req-1")
        took = time.monotonic() - t0
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    assert answered == set() and stacks == {0: ""}
    assert took < 1.5  # the beacon's wait and the signal's wait, each bounded by the timeout


def test_a_huge_stack_file_is_read_bounded(tmp_path: Path):
    from elastic_diag.layout import STACK_BYTES, read_stack_since

    frames = '  File "x.py", line 1 in f\n' * 400_000
    (tmp_path / "stacks.txt").write_text("Thread 0x1 (most recent call first):\n" + frames)
    text = read_stack_since(tmp_path, 0)
    assert len(text.encode()) <= STACK_BYTES


def test_a_dump_request_wakes_a_beacon_that_ticks_rarely(tmp_path: Path):
    """A real rank whose beacon ticks once a minute answers a dump request at once (its socket wakes it),
    leaves no file for it in its folder, and once it has exited the agent finds nobody to wake."""
    import subprocess
    import sys
    import time

    from helpers import ROOT, worker_env

    from elastic_diag.agent.dumps import request_dumps, wake_beacon
    from elastic_diag.layout import ENV_PROGRESS_INTERVAL, RankLayout

    rank_dir = tmp_path / "r"
    script = tmp_path / "s.py"
    script.write_text("import sys, time\nprint('ready', flush=True)\nsys.stdin.readline()\n")
    env = {**worker_env(rank_dir, str(ROOT)), ENV_PROGRESS_INTERVAL: "60"}  # this checkout's package
    proc = subprocess.Popen([sys.executable, str(script)], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        assert [p.name for p in rank_dir.iterdir() if not p.is_file()] == []  # no FIFO, no socket file
        t0 = time.monotonic()
        stacks, answered = request_dumps({0: (proc.pid, RankLayout(rank=0, local_rank=0, dir=rank_dir))}, 10.0, "r-1")
        took = time.monotonic() - t0
        assert answered == {0}, "the beacon did not answer: it was not woken"
        assert took < 2.0  # not the 60 s tick
        assert "readline" in stacks[0] or "<module>" in stacks[0]
        assert proc.stdin is not None
        proc.stdin.write("\n")
        proc.stdin.close()
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    assert wake_beacon(rank_dir) is False  # the rank took its socket with it


def test_a_rank_killed_with_sigkill_leaves_nothing_to_wake_or_hang_on(tmp_path: Path):
    """SIGKILL gives a rank no chance to clean up: its wake-up socket goes with it (the kernel's), so the agent
    finds nobody to wake and the folder holds no FIFO for a reader to block on."""
    import subprocess
    import sys

    from helpers import ROOT, worker_env

    from elastic_diag.agent.dumps import wake_beacon

    rank_dir = tmp_path / "r"
    script = "import sys\nprint('ready', flush=True)\nsys.stdin.readline()\n"
    proc = subprocess.Popen([sys.executable, "-c", script], env=worker_env(rank_dir, str(ROOT)), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        assert wake_beacon(rank_dir) is True
        proc.kill()
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                stream.close()
    assert wake_beacon(rank_dir) is False
    assert [p for p in rank_dir.iterdir() if p.is_fifo()] == []


def test_without_a_socket_the_beacon_ticks_often_enough_to_answer_in_time(tmp_path: Path):
    """Where the beacon cannot bind its wake-up socket (here: another process holds the name; elsewhere: no
    abstract namespace outside Linux) it falls back to a half-second tick, so that a dump request is still
    answered within the agent's 2 s wait."""
    import os
    import socket
    import time

    from elastic_diag.agent.dumps import request_dumps
    from elastic_diag.layout import RankLayout, wake_address
    from elastic_diag.worker.beacon import NO_WAKE_INTERVAL_S, Beacon

    with open(tmp_path / "stacks.txt", "a") as stacks, socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as taken:
        taken.bind(wake_address(tmp_path))
        b = Beacon(str(tmp_path), 2.0, stacks)
        b.start()
        try:
            assert b.wake_fd is None and b.interval == NO_WAKE_INTERVAL_S
            t0 = time.monotonic()
            stacks_by_rank, answered = request_dumps({0: (os.getpid(), RankLayout(0, 0, tmp_path))}, 2.0, "r-2")
            assert answered == {0} and time.monotonic() - t0 < 1.5
            assert "test_without_a_socket" in stacks_by_rank[0]
        finally:
            b.stop.set()
            b.thread.join(5)
