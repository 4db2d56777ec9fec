"""Stall benchmarks (not timed tests): print figures and distributions.

    python benchmarks/stall.py latency [--runs 10] [--variants sleep,lock,queue,gil,fsdp2-reduce-scatter]
    python benchmarks/stall.py no-false-kill
    python benchmarks/stall.py snapshot-cost [--dumps 40]

latency: benchmarks/jobs/stall_job.py under torchrun-diag, 3 ranks on gloo, collective timeout 300 s,
the stall threshold automatic (3x the median step, at least 5 s: 5 s here), the hang verdict at 15 s
(``--diag-hang-timeout 15``, so that each run ends in seconds rather than the automatic 60). The culprit
(rank 1) writes the wall-clock time at which it stops (``--mark-file``); this process polls for
``attempt_0/stall_1/stall.json`` every 5 ms (it is written once every rank's stacks and flight recorder
are on disk) and notes when it appears. Then the final verdict must name rank 1 and the culprit's line.

no-false-kill: healthy runs, 4 ranks, every threshold automatic: rank 0 spends 40 s in a checkpoint save
at step 5 while the others wait in the barrier after it (collective timeout 300 s); a 20 s first step on
every rank; a rank whose steps take 3x its peers'. Each must succeed; the save must give one stall
warning naming rank 0 and save_checkpoint.

snapshot-cost: in one process, what a snapshot costs the rank's main thread: a world of one on gloo with
2,000 collectives in its flight recorder, its beacon thread running, the main thread doing small steps
of work and timing each; the longest step while the beacon answers a dump request (stacks of all threads
and the flight recorder written), while faulthandler's signal dumps (the path of a silent beacon), and
while py-spy dumps its native stacks (it stops the process to read it), against the median step.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "benchmarks" / "jobs" / "stall_job.py"
CULPRIT = 1
VARIANTS: dict[str, tuple[list[str], str]] = {  # job arguments, the culprit's function the verdict must name
    "sleep": (["--stall", "sleep"], "stall_now"),
    "lock": (["--stall", "lock"], "stall_now"),
    "queue": (["--stall", "queue"], "in next"),
    "gil": (["--stall", "gil"], "stall_now"),
    "fsdp2-reduce-scatter": (["--fsdp2", "--stall", "reduce-scatter"], "stall_now"),
}
BUDGET_S = 15.0


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def _watch(path: Path, seen: dict[str, float], stop: threading.Event) -> None:
    while not stop.is_set():
        if path.exists():
            seen["t"] = time.time()
            return
        time.sleep(0.005)


def one_latency_run(tmp: Path, name: str, i: int) -> dict[str, object]:
    job_args, function = VARIANTS[name]
    diag, mark = tmp / f"{name}-{i}", tmp / f"{name}-{i}.mark"
    seen: dict[str, float] = {}
    stop = threading.Event()
    watcher = threading.Thread(target=_watch, args=(diag / "attempt_0" / "stall_1" / "stall.json", seen, stop))
    watcher.start()
    argv = [sys.executable, "-m", "elastic_diag.run", "--standalone", "--nproc-per-node", "3", "--diag-dir", str(diag),
            "--diag-hang-timeout", "15", str(JOB), *job_args, "--culprit-rank", str(CULPRIT), "--pg-timeout", "300",
            "--mark-file", str(mark)]  # fmt: skip
    try:
        subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_env(), timeout=240, cwd=ROOT)
    finally:
        stop.set()
        watcher.join()
    report = json.loads((diag / "report.json").read_text())
    d = report["diagnosis"]
    stall = json.loads((diag / "attempt_0" / "stall_1" / "stall.json").read_text()) if "t" in seen else {}
    files = stall.get("files", {})
    every_stack = len(files) == 3 and all("stacks.txt" in f for f in files.values())
    answered = [r["rank"] for r in stall.get("ranks", []) if r.get("beacon")]
    every_fr = all("fr_trace.json" in files.get(str(r), []) for r in answered)
    return {
        "latency": seen["t"] - float(mark.read_text()) if "t" in seen and mark.exists() else float("nan"),
        "right": d.get("initiating_rank") == CULPRIT and function in (d.get("summary") or ""),
        "rule": d.get("rule"),
        "stacks": every_stack,
        "frs": f"{sum(1 for r in answered if 'fr_trace.json' in files.get(str(r), []))}/{len(answered)}",
        "every_fr": every_fr,
        "took_s": stall.get("took_s"),
        "silent": [r["rank"] for r in stall.get("ranks", []) if r.get("beacon") is False],
    }


def latency(runs: int, variants: list[str]) -> None:
    results: dict[str, list[dict[str, object]]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(runs):
            for name in variants:  # interleaved: the machine's drift spreads over every variant
                r = one_latency_run(Path(tmp), name, i)
                results[name].append(r)
                print(f"{name:22} run {i}: stall record on disk {r['latency']:6.2f} s after the culprit stopped "
                      f"(snapshot {r['took_s']} s; stacks of every rank {r['stacks']}, flight recorders {r['frs']} "
                      f"of the beacons that answered; silent beacons {r['silent']}); verdict right {r['right']} "
                      f"({r['rule']})", flush=True)  # fmt: skip
    print(f"\nstall evidence latency (s), {runs} runs each, budget {BUDGET_S:.0f} s")
    every: list[float] = []
    for name, rows in results.items():
        lat = sorted(float(r["latency"]) for r in rows)  # type: ignore[arg-type]
        every.extend(lat)
        within = sum(1 for x in lat if x <= BUDGET_S)
        right = sum(1 for r in rows if r["right"])
        print(f"{name:22} min {lat[0]:5.2f}  median {statistics.median(lat):5.2f}  max {lat[-1]:5.2f}  "
              f"<= {BUDGET_S:.0f} s: {within}/{len(lat)}  verdict right: {right}/{len(rows)}  "
              f"all: {' '.join(f'{x:.2f}' for x in lat)}")  # fmt: skip
    within = sum(1 for x in every if x <= BUDGET_S)
    p90 = sorted(every)[int(0.9 * (len(every) - 1))]
    print(f"{'all':22} {within}/{len(every)} within {BUDGET_S:.0f} s ({100 * within / len(every):.0f}%, target >= "
          f"90%); median {statistics.median(every):.2f} s, p90 {p90:.2f} s")  # fmt: skip


def no_false_kill() -> None:
    cases = {
        "rank 0 saves 40 s at step 5": ["--stall", "save", "--save-seconds", "40", "--at-step", "5", "--steps", "10"],
        "20 s first step": ["--stall", "slow-first-step", "--first-step-seconds", "20", "--steps", "10"],
        "a 3x slower rank": ["--stall", "straggler", "--slow-factor", "3", "--steps", "40"],
    }
    with tempfile.TemporaryDirectory() as tmp:
        for label, job_args in cases.items():
            diag = Path(tmp) / label.replace(" ", "_")
            argv = [sys.executable, "-m", "elastic_diag.run", "--standalone", "--nproc-per-node", "4", "--diag-dir",
                    str(diag), str(JOB), *job_args, "--culprit-rank", "2", "--pg-timeout", "300"]  # fmt: skip
            started = time.monotonic()
            code = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_env(), timeout=600,
                                  cwd=ROOT).returncode  # fmt: skip
            report = json.loads((diag / "report.json").read_text())
            stalls = report["attempts"][-1].get("stalls", [])
            print(f"{label}: exit {code}, status {report['status']}, {time.monotonic() - started:.0f} s; "
                  f"stall records {len(stalls)} ({', '.join(s['outcome'] for s in stalls) or '-'}); hang verdict: "
                  f"{'hang' in report['attempts'][-1]}")  # fmt: skip
            for w in report["warnings"]:
                print(f"    warning ({w['class']}): {w['summary']}")


# --- what a snapshot costs the rank ------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _gaps_during(action: object, steps: list[float], lock: threading.Lock) -> float:
    """Run ``action()`` while the main thread's steps are timed (in another thread); the longest step seen
    from just before it to just after it."""
    with lock:
        start = len(steps)
    action()  # type: ignore[operator]
    time.sleep(0.05)
    with lock:
        window = steps[max(0, start - 1) :]
    return max(window) if window else float("nan")


def snapshot_cost(dumps: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1",
                      TORCH_FR_BUFFER_SIZE="2000")  # fmt: skip
    import faulthandler

    import torch
    import torch.distributed as dist

    from elastic_diag.agent.dumps import find_py_spy
    from elastic_diag.layout import DUMP_DONE_FILE, DUMP_REQUEST_FILE
    from elastic_diag.worker import beacon

    dist.init_process_group("gloo")
    t = torch.zeros(1000)
    for _ in range(2000):
        dist.all_reduce(t)
    fr_bytes = len(beacon.fr_trace_json() or b"")
    with tempfile.TemporaryDirectory() as tmp, open(Path(tmp) / "stacks.txt", "a") as stacks:
        faulthandler.register(signal.SIGURG, file=stacks, all_threads=True, chain=False)
        b = beacon.Beacon(tmp, 0.05, stacks)
        b.start()
        steps: list[float] = []
        lock = threading.Lock()
        done = threading.Event()
        a = torch.randn(64, 64)

        def work() -> None:  # the rank's main thread: small steps, each timed
            while not done.is_set():
                t0 = time.perf_counter()
                for _ in range(20):
                    a @ a
                with lock:
                    steps.append(time.perf_counter() - t0)

        worker = threading.Thread(target=work)
        worker.start()
        time.sleep(1.0)
        with lock:
            baseline = statistics.median(steps)

        def beacon_dump() -> None:
            rid = f"bench-{time.time()}"
            (Path(tmp) / DUMP_REQUEST_FILE).write_text(rid)
            deadline = time.time() + 5
            while time.time() < deadline:
                try:
                    if json.loads((Path(tmp) / DUMP_DONE_FILE).read_text()).get("id") == rid:
                        return
                except (OSError, ValueError):
                    pass
                time.sleep(0.002)

        def signal_dump() -> None:
            os.kill(os.getpid(), signal.SIGURG)

        py_spy = find_py_spy()

        def py_spy_dump() -> None:
            subprocess.run([py_spy or "py-spy", "dump", "--native", "--pid", str(os.getpid())], capture_output=True,
                           timeout=30, check=False)  # fmt: skip

        results: dict[str, list[float]] = {"beacon answers (stacks + flight recorder)": [],
                                           "faulthandler signal (silent beacon)": []}  # fmt: skip
        if py_spy is not None:
            results["py-spy dump --native"] = []
        actions = {"beacon answers (stacks + flight recorder)": beacon_dump,
                   "faulthandler signal (silent beacon)": signal_dump, "py-spy dump --native": py_spy_dump}  # fmt: skip
        for i in range(dumps):
            for name in results:
                if name.startswith("py-spy") and i >= max(5, dumps // 4):
                    continue  # a few suffice: each takes about a second
                results[name].append(_gaps_during(actions[name], steps, lock))
                time.sleep(0.1)
        done.set()
        worker.join()
        b.stop.set()
    dist.destroy_process_group()
    print(f"flight recorder: 2,000 entries, {fr_bytes / 1e6:.2f} MB of JSON; the main thread's step "
          f"{baseline * 1e3:.2f} ms")  # fmt: skip
    for name, gaps in results.items():
        extra = [max(0.0, g - baseline) * 1e3 for g in gaps]
        print(f"{name:45} main thread held up: median {statistics.median(extra):7.1f} ms, max {max(extra):7.1f} ms "
              f"({len(gaps)} snapshots)")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    lat = sub.add_parser("latency")
    lat.add_argument("--runs", type=int, default=10)
    lat.add_argument("--variants", default=",".join(VARIANTS))
    sub.add_parser("no-false-kill")
    cost = sub.add_parser("snapshot-cost")
    cost.add_argument("--dumps", type=int, default=40)
    a = p.parse_args()
    if a.what == "latency":
        latency(a.runs, [v for v in a.variants.split(",") if v])
    elif a.what == "no-false-kill":
        no_false_kill()
    else:
        snapshot_cost(a.dumps)


if __name__ == "__main__":
    main()
