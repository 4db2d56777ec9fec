"""Offline analyzer benchmark (not a timed test): prints throughput, peak memory and the ratio to grep.

    python benchmarks/analyze.py [--ranks 1024] [--total-mb 1024] [--dir DIR] [--keep]
    python benchmarks/analyze.py --dense-lines 1000000 [--dir DIR]     # one console, every line holds an anchor
    python benchmarks/analyze.py --hostile [--total-mb 1024] [--dir DIR]  # inputs that must stay bounded

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
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


# Python logging WARNING lines and warnings.warn pairs as real training runs print them: (prefix,
# timestamp, step, rng) -> lines
_WARNINGS: list[Callable[[str, str, int, random.Random], list[str]]] = [
    lambda p, ts, step, rng: [
        f"{p}[{ts}] [WARNING] [stage3.py:2117:step] {rng.randrange(1, 9)} pytorch allocator cache flushes since "
        "last step. this happens when there is high memory pressure and is detrimental to performance. if this is "
        "happening frequently consider adjusting settings to reduce memory consumption. If you are unable to make "
        "the cache flushes go away consider adding get_accelerator().empty_cache() calls in your training loop to "
        "ensure that all ranks flush their caches at the same time\n"
    ],
    lambda p, ts, step, rng: [
        f"{p}{ts} - WARNING - data.dataset - sample {rng.randrange(10**6)} has {rng.randrange(4097, 9000)} tokens, "
        "truncated to 4096\n"
    ],
    lambda p, ts, step, rng: [
        f"{p}/opt/conda/lib/python3.11/site-packages/torch/utils/checkpoint.py:91: UserWarning: None of the inputs "
        "have requires_grad=True. Gradients will be None\n",
        f"{p}  warnings.warn(\n",
    ],
    lambda p, ts, step, rng: [
        f"{p}/opt/conda/lib/python3.11/site-packages/torch/amp/grad_scaler.py:132: FutureWarning: "
        "`torch.cuda.amp.GradScaler(args...)` is deprecated. Please use `torch.amp.GradScaler('cuda', args...)` "
        "instead.\n"
    ],
    lambda p, ts, step, rng: [
        f"{p}{ts} WARNING  transformers.modeling_utils: `use_cache=True` is incompatible with gradient "
        "checkpointing. Setting `use_cache=False`.\n"
    ],
    lambda p, ts, step, rng: [
        f"{p}WARNING:root:skipping batch {step}: {rng.randrange(1, 5)} samples empty after filtering\n"
    ],
    lambda p, ts, step, rng: [
        f"{p}[{ts}] [WARNING] [lr_schedules.py:683:step] Tried to get lr value before scheduler/optimizer started "
        "stepping, returning lr=0\n"
    ],
]
# NCCL_DEBUG=INFO messages of a communicator being set up: (rank, ranks, rng) -> the text after "NCCL INFO "
_NCCL_INFO: list[Callable[[int, int, random.Random], str]] = [
    lambda r, n, rng: (
        f"Channel {rng.randrange(32):02d}/0 : {r}[{r % 8}] -> {(r + 1) % n}[{(r + 1) % 8}] via P2P/CUMEM/read"
    ),
    lambda r, n, rng: (
        f"comm 0x{rng.randrange(1 << 40):x} rank {r} nranks {n} cudaDev {r % 8} nvmlDev {r % 8} "
        f"busId {18 + r % 8}000 commId 0x{rng.randrange(1 << 60):x} - Init COMPLETE"
    ),
    lambda r, n, rng: (
        "NET/Plugin: Plugin load (libnccl-net.so) returned 2 : libnccl-net.so: cannot open shared "
        "object file: No such file or directory : when loading libnccl-net.so"
    ),
    lambda r, n, rng: "Connected all rings, use ring PXN 0 GDR 1",
    lambda r, n, rng: (
        "24 coll channels, 24 collnet channels, 0 nvls channels, 32 p2p channels, 32 p2p channels per peer"
    ),
]


def _chatter_lines(rank: int, ranks: int, n: int, rng: random.Random, t0: float) -> list[str]:
    """``n`` lines of what a healthy rank of a real job prints, in the shares real runs show: Python
    logging INFO (trainer metrics, HF-style dicts) and WARNING lines (a quarter of all lines: DeepSpeed
    allocator flushes, truncation notices, transformers deprecations, ``warnings.warn`` pairs), NCCL
    INFO lines of new communicators, tqdm frames rewritten with ``\\r``, and a few harmless lines that
    say "error" (``error_rate``, ``dlerror``)."""
    p = f"[rank{rank}]:"
    host = f"node-{rank // 8:03d}"
    pid = 40000 + rank
    out: list[str] = []
    step = rng.randrange(1000)
    t = t0
    while len(out) < n:
        t += rng.uniform(0.05, 0.4)
        ts = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t)) + f",{int(t * 1000) % 1000:03d}"
        roll = rng.random()
        if roll < 0.34:  # WARNING: a quarter of all lines say WARNING
            out.extend(rng.choice(_WARNINGS)(p, ts, step, rng))
        elif roll < 0.42:  # NCCL_DEBUG=INFO: a communicator set up for a sub-group, every rank
            head = f"{p}{host}:{pid}:{pid + 61} [{rank % 8}] NCCL INFO "
            out.append(head + rng.choice(_NCCL_INFO)(rank, ranks, rng) + "\n")
        elif roll < 0.49:  # a tqdm bar: frames rewritten with \r, one physical line
            total = 1000
            frames = []
            for _ in range(rng.randrange(3, 8)):
                step += 1
                pct = step % total * 100 // total
                bar = "\u2588" * (pct // 10) + " " * (10 - pct // 10)
                frames.append(
                    f"Epoch 0:  {pct:3d}%|{bar}| {step % total}/{total} [{step // 60:02d}:{step % 60:02d}<"
                    f"07:38, {rng.uniform(1, 3):.2f}it/s, loss={rng.uniform(1, 3):.3f}, v_num=0]"
                )
            out.append(p + "\r" + "\r".join(frames) + "\n")
        elif roll < 0.54:  # HF Trainer's metrics dict
            out.append(
                f"{p}{{'loss': {rng.uniform(1, 3):.4f}, 'grad_norm': {rng.uniform(0.2, 2):.4f}, "
                f"'learning_rate': {rng.uniform(1, 3):.1e}, 'epoch': {step / 5000:.2f}}}\n"
            )
        elif roll < 0.543:  # harmless lines that say "error"
            out.append(
                f"{p}[{ts}] [INFO] [eval.py:88:evaluate] eval step={step} error_rate={rng.uniform(0, 0.05):.4f} "
                f"wer={rng.uniform(0, 0.2):.3f} grad_norm={rng.uniform(0.2, 2):.3f}\n"
            )
        else:  # INFO: the trainer's step line
            step += 1
            out.append(
                f"{p}[{ts}] [INFO] [trainer.py:412:train_step] step={step} loss={rng.uniform(1, 3):.4f} "
                f"lr=3.0e-04 grad_norm={rng.uniform(0.2, 2):.3f} tokens_per_s={rng.randrange(90000, 120000)} "
                f"mem_gb={rng.uniform(60, 70):.1f}\n"
            )
    return out


def _victim_end(rank: int, seq: int) -> str:
    """A waiting rank's last lines in torch 2.4+ wording: the watchdog's timeout, its bookkeeping, the
    abort and the C++ terminate of c10::DistBackendError."""
    p = f"[rank{rank}]:[E1129 10:42:01.{123456 + rank:09d} ProcessGroupNCCL.cpp"
    work = (
        f"WorkNCCL(SeqNum={seq}, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for "
        "600071 milliseconds before timing out."
    )
    return (
        f"{p}:632] [Rank {rank}] Watchdog caught collective operation timeout: {work}\n"
        f"{p}:2168] [PG ID 0 PG GUID 0(default_pg) Rank {rank}] failure detected by watchdog at work sequence id: "
        f"{seq} PG status: last enqueued work: {seq}, last completed work: {seq - 1}\n"
        f"{p}:667] Stack trace of the failed collective not found, potentially because FlightRecorder is disabled. "
        "You can enable it by setting TORCH_NCCL_TRACE_BUFFER_SIZE to a non-zero value.\n"
        f"{p}:681] [Rank {rank}] Some NCCL operations have failed or timed out. Due to the asynchronous nature of "
        "CUDA kernels, subsequent GPU operations might run on corrupted/incomplete data.\n"
        f"{p}:695] [Rank {rank}] To avoid data inconsistency, we are taking the entire process down.\n"
        f"[rank{rank}]:terminate called after throwing an instance of 'c10::DistBackendError'\n"
        f"[rank{rank}]:  what():  [PG ID 0 PG GUID 0(default_pg) Rank {rank}] Process group watchdog thread "
        f"terminated with exception: [Rank {rank}] Watchdog caught collective operation timeout: {work}\n"
    )


def _culprit_end(rank: int) -> str:
    p = f"[rank{rank}]:"
    return (
        f"{p}Traceback (most recent call last):\n"
        f'{p}  File "/opt/app/train.py", line 212, in train_step\n'
        f"{p}    loss.backward()\n"
        f'{p}  File "/opt/conda/lib/python3.11/site-packages/torch/_tensor.py", line 626, in backward\n'
        f"{p}    torch.autograd.backward(\n"
        f"{p}torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB. GPU {rank % 8} has a total "
        "capacity of 79.19 GiB of which 3.12 GiB is free. Including non-PyTorch memory, this process has 76.06 GiB "
        "memory in use.\n"
    )


def generate(folder: Path, ranks: int, total_mb: int, culprit: int) -> int:
    """The log set: ``ranks`` files of healthy chatter; every rank but the culprit ends in the
    watchdog's timeout, the culprit in a CUDA out-of-memory traceback."""
    folder.mkdir(parents=True, exist_ok=True)
    per_rank = total_mb * (1 << 20) // ranks
    total = 0
    t0 = 1796119200.0  # 2026-12-01 10:00 UTC
    for r in range(ranks):
        rng = random.Random(r)
        lines: list[str] = []
        size = 0
        while size < per_rank:
            block = _chatter_lines(r, ranks, 200, rng, t0 + len(lines))
            lines.extend(block)
            size += sum(len(x) for x in block) + 200  # multi-byte bar characters
        lines.append(_culprit_end(r) if r == culprit else _victim_end(r, 90210))
        data = "".join(lines).encode()
        (folder / f"rank_{r}.log").write_bytes(data)
        total += len(data)
    return total


