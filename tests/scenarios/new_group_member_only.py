"""Two groups for a 2-stage pipeline on 3 ranks: stage A = ranks 0, 1 and stage B = ranks 1, 2. The script
creates each group only on its members (``if rank in ranks: new_group(ranks)``), but ``new_group`` must be
called by every rank, member or not: rank 2 skips the first call, so the group it creates next gets the
first group's name on it, and ranks 1 and 2 never meet in stage B's group. SCENARIO_FAIL_RANK=-1: every
rank calls new_group for both stages."""

import os
from datetime import timedelta

import torch
import torch.distributed as dist

STAGES = ([0, 1], [1, 2])


def main() -> None:
    member_only = int(os.environ.get("SCENARIO_FAIL_RANK", "2")) >= 0
    dist.init_process_group("gloo", timeout=timedelta(seconds=6))
    rank = dist.get_rank()
    groups = {}
    for ranks in STAGES:
        if rank in ranks or not member_only:
            groups[tuple(ranks)] = dist.new_group(ranks)
    for ranks, group in groups.items():
        if rank in ranks:
            t = torch.ones(4) * rank
            dist.all_reduce(t, group=group)
            print(f"rank {rank}: stage {list(ranks)} sum {t[0].item()}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
