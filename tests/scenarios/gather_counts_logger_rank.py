"""Per-rank evaluation counts gathered to the rank that writes the metrics (``dst=logger``). The logger rank
comes from a setting each rank reads from its environment file; rank 1's copy was edited to log from
rank 1, so rank 1 calls ``gather(dst=1)`` while ranks 0 and 2 call ``gather(dst=0)``.
SCENARIO_FAIL_RANK=-1: the same setting everywhere."""

import os
from datetime import timedelta

import torch
import torch.distributed as dist


def main() -> None:
    fail_rank = int(os.environ.get("SCENARIO_FAIL_RANK", "1"))
    dist.init_process_group("gloo", timeout=timedelta(seconds=6))
    rank, world = dist.get_rank(), dist.get_world_size()
    logger = 1 if rank == fail_rank else 0
    for epoch in range(2):
        counts = torch.tensor([100 + rank + epoch], dtype=torch.int64)
        out = [torch.zeros(1, dtype=torch.int64) for _ in range(world)] if rank == logger else None
        dist.gather(counts, out, dst=logger)
        if rank == logger:
            print(f"epoch {epoch}: evaluated {sum(int(t) for t in out)} samples", flush=True)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