# Lines that each carry an anchor word and that real runs print over and over (retry loops, warnings
# repeated every step, evaluation and datasets progress bars logged one frame a line): (rank, ts, n, rng)
_DENSE: list[Callable[[int, str, int, random.Random], str]] = [
    lambda r, ts, n, rng: (
        f"'(ReadTimeoutError(\"HTTPSConnectionPool(host='huggingface.co', port=443): Read timed out. (read "
        f"timeout=10)\"), '(Request ID: {rng.getrandbits(64):016x})')' thrown while requesting HEAD "
        "https://huggingface.co/meta-llama/Llama-3.1-8B/resolve/main/config.json"
    ),
    lambda r, ts, n, rng: "wandb: Network error (ReadTimeout), entering retry loop.",
    lambda r, ts, n, rng: (
        "wandb: ERROR Error while calling W&B API: An internal error occurred. Please contact support. "
        "(<Response [500]>)"
    ),
    lambda r, ts, n, rng: (
        f"[W{ts[5:7]}{ts[8:10]} {ts[11:19]}.{rng.randrange(10**6):06d} socket.cpp:752] [c10d] The client socket has "
        f"failed to connect to [node-{rng.randrange(8):03d}]:29500 (errno: 111 - Connection refused)."
    ),
    lambda r, ts, n, rng: (
        "Token indices sequence length is longer than the specified maximum sequence length for this model "
        f"({rng.randrange(1025, 4000)} > 1024). Running this sequence through the model will result in indexing errors"
    ),
    lambda r, ts, n, rng: (
        f"Evaluating: {n % 100:3d}%|{'#' * (n % 100 // 10):<10}| {n % 100}/100 [00:{n % 60:02d}<00:{59 - n % 60:02d}, "
        f"{rng.uniform(2, 4):.2f}it/s]"
    ),
    lambda r, ts, n, rng: (
        f"Map: {n % 100:3d}%|{'#' * (n % 100 // 10):<10}| {n % 100 * 1000}/100000 [00:{n % 60:02d}<00:"
        f"{59 - n % 60:02d}, {rng.uniform(3000, 4000):.2f} examples/s]"
    ),
    lambda r, ts, n, rng: (
        f"[{ts}] [WARNING] [webdataset] retrying shard s3://corpus/train/shard-{rng.randrange(10**5):05d}.tar after "
        "error: Connection reset by peer"
    ),
    lambda r, ts, n, rng: f"Exception ignored in: <function _ConnectionBase.__del__ at 0x7f{rng.getrandbits(40):010x}>",
    lambda r, ts, n, rng: (
        f"[{ts}] [INFO] [eval.py:88:evaluate] eval step={n} error_rate={rng.uniform(0, 0.05):.4f} "
        f"wer={rng.uniform(0, 0.2):.3f}"
    ),
]


