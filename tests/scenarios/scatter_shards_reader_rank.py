"""Each epoch, the rank that reads the shard index from shared storage scatters every rank its list of shard
ids (``dist.scatter(src=reader)``). Which rank reads is "the last rank of the first node", computed from
``LOCAL_WORLD_SIZE``; rank 1's launcher environment was copied from a one-GPU-per-node job
(``LOCAL_WORLD_SIZE=1``), so rank 1 takes itself for the reader and calls ``scatter(src=1)`` while ranks 0 and 2
call ``scatter(src=2)``. SCENARIO_FAIL_RANK=-1: the same environment everywhere."""

import os
from datetime import timedelta

import torch
import torch.distributed as dist


def reader_rank(world: int) -> int:
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return min(world, per_node) - 1


def main() -> None:
    fail_rank = int(os.environ.get("SCENARIO_FAIL_RANK", "1"))
    dist.init_process_group("gloo", timeout=timedelta(seconds=6))
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == fail_rank:
        os.environ["LOCAL_WORLD_SIZE"] = str(rank + 1)  # the stale environment of a one-GPU-per-node job
    reader = reader_rank(world)
    for epoch in range(2):
        mine = torch.zeros(4, dtype=torch.int64)
        shards = None
        if rank == reader:
            index = torch.arange(4 * world, dtype=torch.int64) + 1000 * epoch  # the shard index, read once
            shards = list(index.chunk(world))
        dist.scatter(mine, shards, src=reader)
        print(f"rank {rank} epoch {epoch}: shards {mine.tolist()}", flush=True)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
