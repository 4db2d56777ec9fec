"""``elastic-diag exec`` benchmarks (not a timed test): prints figures and ratios.

    python benchmarks/exec.py overhead [--rounds 4] [--steps 40] [--nproc 4] [--width 1024]
    python benchmarks/exec.py latency [--repeats 2]

overhead: a healthy N-rank CPU DDP run of examples/train_ddp.py started by ``srun`` (on the two-node Slurm
of tests/slurm_cluster.py, started here) and by Open MPI's ``mpirun``, each rank plain and each rank under
``elastic-diag exec``, interleaved in ABBA order so that drift of the machine cancels; each rank appends
its step times; the median step after a warm-up of 5 steps, per variant, their ratio, and the ratio of
the per-round medians' median with a 90% bootstrap interval. Each watch process writes its own CPU
seconds and peak RSS when it exits (a wrapper: ``resource.getrusage(RUSAGE_SELF)``, its threads, not
the rank it watches).

latency: the culprit (rank 2 of 4) is SIGKILLed; it writes ``time.time()`` just before (--mark-file), and
this process polls ``<diag-dir>/report.json`` every 5 ms and notes when a failed verdict naming it is on
disk: under torchrun-diag, srun, mpirun and a parent that calls ``torch.multiprocessing.spawn``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "tests")]

from launcher import WARMUP, _median_interval, _step_times, _watch_report  # noqa: E402
from slurm_cluster import free_port, running_cluster  # noqa: E402

EXAMPLE = ROOT / "examples" / "train_ddp.py"
EXEC = [sys.executable, "-m", "elastic_diag.cli", "exec"]
RANK_VARS = {
    "srun": "RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID",
    "mpirun": "RANK=$OMPI_COMM_WORLD_RANK WORLD_SIZE=$OMPI_COMM_WORLD_SIZE LOCAL_RANK=$OMPI_COMM_WORLD_LOCAL_RANK",
}
# the watch runs in this wrapper, which writes its own CPU seconds and peak RSS (KiB) when it exits; the file
# name's {rank} is the launcher's rank variable
_WATCH_WRAPPER = (
    "import atexit, os, resource, runpy, sys\n"
    "out = sys.argv.pop(1); module = sys.argv.pop(1)\n"
    "rank = os.environ.get('SLURM_PROCID') or os.environ.get('OMPI_COMM_WORLD_RANK') or '0'\n"
    "def w():\n"
    "    u = resource.getrusage(resource.RUSAGE_SELF)\n"
    "    open(out.replace('{rank}', rank), 'w').write(repr((u.ru_utime + u.ru_stime, u.ru_maxrss)))\n"
    "atexit.register(w)\n"
    "sys.argv[0] = module\n"
    "runpy.run_module(module, run_name='__main__', alter_sys=True)\n"
)
SPAWN = (
    "import os, runpy, socket, sys\n"
    "import torch.multiprocessing as mp\n"
    "def run(i, argv, world, port):\n"
    "    os.environ.update(RANK=str(i), LOCAL_RANK=str(i), WORLD_SIZE=str(world), MASTER_ADDR='127.0.0.1',\n"
    "                      MASTER_PORT=str(port))\n"
    "    sys.argv = argv\n"
    "    runpy.run_path(argv[0], run_name='__main__')\n"
    "if __name__ == '__main__':\n"
    "    world = int(sys.argv[1]); argv = sys.argv[2:]\n"
    "    with socket.socket() as s:\n"
    "        s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]\n"
    "    mp.spawn(run, args=(argv, world, port), nprocs=world)\n"
)


def _env(**extra: str) -> dict[str, str]:
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")
    return {**{k: v for k, v in os.environ.items() if k not in drop}, "OMP_NUM_THREADS": "1", **extra}


def _command(launcher: str, nproc: int, rank_cmd: str, watch: list[str] | None, slurm_env: dict[str, str]) -> tuple[
        list[str], dict[str, str]]:  # fmt: skip
    inner = ["bash", "-c", f"{RANK_VARS[launcher]} exec {rank_cmd}"]
    prefix = watch or []
    if launcher == "srun":
        env = {**slurm_env, **_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))}
        return ["srun", "-N2", f"-n{nproc}", "-O", "--kill-on-bad-exit=1", *prefix, *inner], env
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        sys.exit("mpirun is missing: apt-get install openmpi-bin")
    argv = [mpirun, "--allow-run-as-root", "--oversubscribe", "-np", str(nproc), "-x", "MASTER_ADDR=127.0.0.1",
            "-x", f"MASTER_PORT={free_port()}", "-x", "OMP_NUM_THREADS=1", *prefix, *inner]  # fmt: skip
    return argv, _env()


def overhead(rounds: int, steps: int, nproc: int, width: int) -> None:
    job = f"{sys.executable} {EXAMPLE} --steps {steps} --step-sleep 0 --width {width}"
    with running_cluster(nodes=2) as slurm, tempfile.TemporaryDirectory() as tmp:
        for launcher in ("srun", "mpirun"):
            samples: dict[str, list[float]] = {"plain": [], "exec": []}
            per_round: dict[str, list[float]] = {"plain": [], "exec": []}
            watch_cpu: list[float] = []
            watch_rss: list[int] = []
            for r in range(rounds):
                for variant in ("plain", "exec") if r % 2 == 0 else ("exec", "plain"):
                    times = Path(tmp) / f"{launcher}-{r}-{variant}.txt"
                    usage = Path(tmp) / f"{launcher}-{r}-{variant}-watch-{{rank}}.txt"
                    watch = ([sys.executable, "-c", _WATCH_WRAPPER, str(usage), "elastic_diag.cli", "exec",
                              "--diag-dir", str(Path(tmp) / f"diag-{launcher}-{r}"), "--"]
                             if variant == "exec" else None)  # fmt: skip
                    argv, env = _command(launcher, nproc, f"{job} --step-times {times}", watch, slurm.env)
                    p = subprocess.run(argv, env=env, cwd=tmp, capture_output=True, text=True, timeout=600)
                    if p.returncode != 0:
                        sys.exit(f"{launcher} {variant} round {r} failed ({p.returncode}): {p.stderr[-2000:]}")
                    got = _step_times(times)
                    samples[variant].extend(got)
                    per_round[variant].append(statistics.median(got))
                    if variant == "exec":
                        for f in Path(tmp).glob(f"{launcher}-{r}-exec-watch-*.txt"):
                            cpu, rss = eval(f.read_text())  # noqa: S307 - our own wrapper's repr of two numbers
                            watch_cpu.append(cpu)
                            watch_rss.append(rss)
                    print(f"{launcher} round {r} {variant:5} median step {per_round[variant][-1] * 1e3:.3f} ms",
                          flush=True)  # fmt: skip
            med = {k: statistics.median(v) for k, v in samples.items()}
            ratios = [e / p for e, p in zip(per_round["exec"], per_round["plain"], strict=True)]
            lo, hi = _median_interval(ratios)
            print(f"{launcher}: {nproc} ranks, {rounds} rounds, {steps} steps each (first {WARMUP} dropped)")
            print(f"  median step: plain {med['plain'] * 1e3:.3f} ms, under elastic-diag exec "
                  f"{med['exec'] * 1e3:.3f} ms, ratio {med['exec'] / med['plain']:.4f}")  # fmt: skip
            print(f"  per-round ratios {[round(x, 3) for x in ratios]}, median {statistics.median(ratios):.4f} "
                  f"(90% interval {lo:.4f} to {hi:.4f})")  # fmt: skip
            print(f"  each watch: CPU {statistics.median(watch_cpu):.2f} s median ({min(watch_cpu):.2f} to "
                  f"{max(watch_cpu):.2f}), peak RSS {statistics.median(watch_rss) / 1024:.1f} MiB median "
                  f"({min(watch_rss) / 1024:.1f} to {max(watch_rss) / 1024:.1f})", flush=True)  # fmt: skip


def latency(repeats: int, nproc: int) -> None:
    culprit = 2
    job = f"{EXAMPLE} --inject sigkill --culprit-rank {culprit} --steps 12"
    rows: dict[str, list[float]] = {}
    with running_cluster(nodes=2) as slurm, tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "spawn.py").write_text(SPAWN)
        for i in range(repeats):
            for launcher in ("torchrun-diag", "srun", "mpirun", "mp.spawn"):
                diag = Path(tmp) / f"{launcher}-{i}"
                mark = Path(tmp) / f"{launcher}-{i}.mark"
                args = f"{job} --mark-file {mark}"
                if launcher == "torchrun-diag":
                    argv, env = [sys.executable, "-m", "elastic_diag.run", "--standalone", "--nproc-per-node",
                                 str(nproc), "--diag-dir", str(diag), *args.split()], _env()  # fmt: skip
                elif launcher == "mp.spawn":
                    argv, env = [*EXEC, "--diag-dir", str(diag), "--", sys.executable, str(Path(tmp) / "spawn.py"),
                                 str(nproc), *args.split()], _env()  # fmt: skip
                else:
                    argv, env = _command(launcher, nproc, f"{sys.executable} {args}",
                                         [*EXEC, "--diag-dir", str(diag), "--"], slurm.env)  # fmt: skip
                seen: dict[str, float] = {}
                stop = threading.Event()
                watcher = threading.Thread(target=_watch_report, args=(diag / "report.json", culprit, seen, stop))
                watcher.start()
                subprocess.run(argv, env=env, cwd=tmp, capture_output=True, timeout=300, check=False)
                stop.set()
                watcher.join()
                lat = seen["t"] - float(mark.read_text()) if "t" in seen and mark.exists() else float("nan")
                rows.setdefault(launcher, []).append(lat)
                print(f"{launcher:14} run {i}: a failed verdict naming rank {culprit} on disk {lat:.3f} s after its "
                      "death", flush=True)  # fmt: skip
    base = statistics.median(rows["torchrun-diag"])
    for launcher, lats in rows.items():
        med = statistics.median(lats)
        print(f"{launcher:14} median {med:.3f} s, worst {max(lats):.3f} s, {med / base:.2f}x torchrun-diag's")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    o = sub.add_parser("overhead")
    o.add_argument("--rounds", type=int, default=4)
    o.add_argument("--steps", type=int, default=40)
    o.add_argument("--nproc", type=int, default=4)
    o.add_argument("--width", type=int, default=1024)
    lat = sub.add_parser("latency")
    lat.add_argument("--repeats", type=int, default=2)
    lat.add_argument("--nproc", type=int, default=4)
    args = parser.parse_args()
    if args.what == "overhead":
        overhead(args.rounds, args.steps, args.nproc, args.width)
    else:
        latency(args.repeats, args.nproc)


if __name__ == "__main__":
    main()
