"""Rank 1 builds its augmentation buffer from a size read in its metadata file (corrupt: 8 TiB)."""

from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def augmentation_buffer(rank: int) -> np.ndarray:
    n = 1 << 40 if rank == 1 else 1024  # the metadata of rank 1's shard is corrupt
    return np.zeros((n,), dtype=np.float64)


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=6))
    rank = dist.get_rank()
    model = DDP(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(8):
        if step == 3:
            augmentation_buffer(rank)
        loss = model(torch.randn(8, 4)).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
