"""A preemption-aware loop as users write them for Slurm: a SIGTERM handler sets a flag, and the loop,
seeing it, saves a checkpoint and exits. Rank 1 writes its shard to a file system that has stopped
answering (simulated by a blocking wait), so it is still in save_checkpoint when the launcher's
grace ends. Prints "step N" lines so a test can wait for training to be under way."""

import os
import signal
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

STOP = threading.Event()
STUCK_RANK = int(os.environ.get("SCENARIO_STUCK_RANK", "1"))


def on_sigterm(signum, frame):
    print(f"rank {dist.get_rank()}: got signal {signum}, checkpointing before exit", flush=True)
    STOP.set()


def save_checkpoint(model, path, rank):
    if rank == STUCK_RANK:
        threading.Event().wait(600)  # the NFS server stopped answering: write() never returns
    torch.save(model.state_dict(), path)


def main() -> None:
    signal.signal(signal.SIGTERM, on_sigterm)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    model = DDP(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    out = os.environ.get("SCENARIO_CKPT_DIR", ".")
    for step in range(100_000):
        loss = model(torch.randn(8, 8)).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0:
            print(f"step {step}", flush=True)
        if STOP.is_set():
            save_checkpoint(model, os.path.join(out, f"ckpt_rank{rank}.pt"), rank)
            sys.exit(0)
        time.sleep(0.05)


if __name__ == "__main__":
    main()
