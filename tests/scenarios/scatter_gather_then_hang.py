"""Rank 0 scatters work items to every rank and gathers their results each step (root-only arguments:
normal). At step 4 rank 1 gets stuck in its own post-processing loop while the others wait."""

import time
from datetime import timedelta

import torch
import torch.distributed as dist


def postprocess(rank: int, step: int, item: torch.Tensor) -> torch.Tensor:
    while rank == 1 and step == 4:  # waits for a file that never appears
        time.sleep(0.2)
    return item * 2


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=6))
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(8):
        item = torch.zeros(4)
        work = [torch.full((4,), float(step * world + r)) for r in range(world)] if rank == 0 else None
        dist.scatter(item, work, src=0)
        result = postprocess(rank, step, item)
        results = [torch.zeros(4) for _ in range(world)] if rank == 0 else None
        dist.gather(result, results, dst=0)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
