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
