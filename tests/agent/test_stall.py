"""A stall's snapshot of real processes (agent/stall.py); the record and its words are tests/core/test_stall.py.

The snapshot tests run small Python processes with the worker bootstrap (no torch): one whose main thread
blocks in a save, one that holds the GIL in a regex (its beacon never answers)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import ROOT

from elastic_diag.agent.dumps import find_py_spy
from elastic_diag.agent.health import Stall
from elastic_diag.agent.logs_specs import BOOT_DIR
from elastic_diag.agent.stall import StallSnapshots, pending_collective
from elastic_diag.layout import STALL_FILE, RankLayout, read_stalls


def test_the_collective_a_rank_waits_in_from_its_flight_recorder():
    entries = [{"collective_seq_id": i, "pg_id": 0, "profiling_name": "gloo:all_reduce"} for i in (11, 12)]
    trace = {"entries": entries, "pg_status": {"0": {"last_enqueued_collective": "12",
                                                     "last_completed_collective": "11"}}}  # fmt: skip
    assert pending_collective(trace) == "all_reduce #12 (process group 0)"
    trace["pg_status"]["0"]["last_completed_collective"] = "12"
    assert pending_collective(trace) is None
    assert pending_collective({"pg_status": "garbled"}) is None and pending_collective(None) is None


# --- snapshots of real processes -----------------------------------------------------------------------

SAVING = """
import time
def save():
    open({ready!r}, "w").close()
    time.sleep(120)  # the shared file system stopped answering
save()
"""
REGEX = """
import re, time
open({ready!r}, "w").close()
time.sleep(1.0)  # the beacon starts, then the GIL is held
re.match(r"(a+)+$", "a" * 64 + "!")
"""


def start_rank(tmp_path: Path, code: str, rank: int) -> tuple[subprocess.Popen[bytes], RankLayout]:
    layout = RankLayout(rank=rank, local_rank=rank, dir=tmp_path / "attempt_0" / f"rank_{rank}")
    layout.dir.mkdir(parents=True)
    ready = tmp_path / f"ready{rank}"
    env = {**os.environ, "PYTHONPATH": BOOT_DIR, "ELASTIC_DIAG_RANK_DIR": str(layout.dir),
           "ELASTIC_DIAG_BOOT_PATH": BOOT_DIR, "ELASTIC_DIAG_PROGRESS_INTERVAL": "0.1"}  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-c", code.format(ready=str(ready))], env=env, cwd=ROOT)
    deadline = time.monotonic() + 20
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    return proc, layout


@pytest.mark.timeout(90)
def test_a_snapshot_takes_every_ranks_stack_stops_nothing_and_says_whose_beacon_was_silent(tmp_path):
    procs = []
    try:
        saver, saver_dir = start_rank(tmp_path, SAVING, 0)
        holder, holder_dir = start_rank(tmp_path, REGEX, 1)
        procs = [saver, holder]
        time.sleep(1.5)  # the regex is under way
        warnings: list[dict] = []
        snaps = StallSnapshots(attempt_dir=tmp_path / "attempt_0", attempt=0, node="host-a", stack_timeout_s=1.0,
                               targets={0: (0, saver.pid, saver_dir), 1: (1, holder.pid, holder_dir)},
                               dump_lock=threading.Lock(), decided=lambda: False, exited=set,
                               warn=warnings.append)  # fmt: skip
        now = time.time()
        stall = Stall(number=1, since=now - 5, detected_at=now, threshold_s=5.0, waiting=(), outside=(0, 1),
                      last_progress={0: now - 5, 1: now - 5}, snapshot=True)  # fmt: skip
        started = time.monotonic()
        rec = snaps.take(stall)
        assert rec is not None and time.monotonic() - started < 2 * 1.0 + 6.0  # the dumps, then py-spy's deadline
        assert saver.poll() is None and holder.poll() is None  # nothing was stopped
        by_rank = {r.rank: r for r in rec.ranks}
        assert by_rank[0].beacon is True and by_rank[0].where is not None and by_rank[0].where.endswith("in save")
        assert by_rank[1].beacon is False  # the GIL was held: faulthandler's signal gave its stack
        assert by_rank[1].stack is not None and "re/__init__.py" in by_rank[1].stack.text
        on_disk = read_stalls(tmp_path / "attempt_0")
        assert [r.number for r in on_disk] == [1] and on_disk[0].rank(1).beacon is False
        assert on_disk[0].rank(0).stack is not None and "in save" in on_disk[0].rank(0).stack.text
        if find_py_spy() is not None:
            assert (tmp_path / "attempt_0" / "stall_1" / "rank_1" / "pyspy.txt").is_file()
        # the stall ends (progress resumed): the record says how long it lasted at once; the attempt ends well,
        # so the stall is one warning of the run
        stall.ended_at = now + 36.0
        snaps.on_stall_end(stall)
        data = json.loads((tmp_path / "attempt_0" / "stall_1" / STALL_FILE).read_text())
        assert data["outcome"] == "resumed" and data["duration_s"] == 41.0
        snaps.join(5.0)
        (settled,) = snaps.finish(failed=False, began=None)
        assert settled.outcome == "resumed" and len(warnings) == 1 and warnings[0]["duration_s"] == 41.0
        snaps.finish(failed=False, began=None)
        assert len(warnings) == 1
    finally:
        for p in procs:
            p.send_signal(signal.SIGKILL)
            p.wait()


def test_no_snapshot_once_a_verdict_is_under_way_or_the_attempt_is_over(tmp_path):
    decided = [True]
    snaps = StallSnapshots(attempt_dir=tmp_path, attempt=0, node="n", stack_timeout_s=1.0, targets={},
                           dump_lock=threading.Lock(), decided=lambda: decided[0], exited=set,
                           warn=lambda w: None)  # fmt: skip
    stall = Stall(number=1, since=1.0, detected_at=7.0, threshold_s=5.0, waiting=(0,), outside=(),
                  last_progress={}, snapshot=True)  # fmt: skip
    snaps.on_stall(stall)
    assert snaps.in_order() == () and not (tmp_path / "stall_1").exists()
    decided[0] = False
    stall.snapshot = False  # within a minute of the last one: recorded, no stacks asked for
    snaps.on_stall(stall)
    snaps.join(1.0)
    (rec,) = snaps.finish(failed=True, began=None)
    assert rec.snapshot.startswith("not taken") and rec.outcome == "failed" and (tmp_path / "stall_1").is_dir()
