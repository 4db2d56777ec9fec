"""Rank 1 is killed (SIGKILL, as by a memory limit) while it is writing a traceback to stderr."""

import os
import signal
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=6))
    rank = dist.get_rank()
    model = DDP(torch.nn.Linear(4, 1))
    for step in range(8):
        if rank == 1 and step == 3:
            sys.stderr.write(
                'Traceback (most recent call last):\n  File "train.py", line 88, in step\n    batch = collate(samp'
            )
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        model(torch.randn(8, 4)).mean().backward()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
