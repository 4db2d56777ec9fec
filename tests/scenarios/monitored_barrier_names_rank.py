"""The script guards each epoch's end with dist.monitored_barrier (gloo), as the PyTorch docs suggest
for finding a stuck rank; rank 2 is still busy in a long evaluation of its own."""

import time
from datetime import timedelta

import torch
import torch.distributed as dist


def evaluate(rank: int) -> None:
    if rank == 2:
        time.sleep(60)  # a pathological eval shard
    torch.randn(64, 64).sum()


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    rank = dist.get_rank()
    evaluate(rank)
    dist.monitored_barrier(timeout=timedelta(seconds=4), wait_all_ranks=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
