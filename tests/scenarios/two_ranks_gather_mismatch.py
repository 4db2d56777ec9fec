"""Two ranks all_gather their gradient norms; rank 1 gathers a vector of two norms (it clipped two
parameter groups), rank 0 one: one against one, no majority."""

from datetime import timedelta

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=6))
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(4):
        norms = torch.ones(2 if rank == 1 and step == 2 else 1)
        out = [torch.empty_like(norms) for _ in range(world)]
        dist.all_gather(out, norms)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
