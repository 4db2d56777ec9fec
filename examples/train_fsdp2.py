"""A small CPU FSDP2 (fully_shard) training run on gloo that can inject one failure on one rank.

    torchrun-diag --standalone --nproc-per-node 4 examples/train_fsdp2.py --inject nan --culprit-rank 2

``--inject nan``: the culprit's batch at ``--at-step`` holds a NaN, so its LOCAL loss goes NaN; the
reduce-scatter averages the gradients over every rank, so every rank's gradients are NaN and every
rank raises in ``clip_grad_norm_(error_if_nonfinite=True)`` at the same step. Every rank reports the
same error; only the culprit's own loss was non-finite first.
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

INJECTIONS = ("none", "nan", "exception")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--inject", choices=INJECTIONS, default="none")
    p.add_argument("--culprit-rank", type=int, default=1)
    p.add_argument("--at-step", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--pg-timeout", type=float, default=30.0, help="process-group (collective) timeout, seconds")
    return p.parse_args()


def main() -> None:
    args = parse_args()
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
        g = torch.Generator().manual_seed(step * 1000 + rank)
        x = torch.randn(16, 32, generator=g)
        y = x.sum(dim=1, keepdim=True)
        if step == args.at_step and rank == args.culprit_rank and args.inject != "none":
            print(f"rank {rank}: step {step}: injecting {args.inject}", file=sys.stderr, flush=True)
            if args.inject == "nan":
                x[0, 0] = float("nan")  # one bad sample in this rank's batch
            else:
                raise ValueError(f"injected failure: bad batch at step {step}")
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
        opt.step()
        if rank == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
