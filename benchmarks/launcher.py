"""Launcher benchmarks (not a timed test): prints figures and ratios.

    python benchmarks/launcher.py overhead [--rounds 6] [--steps 60] [--against torchrun|no-health]
    python benchmarks/launcher.py latency [--repeats 2]
    python benchmarks/launcher.py beacon-cost
    python benchmarks/launcher.py phases [--pairs 10] [--steps 400] [--nproc 4]

beacon-cost: in one process, the progress beacon's added work measured directly: a tiny model's
backward + optimizer step with and without the beacon's hooks (interleaved blocks), and the CPU
time of one beacon tick (progress.json written, flight-recorder status read).

overhead: a healthy 4-rank CPU DDP run of examples/train_ddp.py under plain torchrun and under
torchrun-diag, interleaved in ABBA order (plain, diag, diag, plain, ...) so that drift of the
machine cancels, each rank appending its step times; the median step time after a warm-up of 5
steps, per launcher, their ratio, the ratio of the per-round medians' median, and each round's ratio
(its two runs back to back) with their median and a 90% bootstrap interval of it. With
``--against no-health`` the baseline is torchrun-diag itself with ``--diag-hang-timeout off
--diag-stall-timeout off`` (no health monitor in the agent, no progress beacon in the workers): the
health monitor's own cost, stall watch included. The
agent's own CPU time (all its threads, not its workers) is printed for each launcher.

phases: the whole-run wall time of a short healthy DDP job (400 steps of a few ms: no step sleep,
width 64) under plain torchrun and torchrun-diag, interleaved pairs (the order alternates), and the
phases a user waits for, timed from outside on the console: launcher start to the first rank's first
step line, first to last step line (training), last step line to the launcher's exit (the tail:
the ranks' exit, the report, the teardown); with each run's CPU seconds (launcher and workers); the
median of the per-pair ratios of the whole run, with a 90% bootstrap interval of it.

latency: for each crash class, the culprit writes time.time() just before failing (--mark-file);
this process polls <diag-dir>/report.json every 5 ms and notes when a failed verdict naming the
culprit is on disk. Prints the latency beside the configured grace.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_ddp.py"
COMMON = ["--standalone", "--nproc-per-node", "4"]
WARMUP = 5


def _run(argv: list[str], timeout: float = 300) -> int:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, timeout=timeout,
                          cwd=ROOT).returncode  # fmt: skip


def _median_interval(values: list[float], level: float = 0.9, resamples: int = 4000) -> tuple[float, float]:
    """A bootstrap interval of the median (percentile method, a fixed seed): how far the noise of a
    two-core machine running four ranks leaves the median of per-round ratios uncertain."""
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    cut = int(resamples * (1 - level) / 2)
    return medians[cut], medians[-cut - 1]


def _step_times(path: Path) -> list[float]:
    out = []
    for line in path.read_text().splitlines():
        _rank, step, secs = line.split()
        if int(step) >= WARMUP:
            out.append(float(secs))
    return out


# Runs the launcher in this process's child and writes the launcher process's own CPU seconds (all its
# threads: the agent, its health monitor, exit watchers and log tailers; not the workers) to argv[1].
_CPU_WRAPPER = (
    "import atexit, resource, runpy, sys\n"
    "out = sys.argv.pop(1); module = sys.argv.pop(1)\n"
    "def w():\n"
    "    u = resource.getrusage(resource.RUSAGE_SELF)\n"
    "    open(out, 'w').write(repr(u.ru_utime + u.ru_stime))\n"
    "atexit.register(w)\n"
    "sys.argv[0] = module\n"
    "runpy.run_module(module, run_name='__main__', alter_sys=True)\n"
)


def overhead(rounds: int, steps: int, width: int, against: str) -> None:
    diag = [sys.executable, "-c", _CPU_WRAPPER]
    if against == "torchrun":
        launchers = {"torchrun": (["torch.distributed.run"], False), "torchrun-diag": (["elastic_diag.run"], True)}
    else:
        launchers = {
            "diag, health off": (
                ["elastic_diag.run", "--diag-hang-timeout", "off", "--diag-stall-timeout", "off"],
                True,
            ),
            "torchrun-diag": (["elastic_diag.run"], True),
        }
    base, subject = list(launchers)
    samples: dict[str, list[float]] = {k: [] for k in launchers}
    cpu: dict[str, list[float]] = {k: [] for k in launchers}
    with tempfile.TemporaryDirectory() as tmp:
        order = list(launchers)
        per_round: dict[str, list[float]] = {k: [] for k in launchers}
        for r in range(rounds):
            for name in order if r % 2 == 0 else order[::-1]:
                (module, *opts), is_diag = launchers[name]
                times = Path(tmp) / f"{r}-{len(samples[name])}-{name.replace(' ', '_')}.txt"
                cpu_file = Path(tmp) / f"{times.stem}.cpu"
                extra = ["--diag-dir", str(Path(tmp) / f"diag-{times.stem}")] if is_diag else []
                rc = _run([*diag, str(cpu_file), module, *opts, *COMMON, *extra, str(EXAMPLE), "--steps", str(steps),
                           "--step-sleep", "0", "--width", str(width), "--step-times", str(times)])  # fmt: skip
                if rc != 0:
                    sys.exit(f"{name} round {r} failed with exit {rc}")
                samples[name].extend(_step_times(times))
                med = statistics.median(_step_times(times))
                per_round[name].append(med)
                cpu[name].append(float(cpu_file.read_text()))
                print(f"round {r} {name:18} median step {med * 1e3:.3f} ms, launcher CPU {cpu[name][-1]:.2f} s",
                      flush=True)  # fmt: skip
    med = {k: statistics.median(v) for k, v in samples.items()}
    ratio = med[subject] / med[base]
    print(
        f"median step time: {base} {med[base] * 1e3:.3f} ms, {subject} {med[subject] * 1e3:.3f} ms "
        f"({len(samples[base])} / {len(samples[subject])} samples)"
    )
    target = "1.02" if against == "torchrun" else "1.01"
    print(f"overhead ratio ({subject} / {base}), all steps: {ratio:.4f}  (target <= {target})")
    round_ratio = statistics.median(per_round[subject]) / statistics.median(per_round[base])
    print(f"overhead ratio, median of per-round medians: {round_ratio:.4f}")
    paired = [s / b for s, b in zip(per_round[subject], per_round[base], strict=True)]
    low, high = _median_interval(paired)
    print(
        f"per-round ratios: {', '.join(f'{r:.3f}' for r in paired)}; median {statistics.median(paired):.4f}, "
        f"90% bootstrap interval {low:.4f}..{high:.4f}"
    )
    for name in launchers:
        print(f"launcher process CPU ({name}): median {statistics.median(cpu[name]):.2f} s per run")


def beacon_cost(steps: int = 3000) -> None:
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from elastic_diag.worker import beacon

    with tempfile.TemporaryDirectory() as tmp, open(Path(tmp) / "stacks.txt", "w") as stacks:
        model = torch.nn.Linear(8, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        x = torch.randn(4, 8)

        def block(n: int) -> float:
            t0 = time.perf_counter()
            for _ in range(n):
                loss = model(x).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
            return (time.perf_counter() - t0) / n

        original = torch.Tensor.backward
        b = beacon.Beacon(tmp, 0.5, stacks)
        b._install_torch_hooks()
        wrapped = torch.Tensor.backward
        plain, hooked = [], []
        for _ in range(10):  # interleaved blocks: plain, hooked, plain, ...
            torch.Tensor.backward = original
            b.step_hook.remove()
            plain.append(block(steps // 10))
            torch.Tensor.backward = wrapped
            b.step_hook = register_optimizer_step_post_hook(b._on_step)
            hooked.append(block(steps // 10))
        torch.Tensor.backward = original
        b.step_hook.remove()
        c0 = time.process_time()
        for _ in range(200):
            b.tick()
        tick = (time.process_time() - c0) / 200
    added = statistics.median(hooked) - statistics.median(plain)
    print(
        f"tiny step: {statistics.median(plain) * 1e6:.1f} us plain, {statistics.median(hooked) * 1e6:.1f} us with "
        f"the optimizer-step hook and the backward wrapper: {added * 1e6:+.1f} us per step"
    )
    print(f"one beacon tick: {tick * 1e6:.1f} us CPU; at 2 ticks/s: {tick * 2 * 100:.4f}% of one core per rank")
    print(f"on the 52 ms step of the overhead benchmark: {(added / 0.052 + tick * 2) * 100:.3f}% added per rank")


def _watch_report(path: Path, culprit: int, seen: dict[str, float], stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            d = json.loads(path.read_text())["diagnosis"]
            if d.get("initiating_rank") == culprit and d.get("failure_class") not in (None, "healthy"):
                seen["t"] = time.time()
                return
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.005)


def latency(repeats: int, grace: float) -> None:
    culprit = 2
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for inject in ("exception", "segfault", "sigkill", "exit", "memoryerror"):
            for i in range(repeats):
                diag = Path(tmp) / f"{inject}-{i}"
                mark = Path(tmp) / f"{inject}-{i}.mark"
                seen: dict[str, float] = {}
                stop = threading.Event()
                watcher = threading.Thread(target=_watch_report, args=(diag / "report.json", culprit, seen, stop))
                watcher.start()
                _run([sys.executable, "-m", "elastic_diag.run", *COMMON, "--diag-dir", str(diag), "--diag-grace",
                      str(grace), str(EXAMPLE), "--inject", inject, "--culprit-rank", str(culprit),
                      "--mark-file", str(mark)])  # fmt: skip
                stop.set()
                watcher.join()
                failed_at = float(mark.read_text())
                lat = seen["t"] - failed_at if "t" in seen else float("nan")
                rows.append((inject, lat))
                print(f"{inject:12} run {i}: verdict on disk {lat:.3f} s after the failure", flush=True)
    worst = max(lat for _, lat in rows)
    print(
        f"grace {grace:.1f} s; worst detection latency {worst:.3f} s; beyond grace {worst - grace:+.3f} s "
        f"(target <= +1 s); median {statistics.median(lat for _, lat in rows):.3f} s"
    )


HEALTHY_JOB = ROOT / "benchmarks" / "jobs" / "healthy_ddp.py"
# the launcher runs in this wrapper, which writes its own CPU seconds (all its threads) and its children's
# (the workers: they are the launcher's children, reaped by it) to argv[1] when it exits
_CPU_SPLIT_WRAPPER = (
    "import atexit, resource, runpy, sys\n"
    "out = sys.argv.pop(1); module = sys.argv.pop(1)\n"
    "def w():\n"
    "    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)\n"
    "    open(out, 'w').write(repr((s.ru_utime + s.ru_stime, c.ru_utime + c.ru_stime)))\n"
    "atexit.register(w)\n"
    "sys.argv[0] = module\n"
    "runpy.run_module(module, run_name='__main__', alter_sys=True)\n"
)


_PHASE_LINE = re.compile(r"phase (start|joined|done) (\d+\.\d+)")


def _watch_workers(pid: int, exits: dict[int, float], stop: threading.Event) -> None:
    """The launcher's children (its workers) and the moment each one exits (a zombie, or gone)."""
    while not stop.is_set():
        try:
            kids = {int(k) for t in os.listdir(f"/proc/{pid}/task")
                    for k in Path(f"/proc/{pid}/task/{t}/children").read_text().split()}  # fmt: skip
        except OSError:
            kids = set()
        for k in kids:
            exits.setdefault(k, 0.0)
        for k, t in list(exits.items()):
            if t == 0.0:
                try:
                    state = Path(f"/proc/{k}/stat").read_text().rsplit(")", 1)[1].split()[0]
                except (OSError, IndexError):
                    state = "X"
                if state in ("Z", "X"):
                    exits[k] = time.time()
        time.sleep(0.01)


