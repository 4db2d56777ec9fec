"""A contrastive feature bank filled with all_gather_into_tensor; rank 2 enqueues a batch with more
rows than the others (its sampler yields an extra sample)."""

from datetime import timedelta

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=6))
    rank, world = dist.get_rank(), dist.get_world_size()
    bank = torch.zeros(world * 16, 32)
    for step in range(6):
        rows = 17 if rank == 2 and step == 3 else 16
        feats = torch.nn.functional.normalize(torch.randn(rows, 32), dim=1)
        dist.all_gather_into_tensor(bank[: world * rows] if rows == 16 else torch.zeros(world * rows, 32), feats)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
