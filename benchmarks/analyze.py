"""Offline analyzer benchmark (not a timed test): prints throughput, peak memory and the ratio to grep.

    python benchmarks/analyze.py [--ranks 1024] [--total-mb 1024] [--dir DIR] [--keep]

Generates a log set of ``--ranks`` per-rank files (rank_N.log) totalling ``--total-mb``: training
progress lines with periodic warnings, NCCL INFO lines, and at the end of every file but one an NCCL
watchdog timeout; the culprit (rank 737, or ranks // 2 + 225) has a CUDA out-of-memory traceback
buried in the middle of its file and nothing after it. Then, pinned to one core (taskset -c 0):
``grep -c Watchdog`` over the files (page cache warmed first), and ``elastic-diag analyze --json``,
measuring wall time and peak RSS (resource.getrusage of the child). Checks the verdict names the
culprit.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _normal_block(rank: int, step: int, rng: random.Random) -> str:
    lines = []
    for s in range(step, step + 50):
        lines.append(
            f"[rank{rank}]:[2026-11-29 10:{s // 60 % 60:02d}:{s % 60:02d},{rng.randrange(1000):03d}] [INFO] "
            f"trainer.py:412 step={s} loss={rng.uniform(1, 3):.4f} lr=3.0e-04 grad_norm={rng.uniform(0.2, 2):.3f} "
            f"tokens_per_s={rng.randrange(90000, 120000)} mem_gb={rng.uniform(60, 70):.1f}\n"
        )
    lines.append(f"node-{rank // 8:03d}:{40000 + rank}:{41000 + rank} [{rank % 8}] NCCL INFO Channel 02/0 : "
                 f"{rank} -> {(rank + 1) % 1024} via P2P/IPC\n")  # fmt: skip
    lines.append(f"[rank{rank}]: /opt/lib/data.py:88: UserWarning: sample {step} truncated to 4096 tokens\n")
    return "".join(lines)


def generate(folder: Path, ranks: int, total_mb: int, culprit: int) -> int:
    folder.mkdir(parents=True, exist_ok=True)
    per_rank = total_mb * (1 << 20) // ranks
    rng = random.Random(0)
    block = _normal_block(0, 0, rng)
    blocks_per_file = max(2, per_rank // len(block))
    total = 0
    for r in range(ranks):
        body = [_normal_block(r, b * 50, rng) if b % 97 == 0 else block.replace("[rank0]", f"[rank{r}]")
                for b in range(blocks_per_file)]  # fmt: skip
        if r == culprit:
            mid = len(body) // 2
            body = body[:mid] + [
                f"[rank{r}]: Traceback (most recent call last):\n",
                f'[rank{r}]:   File "/opt/app/train.py", line 212, in train_step\n',
                f"[rank{r}]:     loss.backward()\n",
                f"[rank{r}]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB. GPU 1 has a "
                "total capacity of 79.19 GiB of which 3.12 GiB is free.\n",
            ]
        else:
            body.append(
                f"[rank{r}]:[E1129 10:42:01.000000000 ProcessGroupNCCL.cpp:632] [Rank {r}] Watchdog caught collective "
                f"operation timeout: WorkNCCL(SeqNum=90210, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, "
                f"Timeout(ms)=600000) ran for 600071 milliseconds before timing out.\n"
            )
        data = "".join(body).encode()
        (folder / f"rank_{r}.log").write_bytes(data)
        total += len(data)
    return total


def _timed(argv: list[str]) -> tuple[float, float, str]:
    """Wall seconds, peak RSS in MB (this child alone), stdout."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t0 = time.perf_counter()
    p = subprocess.run(argv, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    if p.returncode not in (0, 1):
        sys.exit(f"{argv[:4]} failed: {p.stderr[-2000:]}")
    return wall, max(after, before) / 1024, p.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--total-mb", type=int, default=1024)
    ap.add_argument("--dir", default=None, help="where to generate (default: a temporary folder)")
    ap.add_argument("--keep", action="store_true")
    a = ap.parse_args()
    folder = Path(a.dir) if a.dir else Path(tempfile.mkdtemp(prefix="elastic_diag_bench_"))
    culprit = min(a.ranks - 1, a.ranks // 2 + 225)
    try:
        t0 = time.perf_counter()
        size = generate(folder, a.ranks, a.total_mb, culprit)
        took = time.perf_counter() - t0
        print(f"generated {a.ranks} files, {size / 1e6:.0f} MB in {took:.1f} s; culprit rank {culprit}")
        files = sorted(str(p) for p in folder.glob("rank_*.log"))
        pin = ["taskset", "-c", "0"] if shutil.which("taskset") else []
        subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)  # warm the page cache
        grep_s, _, _ = _timed([*pin, "grep", "-c", "Watchdog", *files])
        from elastic_diag.offline.files import ANCHORS, ere_escape

        same = "|".join(ere_escape(a.decode()) for a in ANCHORS)
        os.environ["LC_ALL"] = "C"  # as the analyzer runs its grep
        grep_all_s, _, _ = _timed([*pin, "grep", "-c", "-E", same, *files])
        env_python = [sys.executable, "-m", "elastic_diag.cli", "analyze", "--json", str(folder)]
        os.environ["PYTHONPATH"] = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")
        ana_s, rss_mb, out = _timed([*pin, *env_python])
        free_grep_s, _, _ = _timed(["grep", "-c", "Watchdog", *files])  # unpinned: every core the machine has
        free_ana_s, _, _ = _timed(env_python)
        d = json.loads(out)["diagnosis"]
        print(f"grep -c Watchdog: {grep_s:.2f} s ({size / 1e6 / grep_s:.0f} MB/s)")
        print(
            f"elastic-diag analyze: {ana_s:.2f} s ({size / 1e6 / ana_s:.0f} MB/s, target >= 100), "
            f"peak RSS {rss_mb:.0f} MB (target < 500)"
        )
        print(
            f"grep -c -E with the analyzer's {len(ANCHORS)} anchors: {grep_all_s:.2f} s "
            f"({size / 1e6 / grep_all_s:.0f} MB/s)"
        )
        print(
            f"ratio analyze / grep -c Watchdog: {ana_s / grep_s:.2f} (target <= 3); "
            f"analyze / grep with the same anchors: {ana_s / grep_all_s:.2f}"
        )
        print(
            f"unpinned ({len(os.sched_getaffinity(0))} cores; the analyzer runs one grep per core): "
            f"grep -c Watchdog {free_grep_s:.2f} s, analyze {free_ana_s:.2f} s, ratio {free_ana_s / free_grep_s:.2f}"
        )
        ok = d["initiating_rank"] == culprit and d["failure_class"] == "cuda_oom"
        print(f"verdict: rank {d['initiating_rank']} {d['failure_class']} ({'right' if ok else 'WRONG'})")
    finally:
        if not a.keep and not a.dir:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
