"""A small CPU FSDP2 (fully_shard) training run on gloo that can inject one failure on one rank.

    torchrun-diag --standalone --nproc-per-node 4 examples/train_fsdp2.py --inject nan --culprit-rank 2

Every failure class elastic_diag knows has an injection (examples/faults.py, shared with
train_ddp.py). FSDP2 makes some of them look different from DDP: ``--inject nan`` puts a NaN in the
culprit's batch at ``--at-step``, so its LOCAL loss goes NaN; the reduce-scatter averages the
gradients over every rank, so every rank's gradients are NaN and every rank raises in
``clip_grad_norm_(error_if_nonfinite=True)`` at the same step. Every rank reports the same error;
only the culprit's own loss was non-finite first. The desync injections act on the loss all_reduce
logged after each step, between FSDP's own all-gathers and reduce-scatters.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import faults  # noqa: E402  (examples/faults.py, beside this script)

INJECTIONS: dict[str, str] = dict(faults.INJECTIONS)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--inject", choices=INJECTIONS, default="none", metavar="KIND",
                   help="what the culprit does: " + faults.describe())  # fmt: skip
    p.add_argument("--culprit-rank", type=int, default=1)
    p.add_argument("--at-step", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--step-sleep", type=float, default=0.05, help="extra seconds per step (simulated work)")
    p.add_argument("--pg-timeout", type=float, default=30.0, help="process-group (collective) timeout, seconds")
    p.add_argument("--mark-file", default=None, help="the culprit writes its failure time here first")
    p.add_argument("--straggle-seconds", type=float, default=0.3, help="straggler: extra seconds per step")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    faults.before_init(args.inject, int(os.environ.get("RANK", "0")), args.culprit_rank, args.pg_timeout)
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.pg_timeout))
    rank = dist.get_rank()
    torch.manual_seed(0)
    w = args.width
    model = torch.nn.Sequential(torch.nn.Linear(32, w), torch.nn.ReLU(), torch.nn.Linear(w, w), torch.nn.ReLU(),
                                torch.nn.Linear(w, 1))  # fmt: skip
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(args.steps):
        at = step == args.at_step
        culprit = rank == args.culprit_rank
        if at and culprit and args.inject not in ("none", "late-join", *faults.IN_STEP):
            faults.inject_now(args.inject, step, args.mark_file, model)
        if at and culprit and args.inject in faults.IN_STEP:
            faults.announce(args.inject, step)
            faults.mark(args.mark_file)
        g = torch.Generator().manual_seed(step * 1000 + rank)
        x = torch.randn(16, 32, generator=g)
        y = x.sum(dim=1, keepdim=True)
        if at and culprit and args.inject == "nan":
            x[0, 0] = float("nan")  # one bad sample in this rank's batch
        if at and args.inject == "recv-deadlock":
            faults.recv_deadlock()  # every rank: each waits for the next, none sends
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
        opt.step()
        logged = loss.detach().reshape(1)
        if at and culprit and args.inject == "shape-mismatch":
            logged = torch.cat([logged, logged])  # this rank sends two values, the others one
        if at and culprit and args.inject == "extra-collective":
            dist.all_reduce(torch.zeros(1))  # a metric computed on this rank only
        if not (at and culprit and args.inject == "skip-collective"):
            dist.all_reduce(logged)  # the mean loss, for the log
        time.sleep(args.step_sleep + (args.straggle_seconds if culprit and args.inject == "straggler" else 0.0))
        if rank == 0:
            print(f"step {step} loss {logged[0].item() / dist.get_world_size():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
