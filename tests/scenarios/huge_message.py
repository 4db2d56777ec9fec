"""Rank 1 raises with the whole offending batch in its message (about 1 MB of text)."""

from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=6))
    rank = dist.get_rank()
    model = DDP(torch.nn.Linear(4, 1))
    for step in range(6):
        batch = [f"sample-{i:07d}" for i in range(70_000)]
        if rank == 1 and step == 2:
            raise ValueError(f"batch failed validation: {batch}")
        model(torch.randn(8, 4)).mean().backward()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
