"""Faults of the tool itself, on real runs: a diag dir that fills up, a launcher SIGKILLed while its ranks run,
a diag dir that cannot be written, many ranks and a flood of output. The job's own result never changes.
The ranks are tiny scripts that do not import torch (a rank costs a Python start, not torch's)."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import pytest
from helpers import ROOT, kill_leftovers, launch, torchrun_diag

pytestmark = pytest.mark.multiprocess


@contextmanager
def tmpfs(where: Path, *options: str) -> Iterator[Path]:
    """A tmpfs mounted at ``where`` for the test (root only), unmounted whatever happens."""
    where.mkdir(parents=True, exist_ok=True)
    opts = ",".join(("size=1m", *options))
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(where)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (root needed): {mounted.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def script(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "worker.py"
    path.write_text(text)
    return path


FILL = """\
import os, sys, time
rank = int(os.environ["RANK"])
if rank == 0:
    time.sleep(1)  # the other rank's bootstrap writes first
    for _ in range(10_000):  # 2 MB into a 1 MB disk
        print("x" * 200, file=sys.stderr)
    print("rank 0 done", flush=True)
    sys.exit(0)
time.sleep(2.5)
print("rank 1: giving up", file=sys.stderr, flush=True)
sys.exit(3)
"""


@pytest.mark.timeout(90)
def test_a_full_diag_disk_leaves_the_job_as_it_was(tmp_path):
    """The ranks' output fills the diag dir's disk: the ranks' prints do not fail (rank 0 exits 0, rank 1 with
    its own 3, and rank 1 is named), the summary names no report file that is not there and says what could not
    be written, and no temporary file is left."""
    worker = script(tmp_path, FILL)
    with tmpfs(tmp_path / "disk") as disk:
        diag = disk / "diag"
        argv = torchrun_diag("--standalone", "--nproc-per-node", "2", "--diag-grace", "1", "--diag-dir", str(diag),
                             str(worker))  # fmt: skip
        run = launch(argv, diag, timeout=80)
        left = sorted(str(p) for p in diag.rglob("*.tmp"))
        report_there = (diag / "report.json").is_file()
    assert run.returncode == 1, run.stderr[-3000:]
    assert "elastic_diag: job FAILED: initiating rank 1" in run.stderr, run.stderr[-3000:]
    assert "Traceback" not in run.stderr, run.stderr[-3000:]  # the ranks' prints did not fail, nor did we
    summary = run.stderr[run.stderr.index("elastic_diag: job FAILED") :]
    assert "not written: " in summary and "No space left on device" in summary, summary
    if not report_there:
        assert f"report: {diag / 'report.json'}" not in summary, summary
    assert left == [], left


SLEEPER = """\
import os, time
print(f"rank {os.environ['RANK']} up", flush=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.timeout(90)
def test_a_launcher_killed_with_sigkill_takes_its_ranks_with_it(tmp_path):
    """SIGKILL to the launcher while its ranks run: the ranks exit within seconds (the kernel's SIGTERM), no
    FIFO is left in the folder, and ``elastic-diag report`` says the launcher died."""
    worker = script(tmp_path, SLEEPER)
    diag = tmp_path / "diag"
    argv = torchrun_diag("--standalone", "--nproc-per-node", "2", "--diag-dir", str(diag), str(worker))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT, env=env,
                            start_new_session=True)  # fmt: skip
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while len(pids) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
            pids = []
            for info in diag.glob("attempt_0/rank_*/worker.json"):
                with suppress(OSError, ValueError, KeyError):
                    pids.append(json.loads(info.read_text())["pid"])
        assert len(pids) == 2, "the ranks did not start"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(p) for p in pids), "orphan ranks still run after their launcher was killed"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        kill_leftovers(diag)
    assert [p for p in diag.rglob("*") if p.is_fifo()] == []
    report = subprocess.run([sys.executable, "-m", "elastic_diag.cli", "report", str(diag)], capture_output=True,
                            text=True, timeout=60, cwd=ROOT)  # fmt: skip
    assert report.returncode == 0, report.stderr
    assert "died without writing its final record" in report.stderr, report.stderr
    page = (diag / "report.html").read_text()
    assert "died without writing its final record" in page and "stopped by the launcher" not in page


