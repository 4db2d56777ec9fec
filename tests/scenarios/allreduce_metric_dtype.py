"""Each rank computes an accuracy with numpy and all-reduces it; rank 2's code path builds the tensor
from a float64 array (torch.from_numpy keeps the dtype), the others' from Python floats."""

from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist


def accuracy(rank: int) -> torch.Tensor:
    correct = np.array([0.75, 0.5, 1.0, 0.25])
    if rank == 2:
        return torch.from_numpy(correct)  # float64
    return torch.tensor(correct.tolist(), dtype=torch.float32)


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=6))
    rank = dist.get_rank()
    for _epoch in range(3):
        acc = accuracy(rank)
        dist.all_reduce(acc)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
