"""Load benchmark (not a timed test): many ranks on one host and one rank flooding stderr.

    python benchmarks/load.py [--nproc 32] [--flood-mb-s 100] [--flood-s 4] [--fail-rank 17] [--keep DIR]

Each rank is a tiny Python script that does not import torch (so the launcher, not the ranks, is what is
measured): rank 0 writes ``--flood-mb-s`` MB a second to its stderr for ``--flood-s`` seconds, rank
``--fail-rank`` prints one line and exits 3 once the flood is over, the others sleep until torch's teardown.
Prints the launcher's own peak RSS (VmHWM) and CPU seconds (utime + stime of the launcher process alone, read
from /proc every 50 ms until it exits), the wall time, the flood's size on disk, and checks that every rank
kept its evidence (worker.json, both streams, launcher.json with an exit) and that the verdict names the
failing rank. Exit status 0 when every check holds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

WORKER = """\
import os, sys, time
rank = int(os.environ["RANK"])
flood_mb_s, flood_s, fail_rank = {flood_mb_s}, {flood_s}, {fail_rank}
print(f"rank {{rank}} up", flush=True)
start = time.monotonic()
if rank == 0:
    chunk = ("x" * 1023 + "\\n") * 1024  # 1 MiB of 1 KiB lines
    sent = 0
    while time.monotonic() - start < flood_s:
        sys.stderr.write(chunk)
        sent += 1
        ahead = sent / flood_mb_s - (time.monotonic() - start)
        if ahead > 0:
            time.sleep(ahead)
    sys.stderr.flush()
    print(f"rank 0 flooded {{sent}} MiB in {{time.monotonic() - start:.2f}} s", flush=True)
elif rank == fail_rank:
    time.sleep(flood_s + 0.5)
    print(f"rank {{rank}}: the shard index is corrupt, giving up", file=sys.stderr, flush=True)
    sys.exit(3)
time.sleep(120)
"""


def proc_figures(pid: int) -> tuple[float, int] | None:
    """The process's own CPU seconds (utime + stime, not its children's) and peak RSS (KiB)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    cpu = (int(fields[11]) + int(fields[12])) / ticks
    hwm = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")), 0)
    return cpu, hwm


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=32)
    p.add_argument("--flood-mb-s", type=float, default=100.0)
    p.add_argument("--flood-s", type=float, default=4.0)
    p.add_argument("--fail-rank", type=int, default=17)
    p.add_argument("--keep", type=Path, help="write the diag dir here and keep it")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="elastic-diag-load-"))
    diag = args.keep or work / "diag"
    script = work / "worker.py"
    script.write_text(WORKER.format(flood_mb_s=args.flood_mb_s, flood_s=args.flood_s, fail_rank=args.fail_rank))
    argv = [sys.executable, "-m", "elastic_diag.run", "--standalone", "--nproc-per-node", str(args.nproc),
            "--diag-grace", "1", "--diag-dir", str(diag), str(script)]  # fmt: skip
    print("$", " ".join(argv))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}  # fmt: skip
    start = time.monotonic()
    # the console (the flood included: torchrun shows every rank's output) read as it comes, its end kept
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, cwd=work,
                            start_new_session=True)  # fmt: skip
    console: deque[bytes] = deque(maxlen=64)
    reader = threading.Thread(target=lambda: console.extend(iter(proc.stderr.readline, b"")), daemon=True)
    reader.start()
    last: tuple[float, int] = (0.0, 0)
    try:
        while proc.poll() is None:
            got = proc_figures(proc.pid)
            last = got if got is not None and got[1] > 0 else last  # a zombie has no VmHWM
            time.sleep(0.05)
            if time.monotonic() - start > 300:
                os.killpg(proc.pid, 9)
                print("timed out after 300 s")
                return 1
        reader.join(10)
        err = b"".join(console).decode(errors="replace")
    finally:
        with __import__("contextlib").suppress(ProcessLookupError):
            os.killpg(proc.pid, 9)
    wall = time.monotonic() - start
    cpu, hwm = last
    attempt = diag / "attempt_0"
    flood = (attempt / "rank_0" / "stderr.log").stat().st_size if (attempt / "rank_0").is_dir() else 0
    problems = []
    for rank in range(args.nproc):
        folder = attempt / f"rank_{rank}"
        missing = [n for n in ("worker.json", "stdout.log", "stderr.log", "launcher.json") if not (folder / n).exists()]
        if missing:
            problems.append(f"rank {rank}: missing {', '.join(missing)}")
            continue
        record = json.loads((folder / "launcher.json").read_text())
        if record["rank"]["exit_code"] is None:
            problems.append(f"rank {rank}: no exit recorded")
    report = json.loads((diag / "report.json").read_text())
    d = report["diagnosis"]
    if d["initiating_rank"] != args.fail_rank:
        problems.append(f"the verdict names rank {d['initiating_rank']}, not {args.fail_rank}: {d['summary']}")
    print(f"launcher exit {proc.returncode}; wall {wall:.1f} s; launcher CPU {cpu:.2f} s; launcher peak RSS "
          f"{hwm / 1024:.0f} MiB; rank 0's stderr.log {flood / 1e6:.0f} MB; verdict: {d['failure_class']}, "
          f"rank {d['initiating_rank']}")  # fmt: skip
    for line in problems:
        print("PROBLEM:", line)
    if proc.returncode != 1:
        problems.append(f"exit {proc.returncode}, not 1")
        print(err[-3000:])
    if args.keep is None:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