FAIL_RANK_1 = """\
import os, sys, time
if os.environ["RANK"] == "1":
    print("rank 1 leaving", file=sys.stderr, flush=True)
    sys.exit(4)
time.sleep(30)
"""


@pytest.mark.timeout(60)
def test_an_unwritable_diag_dir_runs_the_job_undiagnosed(tmp_path):
    """A read-only diag dir: one warning line, and the job runs and ends as under plain torchrun (exit 1)."""
    worker = script(tmp_path, FAIL_RANK_1)
    with tmpfs(tmp_path / "ro", "ro") as ro:
        diag = ro / "diag"
        run = launch(torchrun_diag("--standalone", "--nproc-per-node", "2", "--diag-dir", str(diag), str(worker)),
                     diag, timeout=50)  # fmt: skip
    warnings = [line for line in run.stderr.splitlines() if line.startswith("torchrun-diag: warning:")]
    assert len(warnings) == 1 and "not writable (Read-only file system)" in warnings[0], run.stderr[-2000:]
    assert "WITHOUT diagnosis" in warnings[0]
    assert run.returncode == 1, run.stderr[-2000:]
    assert "rank 1 leaving" in run.stdout + run.stderr
    assert "elastic_diag: job" not in run.stderr  # undiagnosed: no summary


LOAD = """\
import os, sys, time
rank = int(os.environ["RANK"])
if rank == 0:  # 100 MB/s on stderr for 1.5 s
    chunk = ("x" * 1023 + "\\n") * 1024
    start, sent = time.monotonic(), 0
    while time.monotonic() - start < 1.5:
        sys.stderr.write(chunk)
        sent += 1
        time.sleep(max(0.0, sent / 100 - (time.monotonic() - start)))
elif rank == 5:
    time.sleep(2.5)
    print("rank 5: the shard index is corrupt, giving up", file=sys.stderr, flush=True)
    sys.exit(3)
time.sleep(60)
"""


@pytest.mark.timeout(120)
def test_eight_ranks_and_a_flood_keep_every_ranks_evidence_private(tmp_path):
    """8 ranks, one writing 100 MB/s to stderr, one failing, under umask 000: every rank's evidence is kept, the
    failing rank is named, and every folder of the diag dir is 0700, every file 0600. (32 ranks: the
    benchmark ``benchmarks/load.py``; too costly for CI on two cores.)"""
    worker = script(tmp_path, LOAD)
    diag = tmp_path / "diag"
    argv = ["sh", "-c", 'umask 000; exec "$@"', "sh",
            *torchrun_diag("--standalone", "--nproc-per-node", "8", "--local-ranks-filter", "5", "--diag-grace", "1",
                           "--diag-dir", str(diag), str(worker))]  # fmt: skip
    run = launch(argv, diag, timeout=110)
    assert run.returncode == 1, run.stderr[-3000:]
    d = run.report["diagnosis"]
    assert d["initiating_rank"] == 5, d
    for rank in range(8):
        folder = diag / "attempt_0" / f"rank_{rank}"
        for name in ("worker.json", "stdout.log", "stderr.log", "launcher.json"):
            assert (folder / name).is_file(), f"rank {rank}: no {name}"
        assert json.loads((folder / "launcher.json").read_text())["rank"]["exit_code"] is not None
    assert (diag / "attempt_0" / "rank_0" / "stderr.log").stat().st_size > 50 << 20
    wrong = []
    for path in [diag, *diag.rglob("*")]:
        mode = stat.S_IMODE(path.lstat().st_mode)
        want = 0o700 if path.is_dir() else 0o600
        if mode != want:
            wrong.append(f"{path.relative_to(diag)}: {mode:o}")
    assert wrong == [], wrong
