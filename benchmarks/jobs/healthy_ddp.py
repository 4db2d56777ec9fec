"""A short healthy DDP job as a trainer prints it, with the moments the phases benchmark times.

Each rank prints ``phase start <wall time>`` once its imports are done, ``phase joined <t>`` once the
process group is up, ``phase done <t>`` when its training loop and ``destroy_process_group`` are over;
rank 0 logs a step line every step (``step 12 loss 0.4107``), as a training script does.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def say(what: str) -> None:
    sys.stdout.write(f"phase {what} {time.time():.6f} rank {os.environ.get('RANK')}\n")  # one write: ranks share a pipe
    sys.stdout.flush()


def main() -> None:
    say("start")
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--width", type=int, default=64)
    args = p.parse_args()
    dist.init_process_group("gloo")
    say("joined")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(32, args.width), torch.nn.ReLU(), torch.nn.Linear(args.width, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    for step in range(args.steps):
        x = torch.randn(64, 32, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()
    say("done")


if __name__ == "__main__":
    main()