def _timed_run(argv: list[str], steps: int, nproc: int, cpu_file: Path, diag: Path | None = None) -> dict[str, float]:
    """One run of benchmarks/jobs/healthy_ddp.py; the phases from the times the ranks print (their
    ``phase start/joined/done`` lines), the moments the worker processes exit and the launcher's own start
    and exit; the CPU seconds of the launcher and of its workers, and (torchrun-diag) of each worker's
    bootstrap and beacon thread, from its evidence folder."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.time()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
    exits: dict[int, float] = {}
    stop = threading.Event()
    watcher = threading.Thread(target=_watch_workers, args=(proc.pid, exits, stop), daemon=True)
    watcher.start()
    marks: dict[str, list[float]] = {"start": [], "joined": [], "done": []}
    last_step = None
    tail: deque[str] = deque(maxlen=40)
    assert proc.stdout is not None
    for line in proc.stdout:
        tail.append(line)
        for what, when in _PHASE_LINE.findall(line):  # two ranks' lines can share one console line
            marks[what].append(float(when))
        if f"step {steps - 1} loss" in line:
            last_step = time.time()
    code = proc.wait()
    end = time.time()
    stop.set()
    watcher.join()
    worker_exits = [t for t in exits.values() if t > 0.0]
    if code != 0 or last_step is None or any(len(v) != nproc for v in marks.values()) or len(worker_exits) < nproc:
        kept = ""
        if diag is not None and diag.is_dir():  # the evidence outlives the benchmark's temporary folder
            copy = shutil.copytree(diag, Path(tempfile.mkdtemp(prefix="phases-failed-")) / "diag")
            kept = f", evidence kept in {copy}"
        raise SystemExit(f"{' '.join(argv[3:5])}: exit {code}, phase lines {marks}, last step line at {last_step}, "
                         f"worker exits {exits}{kept}; its last lines:\n{''.join(tail)}")  # fmt: skip
    launcher_cpu, workers_cpu = ast.literal_eval(cpu_file.read_text())
    out = {
        "start": min(marks["start"]) - t0,
        "rendezvous": max(marks["joined"]) - min(marks["start"]),
        "training": max(marks["done"]) - max(marks["joined"]),
        "rank_exit": max(worker_exits) - max(marks["done"]),
        "launcher_tail": end - max(worker_exits),
        "total": end - t0,
        "launcher_cpu": launcher_cpu,
        "worker_cpu": workers_cpu / nproc,
    }
    if diag is not None:
        boot = [json.loads(p.read_text()).get("bootstrap_cpu_s") for p in diag.glob("attempt_0/rank_*/worker.json")]
        beacon = [json.loads(p.read_text()).get("beacon_cpu_s") for p in diag.glob("attempt_0/rank_*/progress.json")]
        for key, values in (("bootstrap_cpu", boot), ("beacon_cpu", beacon)):  # no beacon with the monitors off
            if measured := [v for v in values if isinstance(v, float)]:
                out[key] = statistics.median(measured)
    return out


PHASES = {
    "start": "launcher start -> first rank's first line",
    "rendezvous": "first rank's first line -> last rank joined",
    "training": "last rank joined -> last rank done",
    "rank_exit": "last rank done -> last rank's process exit",
    "launcher_tail": "last rank's exit -> launcher exit",
    "total": "whole run",
    "launcher_cpu": "launcher CPU seconds (all its threads)",
    "worker_cpu": "CPU seconds per worker",
    "bootstrap_cpu": "  of which the bootstrap (median rank)",
    "beacon_cpu": "  of which the beacon thread (median rank)",
}


def phases(pairs: int, steps: int, nproc: int) -> None:
    job = [str(HEALTHY_JOB), "--steps", str(steps)]
    common = ["--standalone", "--nproc-per-node", str(nproc)]
    results: dict[str, list[dict[str, float]]] = {"torchrun": [], "torchrun-diag": []}
    with tempfile.TemporaryDirectory() as tmp:
        cpu_file = Path(tmp) / "cpu.txt"
        wrapper = [sys.executable, "-c", _CPU_SPLIT_WRAPPER, str(cpu_file)]
        for i in range(pairs):
            diag = Path(tmp) / f"run{i}"
            launchers = {
                "torchrun": [*wrapper, "torch.distributed.run", *common, *job],
                "torchrun-diag": [*wrapper, "elastic_diag.run", *common, "--diag-dir", str(diag), *job],
            }
            order = ["torchrun", "torchrun-diag"] if i % 2 == 0 else ["torchrun-diag", "torchrun"]
            for name in order:
                results[name].append(_timed_run(launchers[name], steps, nproc, cpu_file,
                                                diag if name == "torchrun-diag" else None))  # fmt: skip
            print(f"pair {i + 1}/{pairs}: " + ", ".join(f"{n} {results[n][-1]['total']:.2f} s" for n in order),
                  flush=True)  # fmt: skip
    ratios = [d["total"] / p["total"] for p, d in zip(results["torchrun"], results["torchrun-diag"], strict=True)]
    print(f"\n{nproc} ranks, {steps} steps, {pairs} interleaved pairs; medians, seconds")
    print(f"{'phase':<46}{'torchrun':>10}{'torchrun-diag':>15}{'diff':>8}")
    for key, label in PHASES.items():
        if not (diag_values := [r[key] for r in results["torchrun-diag"] if key in r]):
            continue
        b = statistics.median(diag_values)
        if key not in results["torchrun"][0]:
            print(f"{label:<46}{'':>10}{b:>15.3f}")
            continue
        a = statistics.median(r[key] for r in results["torchrun"])
        print(f"{label:<46}{a:>10.2f}{b:>15.2f}{b - a:>+8.2f}")
    low, high = _median_interval(ratios)
    print(f"median ratio of the whole run (per pair): {statistics.median(ratios):.3f} (target <= 1.02), "
          f"90% bootstrap interval {low:.3f}..{high:.3f}; pairs: {', '.join(f'{r:.3f}' for r in ratios)}")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    o = sub.add_parser("overhead")
    o.add_argument("--rounds", type=int, default=6)
    o.add_argument("--steps", type=int, default=60)
    o.add_argument("--width", type=int, default=1024)
    o.add_argument("--against", choices=("torchrun", "no-health"), default="torchrun")
    sub.add_parser("beacon-cost")
    ph = sub.add_parser("phases")
    ph.add_argument("--pairs", type=int, default=10)
    ph.add_argument("--steps", type=int, default=400)
    ph.add_argument("--nproc", type=int, default=4)
    lat = sub.add_parser("latency")
    lat.add_argument("--repeats", type=int, default=2)
    lat.add_argument("--grace", type=float, default=5.0)
    a = p.parse_args()
    if a.what == "overhead":
        overhead(a.rounds, a.steps, a.width, a.against)
    elif a.what == "beacon-cost":
        beacon_cost()
    elif a.what == "phases":
        phases(a.pairs, a.steps, a.nproc)
    else:
        latency(a.repeats, a.grace)


if __name__ == "__main__":
    main()
