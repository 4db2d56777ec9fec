"""Shards fetched into a node-local cache under a lock file, the way many data pipelines share one
download per node: each rank whose shard is not cached yet takes an exclusive ``fcntl.flock`` on the
cache's lock file, writes its pid into it and runs the fetch tool (a subprocess) inside it. Rank 0's
shard is cached already; it goes on to the first gradient all-reduce. Today the tool hangs on rank 2 (a
stalled mirror, modelled by a child that sleeps), so rank 2 holds the lock forever, rank 1 waits for the
lock, and rank 0 waits in the all-reduce: the culprit is rank 2, which holds the lock rank 1 is blocked
on. SCENARIO_FAIL_RANK=-1: the tool returns at once."""

import fcntl
import os
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

FETCH_TOOL = "import sys, time; time.sleep(float(sys.argv[1])); print('fetched', sys.argv[2])"


def fetch_shard(cache: str, shard: str, hang: bool) -> str:
    path = os.path.join(cache, shard)
    with open(os.path.join(cache, ".fetch.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one fetch per node at a time
        lock.write(f"{os.getpid()} {shard}\n")  # who holds it, for whoever looks
        lock.flush()
        if not os.path.exists(path):
            subprocess.run([sys.executable, "-c", FETCH_TOOL, "120" if hang else "0.1", shard], check=True)
            with open(path, "w") as f:
                f.write("0 1 2 3\n")
        fcntl.flock(lock, fcntl.LOCK_UN)
    return path


def main() -> None:
    fail_rank = int(os.environ.get("SCENARIO_FAIL_RANK", "2"))
    dist.init_process_group("gloo", timeout=timedelta(seconds=6))
    rank = dist.get_rank()
    cache = os.path.join(tempfile.gettempdir(), f"shard_cache_{os.environ['TORCHELASTIC_RUN_ID']}")
    os.makedirs(cache, exist_ok=True)
    model = DDP(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if rank != 0:
        lock_file = os.path.join(cache, ".fetch.lock")
        while rank != dist.get_world_size() - 1 and not (os.path.exists(lock_file) and os.path.getsize(lock_file)):
            time.sleep(0.05)  # the scenario's timing: the last rank's fetch takes the lock first
        fetch_shard(cache, f"shard-{rank:05d}.txt", hang=rank == fail_rank)
    for step in range(3):
        x = torch.randn(4, 8)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
