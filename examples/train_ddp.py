"""A small CPU DDP training run (gloo) that can inject one failure on one rank.

    torchrun-diag --standalone --nproc-per-node 4 examples/train_ddp.py --inject exception --culprit-rank 2

``--inject`` chooses what the culprit rank does at ``--at-step``; every other rank trains on and
meets the consequences in its next collective, as in a real job. ``--mark-file`` makes the culprit
write the wall-clock time of its failure first (the detection-latency benchmark reads it).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import queue
import re
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

INJECTIONS = (
    "none",
    "exception",
    "exception-after-cleanup",
    "segfault",
    "sigkill",
    "exit",
    "memoryerror",
    "hang",
    "transient",
    "deadlock",
    "infinite-loop",
    "skip-collective",
    "extra-collective",
    "shape-mismatch",
    "unused-layer",
    "straggler",
    "slow-first-step",
    "regex-hang",
)
# These change what the culprit does from --at-step on, inside the training step (see train()).
IN_STEP = ("skip-collective", "extra-collective", "shape-mismatch", "unused-layer", "straggler", "slow-first-step")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--inject", choices=INJECTIONS, default="none")
    p.add_argument("--culprit-rank", type=int, default=1)
    p.add_argument("--at-step", type=int, default=3)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--width", type=int, default=64, help="hidden width of the model (compute per step)")
    p.add_argument("--step-sleep", type=float, default=0.05, help="extra seconds per step (simulated work)")
    p.add_argument("--pg-timeout", type=float, default=30.0, help="process-group (collective) timeout, seconds")
    p.add_argument("--cleanup-seconds", type=float, default=3.0, help="exception-after-cleanup: seconds of cleanup")
    p.add_argument("--mark-file", default=None, help="the culprit writes its failure time here first")
    p.add_argument("--step-times", default=None, help="append 'rank step seconds' lines here (benchmarks)")
    p.add_argument("--straggle-seconds", type=float, default=0.3, help="straggler: extra seconds per step")
    return p.parse_args()


def load_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.randn(64, 32, generator=g)
    return x, x.sum(dim=1, keepdim=True)


def inject(kind: str, args: argparse.Namespace) -> None:
    # A last word on stderr, as a real job's log would have before it dies (kept even after SIGKILL).
    print(f"rank {os.environ.get('RANK')}: step {args.at_step}: injecting {kind}", file=sys.stderr, flush=True)
    if args.mark_file:
        with open(args.mark_file, "w") as fp:
            fp.write(repr(time.time()))
    if kind == "exception" or (kind == "transient" and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"):
        raise ValueError(f"injected failure: bad batch at step {args.at_step}")
    if kind == "exception-after-cleanup":
        raise ValueError(f"injected failure: bad batch at step {args.at_step}")  # cleaned up in main()
    if kind == "segfault":
        ctypes.string_at(0)  # reads address 0: SIGSEGV in native code
    if kind == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "exit":
        os._exit(1)
    if kind == "memoryerror":
        _ = b"x" * (1 << 62)
    if kind == "hang":
        while True:  # stuck outside any collective; the peers wait in the next all_reduce
            time.sleep(0.5)
    if kind == "deadlock":
        deadlocked_loader()
    if kind == "infinite-loop":
        spin()
    if kind == "regex-hang":
        # catastrophic backtracking: the regex engine holds the GIL for hours, so no Python thread of
        # this process runs (only a signal handler written in C can still dump its stack)
        re.match(r"(a+)+$", "a" * 64 + "!")


def deadlocked_loader() -> None:
    """A prefetching loader thread that takes two locks in the opposite order to the main thread: the
    main thread then waits forever for a batch that never comes (a classic dataloader deadlock)."""
    batches: queue.Queue[int] = queue.Queue()
    a, b = threading.Lock(), threading.Lock()

    def loader() -> None:
        with b:
            time.sleep(0.2)
            with a:
                batches.put(1)

    threading.Thread(target=loader, name="prefetch", daemon=True).start()
    with a:
        time.sleep(0.1)
        with b:
            pass
    batches.get()


def spin() -> None:
    """A Python loop that never ends (a convergence loop whose condition is never met)."""
    x = 0.0
    while x >= 0:
        x = (x + 1.0) % 1000.0


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.pg_timeout))
    torch.manual_seed(0)
    w = args.width
    model = DDP(torch.nn.Sequential(torch.nn.Linear(32, w), torch.nn.ReLU(), torch.nn.Linear(w, w), torch.nn.ReLU(),
                                    torch.nn.Linear(w, 1)))  # fmt: skip
    failure: ValueError | None = None
    try:
        train(args, model)
    except ValueError as e:
        if args.inject != "exception-after-cleanup":
            raise
        failure = e
    if failure is not None:
        # A job's own cleanup (an emergency checkpoint, flushing logs) before re-raising. When the
        # peers fail first (their collective timed out, or they lost the connection), torchrun
        # SIGTERMs this rank mid-cleanup, loses its exception and blames a peer that only waited.
        # (With DDP alive, destroy_process_group() here would not close gloo's connections: the
        # peers notice only when this process exits. Measured on torch 2.13.0.)
        traceback.clear_frames(failure.__traceback__)
        time.sleep(args.cleanup_seconds)
        raise failure
    dist.destroy_process_group()


def train(args: argparse.Namespace, model: torch.nn.Module) -> None:
    rank = dist.get_rank()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    times = open(args.step_times, "a") if args.step_times else None  # noqa: SIM115
    for step in range(args.steps):
        t0 = time.perf_counter()
        if step == args.at_step and rank == args.culprit_rank and args.inject != "none":
            inject(args.inject, args)
        culprit = rank == args.culprit_rank and args.inject in IN_STEP
        x, y = load_batch(step, rank)
        if culprit and args.inject == "unused-layer" and step == args.at_step:
            # this rank's batch takes a path that skips the last layer: its gradients are never reduced
            loss = torch.nn.functional.mse_loss(model.module[:-1](x).sum(dim=1, keepdim=True), y)
        else:
            loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        mean_loss = loss.detach().reshape(1)
        if culprit and args.inject == "shape-mismatch" and step == args.at_step:
            mean_loss = torch.cat([mean_loss, mean_loss])  # this rank sends two values, the others one
        if culprit and args.inject == "extra-collective" and step == args.at_step:
            dist.all_reduce(torch.zeros(1))  # a metric computed on this rank only
        if not (culprit and args.inject == "skip-collective" and step == args.at_step):
            dist.all_reduce(mean_loss)  # the mean loss, for the log
        time.sleep(args.step_sleep)
        if culprit and args.inject == "straggler":
            time.sleep(args.straggle_seconds)
        if args.inject == "slow-first-step" and step == 0:
            time.sleep(args.straggle_seconds)
        if times is not None:
            times.write(f"{rank} {step} {time.perf_counter() - t0:.6f}\n")
        if rank == 0:
            print(f"step {step} loss {mean_loss[0].item() / dist.get_world_size():.4f}", flush=True)
    if times is not None:
        times.close()


if __name__ == "__main__":
    main()
