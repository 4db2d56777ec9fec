"""Each rank iterates over its own list of files; rank 1's list is shorter and its loop ends early:
it returns and exits 0 while the others wait for it in the next all-reduce."""

from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=6))
    rank = dist.get_rank()
    files = [f"part-{i:04d}" for i in range(10 if rank != 1 else 6)]
    model = DDP(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _name in files:
        loss = model(torch.randn(8, 4)).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    print(f"rank {rank}: epoch finished", flush=True)


if __name__ == "__main__":
    main()
