"""Something outside the job (a node agent, a person with `kill -INT`) sends SIGINT to rank 1's process."""

import os
import subprocess
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=6))
    rank = dist.get_rank()
    if rank == 1:  # the "node agent": an unrelated process that kills this rank a moment later
        subprocess.Popen(["sh", "-c", f"sleep 2; kill -INT {os.getpid()}"], start_new_session=True)
    model = DDP(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(60):
        loss = model(torch.randn(8, 4)).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(0.1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
