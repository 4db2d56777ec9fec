"""Rank 1 pads its batch to the longest sequence it has seen; one sequence length is garbage, so the
CPU allocator is asked for 16 TiB."""

from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def pad(rank: int, step: int) -> torch.Tensor:
    longest = (1 << 42) if rank == 1 and step == 4 else 16
    return torch.zeros(longest, 4)


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=6))
    rank = dist.get_rank()
    model = DDP(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(10):
        x = pad(rank, step)[:8]
        loss = model(x).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