def generate_dense(folder: Path, n_lines: int, ranks: int, culprit: int) -> int:
    """One console log of a torchrun job (``[rankN]:`` prefixes, the ranks' lines interleaved) of
    ``n_lines`` lines that each carry an anchor word, then the culprit's CUDA out-of-memory traceback and
    every other rank's watchdog timeout."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(7)
    t = 1796119200.0
    out: list[str] = []
    for n in range(n_lines):
        t += rng.uniform(0.0, 0.01)
        ts = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t)) + f",{int(t * 1000) % 1000:03d}"
        r = rng.randrange(ranks)
        out.append(f"[rank{r}]:" + rng.choice(_DENSE)(r, ts, n, rng) + "\n")
    out.append(_culprit_end(culprit))
    out.extend(_victim_end(r, 90210) for r in range(ranks) if r != culprit)
    data = "".join(out).encode()
    (folder / "console.log").write_bytes(data)
    return len(data)


def generate_hostile(folder: Path, size: int) -> dict[str, Path]:
    """Inputs that must stay bounded (peak RSS < 500 MB): one line of ``size`` bytes (a progress bar rewritten
    with ``\\r`` and never a newline) and then a rank's error, a ``[rank0]:`` prefix followed by an unterminated
    tail of ``size`` bytes, a rank number of a billion, and a .gz that expands about 1,000x to ``size`` bytes."""
    import gzip

    unit = b"Epoch 0:  45%|####5     | 450/1000 [00:12<00:15, 36.1it/s, loss=2.31, v_num=0]\r"
    block = unit * (8 * 1024 * 1024 // len(unit))

    def repeat(path: Path, head: bytes, tail: bytes) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            f.write(head)
            for _ in range(max(1, size // len(block))):
                f.write(block)
            f.write(tail)

    cases = {name: folder / name / "console.log" for name in ("one_line", "unterminated_tail", "rank_a_billion")}
    repeat(cases["one_line"], b"", b"\n[rank3]:RuntimeError: CUDA error: an illegal memory access was encountered\n")
    repeat(cases["unterminated_tail"], b"[rank1]:RuntimeError: boom from rank 1\n[rank0]:", b"")
    timeout = (
        "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, "
        "Timeout(ms)=600000) ran for 600071 milliseconds before timing out."
    )
    cases["rank_a_billion"].parent.mkdir(parents=True, exist_ok=True)
    cases["rank_a_billion"].write_text(
        "[rank1000000000]:RuntimeError: CUDA error: an illegal memory access was encountered\n"
        f"[rank0]:[Rank 0] {timeout}\n[rank999999999]:[Rank 999999999] {timeout}\n"
        "  rank      : 1000000000 (local_rank: 1000000000)\n  exitcode  : 1 (pid: 4242)\n"
    )
    bomb = folder / "gzip_bomb" / "console.log.gz"
    bomb.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(bomb, "wb", compresslevel=9) as f:
        line = b"[rank2]:" + b"." * (1 << 20) + b"\n"  # wget's progress dots: 1,000x
        for _ in range(max(1, size >> 20)):
            f.write(line)
        f.write(b"[rank2]:RuntimeError: the end\n")
    cases["gzip_bomb"] = bomb
    return cases


def _timed(argv: list[str], env: dict[str, str]) -> tuple[float, float, str]:
    """Wall seconds, peak RSS in MB of this child alone (os.wait4's rusage), stdout."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        p = subprocess.Popen(argv, stdout=out, stderr=err, env=env)
        _, status, usage = os.wait4(p.pid, 0)
        wall = time.perf_counter() - t0
        p.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        if p.returncode not in (0, 1):
            sys.exit(f"{argv[:4]} failed: {err.read().decode(errors='replace')[-2000:]}")
        return wall, usage.ru_maxrss / 1024, out.read().decode(errors="replace")


def _best(argv: list[str], env: dict[str, str], rounds: int) -> tuple[float, float, str]:
    """The fastest of ``rounds`` runs (wall seconds), its peak RSS in MB, and its stdout."""
    runs = [_timed(argv, env) for _ in range(rounds)]
    return min(runs, key=lambda r: r[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--total-mb", type=int, default=1024)
    ap.add_argument(
        "--dir",
        default=None,
        help="where to generate (default: a temporary folder); a folder that already holds the log set is reused",
    )
    ap.add_argument("--rounds", type=int, default=3, help="runs of each command; the fastest is printed")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument(
        "--dense-lines",
        type=int,
        default=0,
        help="instead: one console log of this many lines that each carry an anchor word (16 ranks)",
    )
    ap.add_argument(
        "--hostile",
        action="store_true",
        help="instead: the bounded-memory inputs (a line of --total-mb, a rank prefix and an unterminated tail, a "
        "rank of a billion, a 1,000x .gz), each analyzed once: time, peak RSS, what was noted",
    )
    a = ap.parse_args()
    folder = Path(a.dir) if a.dir else Path(tempfile.mkdtemp(prefix="elastic_diag_bench_"))
    if a.hostile:
        try:
            env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
            for name, path in generate_hostile(folder, a.total_mb << 20).items():
                wall, rss, out = _timed(
                    [sys.executable, "-m", "elastic_diag.cli", "analyze", "--json", str(path.parent)], env
                )
                d = json.loads(out)
                verdict = f"{d['diagnosis']['failure_class']} rank {d['diagnosis']['initiating_rank']}"
                print(f"{name}: {path.stat().st_size / 1e6:.0f} MB on disk, {wall:.2f} s, peak RSS {rss:.0f} MB "
                      f"(target < 500); verdict {verdict}; skipped: {d.get('skipped') or 'nothing'}")  # fmt: skip
        finally:
            if not a.keep and not a.dir:
                shutil.rmtree(folder, ignore_errors=True)
        return
    if a.dense_lines:
        a.ranks = 16
    culprit = min(a.ranks - 1, a.ranks // 2 + 225) if not a.dense_lines else 11
    pattern = "rank_*.log" if not a.dense_lines else "console.log"
    try:
        if len(list(folder.glob(pattern))) == (a.ranks if not a.dense_lines else 1):
            size = sum(p.stat().st_size for p in folder.glob(pattern))
            count = len(list(folder.glob(pattern)))
            print(f"reusing {count} file(s) in {folder}, {size / 1e6:.0f} MB; culprit rank {culprit}")
        else:
            t0 = time.perf_counter()
            if a.dense_lines:
                size = generate_dense(folder, a.dense_lines, a.ranks, culprit)
            else:
                size = generate(folder, a.ranks, a.total_mb, culprit)
            took = time.perf_counter() - t0
            print(f"generated {size / 1e6:.0f} MB in {took:.1f} s; culprit rank {culprit}")
        files = sorted(str(p) for p in folder.glob(pattern))
        pin = ["taskset", "-c", "0"] if shutil.which("taskset") else []
        subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)  # warm the page cache
        from elastic_diag.offline.files import ANCHORS, SUMMARY_MARKS, anchor_ere

        env = {**os.environ, "LC_ALL": "C", "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        mb = size / 1e6
        grep_s = _best([*pin, "grep", "-c", "Watchdog", *files], env, a.rounds)[0]
        same = "|".join(anchor_ere(x) for x in (*ANCHORS, *SUMMARY_MARKS))
        grep_all_s = _best([*pin, "grep", "-c", "-E", same, *files], env, a.rounds)[0]
        print(f"grep -c Watchdog, one core: {grep_s:.2f} s ({mb / grep_s:.0f} MB/s)")
        print(
            f"grep -c -E with the analyzer's {len(ANCHORS)} anchors, one core: {grep_all_s:.2f} s "
            f"({mb / grep_all_s:.0f} MB/s)"
        )
        analyze = [sys.executable, "-m", "elastic_diag.cli", "analyze", "--json", str(folder)]
        for engine in ("hyperscan", "grep", "python"):
            run_env = {**env, "ELASTIC_DIAG_PREFILTER": engine}
            check = subprocess.run(
                [
                    sys.executable,
                    "-c",
                    "from elastic_diag.offline.analyze import Analyzer; print(Analyzer().prefilter)",
                ],
                env=run_env,
                capture_output=True,
                text=True,
            )
            if check.stdout.strip() != engine:
                print(f"analyze, prefilter {engine}: not available here")
                continue
            rounds = a.rounds if engine != "python" else 1
            ana_s, rss_mb, out = _best([*pin, *analyze], run_env, rounds)
            d = json.loads(out)["diagnosis"]
            ok = d["initiating_rank"] == culprit and d["failure_class"] == "cuda_oom"
            print(
                f"elastic-diag analyze, prefilter {engine}, one core: {ana_s:.2f} s ({mb / ana_s:.0f} MB/s, "
                f"target >= 300), peak RSS {rss_mb:.0f} MB (target < 500), ratio to grep -c Watchdog "
                f"{ana_s / grep_s:.2f} (target <= 2), to grep -c -E with the same anchors {ana_s / grep_all_s:.2f}; "
                f"verdict rank {d['initiating_rank']} {d['failure_class']} ({'right' if ok else 'WRONG'})"
            )
        one_line = folder.parent / f"{folder.name}_startup"
        one_line.mkdir(exist_ok=True)
        (one_line / "console.log").write_text("[rank0]:step 1 loss 2.31\n")
        starts = sorted(_timed([*pin, *analyze[:-1], str(one_line)], env)[0] for _ in range(max(10, a.rounds)))
        shutil.rmtree(one_line, ignore_errors=True)
        print(
            f"start-up (analyze of a one-line log, one core): median {starts[len(starts) // 2]:.3f} s, fastest "
            f"{starts[0]:.3f} s of {len(starts)} (target <= 0.15)"
        )
        free_s = _best(analyze, {**env, "ELASTIC_DIAG_PREFILTER": "auto"}, a.rounds)[0]
        print(
            f"elastic-diag analyze, unpinned ({len(os.sched_getaffinity(0))} cores): {free_s:.2f} s "
            f"({mb / free_s:.0f} MB/s)"
        )
    finally:
        if not a.keep and not a.dir:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
