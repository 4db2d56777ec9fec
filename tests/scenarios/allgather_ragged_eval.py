"""Evaluation gathers every rank's predictions with all_gather; the eval set does not divide evenly,
so rank 2's last batch is shorter (no drop_last, no padding)."""

from datetime import timedelta

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=6))
    rank, world = dist.get_rank(), dist.get_world_size()
    model = torch.nn.Linear(8, 1)
    n_eval = 47  # 47 samples over 3 ranks, batches of 4: ranks 0 and 1 end with 4, rank 2 with 3
    mine = list(range(rank, n_eval, world))
    for start in range(0, len(mine), 4):
        batch = torch.randn(len(mine[start : start + 4]), 8)
        preds = model(batch).squeeze(1).detach()
        gathered = [torch.empty_like(preds) for _ in range(world)]
        dist.all_gather(gathered, preds)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
