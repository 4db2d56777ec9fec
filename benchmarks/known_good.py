"""`elastic-diag analyze FAILED --known-good GOOD`: throughput and peak memory of the comparison on big logs.

Two runs of one job on 256 ranks (32 nodes x 8), each rank's output in a torchrun log dir
(``attempt_0/<rank>/stderr.log``) with the chatter real runs print: NCCL INFO set-up lines (hosts, pids, bus
ids, channels, rings), Python warnings, per-step log records (timestamps, losses, learning rates, grad norms,
throughput), tqdm progress bars rewritten with CR, data loader and checkpoint lines with shard names, temp
paths and addresses. The runs differ in seed, step count, ports, pids, timestamps, host order and loss values.
In the failed run one rank (``--culprit``) prints a warning the good run never printed ("checksum mismatch ...
using cached copy") a while before its data loader dies, and every other rank then reports NCCL watchdog
timeouts.

Measured: the comparison alone (:func:`learn` of the good run, :func:`find_novel` of the failed one, the
ranking), in MB/s through both sides on one core, lines/s beside it (logreduce's documented speed is about
2,000 lines/s to learn and 1,300 lines/s to test), peak RSS of a fresh process (``resource.getrusage``), and
whether the planted line is the first divergence. ``--full`` also times the whole ``analyze --known-good``
(both analyses and the comparison).

    python benchmarks/known_good.py [--mb 200] [--ranks 256] [--keep DIR] [--json FILE] [--full]
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PLANTED = (
    "WARNING:data.shards:checksum mismatch for shard-{shard:05d}.tar (expected {a:08x}, got {b:08x}), using cached copy"
)


_WORDS = ("prefetch", "shard", "bucket", "allreduce", "overlap", "warmup", "cosine", "window", "token", "packing",
          "rotary", "kv", "router", "expert", "capacity", "spill", "pinned", "stream", "graph", "compile", "guard",
          "recompile", "offload", "zero", "stage", "gather", "scatter", "reshard", "flush", "queue")  # fmt: skip
_MODULES = ("trainer", "loader", "checkpoint", "optim", "eval", "metrics", "data.shards", "comm", "profiler",
            "scheduler", "moe", "fsdp")  # fmt: skip
# about 250 more message shapes, as a real job's libraries print (each with its own numbers)
_SHAPES = tuple(
    f"[{_MODULES[i % len(_MODULES)]}.py:{40 + i}] {_WORDS[i % 30]} {_WORDS[i // 30 % 30]}: "
    + " ".join(f"{_WORDS[(i + j * 11) % 30]}_{j}={{}}" for j in range(1 + i % 4))
    for i in range(250)
)


def _chatter(rng: random.Random) -> str:
    shape = _SHAPES[min(int(rng.expovariate(1 / 40)), len(_SHAPES) - 1)]  # a few common, many rare
    values = [rng.choice((f"{rng.uniform(0, 100):.3f}", str(rng.randrange(10**6)), f"{rng.random():.2e}"))
              for _ in range(shape.count("{}"))]  # fmt: skip
    return shape.format(*values)


def _bar(rng: random.Random, step: int, total: int) -> str:
    pct = 100 * step // total
    full = pct // 10
    bar = "\u2588" * full + ("\u258c" if pct % 10 >= 5 else " ") + " " * (9 - full)
    return (f"Epoch 0: {pct:3d}%|{bar[:10]}| {step}/{total} [{step // 60:02d}:{step % 60:02d}<"
            f"{(total - step) // 60:02d}:{(total - step) % 60:02d}, {rng.uniform(1, 9):.2f}it/s, "
            f"loss={rng.uniform(0.5, 4):.3g}, v_num={rng.randrange(10)}]")  # fmt: skip


def rank_log(rank: int, ranks: int, target: int, seed: int, *, failed: bool, culprit: int) -> bytes:
    """One rank's stderr of about ``target`` bytes."""
    rng = random.Random(seed * 100_003 + rank)
    hosts = [f"gpu-{(n * 7 + seed) % 97:03d}" for n in range(ranks // 8 + 1)]
    host = hosts[rank // 8]
    pid = rng.randrange(2000, 60000)
    t0 = 1_796_000_000 + seed * 86400 + rng.random()
    out: list[str] = []
    for ch in range(24):
        out.append(f"{host}:{pid}:{pid + 40} [{rank % 8}] NCCL INFO Channel {ch:02d}/24 : {rank}[{rank % 8}] -> "
                   f"{(rank + 1) % ranks}[{(rank + 1) % 8}] via P2P/CUMEM/read")  # fmt: skip
    out.append(f"{host}:{pid}:{pid + 40} [{rank % 8}] NCCL INFO comm 0x{rng.getrandbits(44):x} rank {rank} nranks "
               f"{ranks} cudaDev {rank % 8} nvmlDev {rank % 8} busId {rng.choice('1234567')}{rng.choice('abcdef')}000 "
               f"commId 0x{rng.getrandbits(64):x} - Init COMPLETE")  # fmt: skip
    out.append(
        "/usr/lib/python3/dist-packages/torch/utils/data/dataloader.py:558: UserWarning: This DataLoader will "
        "create 8 worker processes in total. Our suggested max number of worker in current system is 6."
    )
    size = sum(len(x) + 1 for x in out)
    steps = 1_000_000
    step = 0
    plant_at = int(target * 0.7)
    planted = False
    while size < target:
        step += 1
        t = t0 + step * 0.37
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t)) + f",{int(t * 1000) % 1000:03d}"
        k = rng.random()
        if k < 0.49:
            line = (f"[{stamp}][INFO][trainer.py:412] step {step}/{steps} loss {rng.uniform(0.5, 4):.4f} lr "
                    f"{rng.uniform(1e-5, 3e-4):.3e} grad_norm {rng.uniform(0.1, 3):.4f} tokens/s "
                    f"{rng.uniform(8e4, 1.2e5):.1f} mem {rng.uniform(40, 70):.2f}GB")  # fmt: skip
        elif k < 0.8:
            line = "\r".join(_bar(rng, step + i, steps) for i in range(3))
        elif k < 0.86:
            line = f"[{stamp}][INFO]{_chatter(rng)}"
        elif k < 0.93:
            line = (f"[{stamp}][DEBUG][loader.py:88] fetched shard-{rng.randrange(100000):05d}.tar "
                    f"({rng.randrange(10**6, 10**8)} bytes) in {rng.uniform(0.01, 2):.3f}s into "
                    f"/tmp/tmp{rng.getrandbits(40):x}/buf at 0x{rng.getrandbits(48):012x}")  # fmt: skip
        else:
            line = (f"[{stamp}][INFO][checkpoint.py:57] saved step {step} to /ckpt/run-{seed}/step_{step:08d}/"
                    f"rank_{rank:05d}.pt in {rng.uniform(0.5, 9):.2f}s")  # fmt: skip
        out.append(line)
        size += len(line) + 1
        if failed and rank == culprit and not planted and size >= plant_at:
            out.append(f"[{stamp}]" + PLANTED.format(shard=rng.randrange(100000), a=rng.getrandbits(32),
                                                      b=rng.getrandbits(32)))  # fmt: skip
            planted = True
    if failed:
        t = t0 + (step + 40) * 0.37
        if rank == culprit:
            out += ["Traceback (most recent call last):", '  File "/opt/train/trainer.py", line 530, in <module>',
                    "    batch = next(it)",
                    f"RuntimeError: DataLoader worker (pid {pid + 7}) is killed by signal: Killed."]  # fmt: skip
        else:
            stamp = time.strftime("%m%d %H:%M:%S", time.gmtime(t + 600))
            out.append(f"[rank{rank}]:[E{stamp}.{rng.randrange(10**6):06d} {pid} ProcessGroupNCCL.cpp:616] "
                       f"[Rank {rank}] Watchdog caught collective operation timeout: WorkNCCL(SeqNum={step}, "
                       "OpType=ALLREDUCE, NumelIn=16777216, NumelOut=16777216, Timeout(ms)=600000) ran for 600043 "
                       "milliseconds before timing out.")  # fmt: skip
    return ("\n".join(out) + "\n").encode()


def write_run(folder: Path, *, mb: float, ranks: int, seed: int, failed: bool, culprit: int) -> int:
    per = int(mb * 1e6 / ranks)
    total = 0
    for r in range(ranks):
        d = folder / "attempt_0" / str(r)
        d.mkdir(parents=True, exist_ok=True)
        data = rank_log(r, ranks, per, seed, failed=failed, culprit=culprit)
        (d / "stderr.log").write_bytes(data)
        total += len(data)
    return total


def measure(failed: Path, good: Path, culprit: int) -> dict:
    """In this (fresh) process: the comparison alone, its peak RSS."""
    from elastic_diag.offline.divergence import find_novel, first_divergences, learn

    start = time.perf_counter()
    cpu0 = time.process_time()
    side = learn([good])
    novel = find_novel([failed], side)
    rows = first_divergences(novel, {}, culprit)
    secs = time.perf_counter() - start
    cpu = time.process_time() - cpu0
    mb = (side.n_bytes + novel.side.n_bytes) / 1e6
    lines = side.lines + novel.side.lines
    top = rows[0] if rows else {}
    return {"mb": round(mb, 1), "lines": lines, "seconds": round(secs, 2), "cpu_seconds": round(cpu, 2),
            "mb_per_s": round(mb / secs, 1), "lines_per_s": round(lines / secs), "good_templates": len(side.templates),
            "failed_templates": novel.templates_seen, "novel_templates": len(novel.count),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "planted_first": bool(top) and top["rank"] == culprit and "checksum mismatch" in top["text"],
            "first": {k: top.get(k) for k in ("rank", "line", "text", "level", "ranks_printing")}}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=200.0, help="MB per run (default 200)")
    ap.add_argument("--ranks", type=int, default=256)
    ap.add_argument("--culprit", type=int, default=137)
    ap.add_argument("--keep", type=Path, help="write the runs here and keep them")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--full", action="store_true", help="also time the whole `elastic-diag analyze --known-good`")
    ap.add_argument("--measure", nargs=2, metavar=("FAILED", "GOOD"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.measure:
        print(json.dumps(measure(Path(a.measure[0]), Path(a.measure[1]), a.culprit)))
        return 0
    tmp = Path(tempfile.mkdtemp(prefix="known-good-")) if a.keep is None else a.keep
    try:
        t = time.perf_counter()
        good_bytes = write_run(tmp / "good", mb=a.mb, ranks=a.ranks, seed=1, failed=False, culprit=a.culprit)
        bad_bytes = write_run(tmp / "failed", mb=a.mb, ranks=a.ranks, seed=2, failed=True, culprit=a.culprit)
        print(f"wrote {good_bytes / 1e6:.0f} MB good + {bad_bytes / 1e6:.0f} MB failed, {a.ranks} ranks, in "
              f"{time.perf_counter() - t:.0f} s ({tmp})")  # fmt: skip
        run = subprocess.run([sys.executable, __file__, "--culprit", str(a.culprit), "--measure", str(tmp / "failed"),
                              str(tmp / "good")], capture_output=True, text=True, check=True)  # fmt: skip
        out = json.loads(run.stdout)
        print(f"comparison: {out['mb']} MB ({out['lines']:,} lines) in {out['seconds']} s: {out['mb_per_s']} MB/s, "
              f"{out['lines_per_s']:,} lines/s on one core (logreduce documents about 2,000 lines/s to learn, 1,300 "
              f"to test: {out['lines_per_s'] / 1300:,.0f}x); peak RSS {out['peak_rss_mb']} MB; templates: "
              f"{out['good_templates']} good, {out['failed_templates']} failed, "
              f"{out['novel_templates']} novel")  # fmt: skip
        print(f"first divergence: rank {out['first']['rank']} line {out['first']['line']}: {out['first']['text']!r} "
              f"-> planted line {'FOUND first' if out['planted_first'] else 'NOT first'}")  # fmt: skip
        if a.full:
            t = time.perf_counter()
            full = subprocess.run([sys.executable, "-m", "elastic_diag", "analyze", str(tmp / "failed"), "--json",
                                   "--known-good", str(tmp / "good")], capture_output=True, text=True)  # fmt: skip
            out["full_seconds"] = round(time.perf_counter() - t, 1)
            data = json.loads(full.stdout)
            rows = data.get("first_divergence") or [{}]
            out["full_first_rank"] = rows[0].get("rank")
            print(f"analyze --known-good (both analyses and the comparison): {out['full_seconds']} s; verdict "
                  f"rank {data['diagnosis'].get('initiating_rank')}, first divergence rank "
                  f"{out['full_first_rank']}")  # fmt: skip
        ok = out["planted_first"] and out["mb_per_s"] >= 100 and out["peak_rss_mb"] < 500
        if a.json:
            a.json.write_text(json.dumps(out, indent=2) + "\n")
        return 0 if ok else 1
    finally:
        if a.keep is None:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
