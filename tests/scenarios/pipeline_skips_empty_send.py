"""A hand-written 3-stage pipeline: rank 0 sends activations to rank 1, rank 1 to rank 2. Rank 1 skips
its send when its micro-batch is empty after filtering (a shortcut that looked harmless), while rank 2
still waits in ``recv(src=1)``. The sends and receives no longer pair; which side is wrong depends on the
program, so the verdict gives both. SCENARIO_FAIL_RANK=-1: no micro-batch is empty."""

import os
from datetime import timedelta

import torch
import torch.distributed as dist


def main() -> None:
    empty_on = int(os.environ.get("SCENARIO_FAIL_RANK", "1"))
    dist.init_process_group("gloo", timeout=timedelta(seconds=6))
    rank, world = dist.get_rank(), dist.get_world_size()
    for micro in range(3):
        act = torch.randn(4, 8)
        if rank > 0:
            dist.recv(act, src=rank - 1)
        keep = act[act.abs().sum(dim=1) > (1e9 if rank == empty_on and micro == 2 else 0)]
        if rank < world - 1 and len(keep) > 0:
            dist.send(act, dst=rank + 1)
        print(f"rank {rank}: micro-batch {micro} of {len(keep)} rows", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
