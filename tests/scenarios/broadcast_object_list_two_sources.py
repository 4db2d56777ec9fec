"""Two ranks, each sure it is the one that loaded the run's config: the script lets whichever rank finds
``resume.yaml`` next to it broadcast the config with ``broadcast_object_list``. Both nodes have a copy
today, so rank 0 calls ``broadcast_object_list(src=0)`` and rank 1 ``broadcast_object_list(src=1)``: with
two ranks there is no majority, and the verdict says both sides. SCENARIO_FAIL_RANK=-1: only rank 0 has
the file."""

import os
from datetime import timedelta

import torch.distributed as dist


def main() -> None:
    fail_rank = int(os.environ.get("SCENARIO_FAIL_RANK", "1"))
    dist.init_process_group("gloo", timeout=timedelta(seconds=6))
    rank = dist.get_rank()
    has_config = rank == 0 or rank == fail_rank
    config = [{"lr": 3e-4, "resume_step": 1200}] if has_config else [None]
    src = rank if has_config else 0
    dist.broadcast_object_list(config, src=src)
    print(f"rank {rank}: resume at step {config[0]['resume_step']}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
