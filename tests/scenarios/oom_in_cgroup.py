"""A rank that builds an in-memory cache of its data shard until the kernel's OOM killer ends it.

The job runs in memory cgroups, as under Slurm's task/cgroup or a Kubernetes pod's limit: at step 3
rank SCENARIO_OOM_RANK (default 1) moves itself into SCENARIO_MEMORY_CGROUP (a folder the test made,
with its limit set; its cgroup.procs file takes the pid), opens its shard, then caches decoded
samples without bound. The kernel kills it with SIGKILL: no Python traceback, nothing on stderr."""

import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

OOM_RANK = int(os.environ.get("SCENARIO_OOM_RANK", "1"))


def cache_shard(cache: list) -> None:
    while True:  # each "decoded sample" is 8 MiB of fresh memory, and nothing is ever evicted
        cache.append(bytearray(os.urandom(16)) * (512 * 1024))


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=20))
    rank = dist.get_rank()
    model = DDP(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    cache: list = []
    for step in range(12):
        if step == 3 and rank == OOM_RANK:
            with open(os.path.join(os.environ["SCENARIO_MEMORY_CGROUP"], "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
            time.sleep(1.0)  # opening the shard
            cache_shard(cache)
        loss = model(torch.randn(8, 8)).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(0.05)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
