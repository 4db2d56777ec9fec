"""A small CPU DDP training run (gloo) that can inject one failure on one rank.

    torchrun-diag --standalone --nproc-per-node 4 examples/train_ddp.py --inject exception --culprit-rank 2

``--inject`` chooses what the culprit rank does at ``--at-step``; every other rank trains on and
meets the consequences in its next collective, as in a real job. Every failure class elastic_diag
knows has an injection (examples/faults.py, shared with train_fsdp2.py), plus three that only DDP
has: ``exception-after-cleanup``, ``unused-layer`` and ``slow-first-step``. ``--mark-file`` makes the
culprit write the wall-clock time of its failure first (the detection-latency benchmark reads it).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import faults  # noqa: E402  (examples/faults.py, beside this script)

INJECTIONS: dict[str, str] = {
    **faults.INJECTIONS,
    "exception-after-cleanup": "python_exception",  # the job's own cleanup runs before it re-raises
    "unused-layer": "collective_desync",  # one rank's batch skips a layer: DDP's reducer waits forever
    "slow-first-step": "healthy",  # a slow warm-up is not a hang
}
# These change what the culprit does from --at-step on, inside the training step (see train()).
IN_STEP = (*faults.IN_STEP, "unused-layer", "slow-first-step")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--inject", choices=INJECTIONS, default="none", metavar="KIND",
                   help="what the culprit does: " + faults.describe() + "; exception-after-cleanup, unused-layer "
                   "(collective_desync), slow-first-step (healthy)")  # fmt: skip
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


def main() -> None:
    args = parse_args()
    faults.before_init(args.inject, int(os.environ.get("RANK", "0")), args.culprit_rank, args.pg_timeout)
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
        at = step == args.at_step
        if at and rank == args.culprit_rank and args.inject not in ("none", "late-join", *IN_STEP):
            if args.inject == "exception-after-cleanup":
                faults.announce(args.inject, step)
                faults.mark(args.mark_file)
                raise ValueError(f"injected failure: bad batch at step {step}")  # cleaned up in main()
            faults.inject_now(args.inject, step, args.mark_file, model)
        culprit = rank == args.culprit_rank and args.inject in IN_STEP
        if culprit and at:
            faults.announce(args.inject, step)
            faults.mark(args.mark_file)
        x, y = load_batch(step, rank)
        if culprit and args.inject == "nan" and at:
            x[0, 0] = float("nan")  # one bad sample in this rank's batch: its local loss goes NaN
        if args.inject == "recv-deadlock" and at:
            faults.recv_deadlock()  # every rank: each waits for the next, none sends
        if culprit and args.inject == "unused-layer" and at:
            # this rank's batch takes a path that skips the last layer: its gradients are never reduced
            loss = torch.nn.functional.mse_loss(model.module[:-1](x).sum(dim=1, keepdim=True), y)
        else:
            loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        if args.inject == "nan":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
        opt.step()
        mean_loss = loss.detach().reshape(1)
        if culprit and args.inject == "shape-mismatch" and at:
            mean_loss = torch.cat([mean_loss, mean_loss])  # this rank sends two values, the others one
        if culprit and args.inject == "extra-collective" and at:
            dist.all_reduce(torch.zeros(1))  # a metric computed on this rank only
        if not (culprit and args.inject == "skip-collective" and at):
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
