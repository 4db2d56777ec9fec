"""A manifest tool run the way the subprocess docs warn against: ``Popen(..., stdout=PIPE)`` then
``wait()`` before reading the output. Each rank lists its data shards with the tool at start-up; rank 1's
shard list is long (about 200 KB of paths), so the tool fills the pipe (64 KB) and blocks writing while
rank 1 blocks in ``wait()``: a deadlock outside torch, while ranks 0 and 2 wait for rank 1 in the first
gradient all-reduce. SCENARIO_FAIL_RANK=-1: every list is short and fits in the pipe."""

import os
import subprocess
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

LIST_TOOL = "import sys\nfor i in range(int(sys.argv[1])):\n    print(f'/data/corpus/part-{i:06d}.jsonl.zst')"


def list_shards(count: int) -> list[str]:
    proc = subprocess.Popen([sys.executable, "-c", LIST_TOOL, str(count)], stdout=subprocess.PIPE, text=True)
    proc.wait()  # the output is read after the tool exits
    assert proc.stdout is not None
    return proc.stdout.read().split()


def main() -> None:
    fail_rank = int(os.environ.get("SCENARIO_FAIL_RANK", "1"))
    dist.init_process_group("gloo", timeout=timedelta(seconds=6))
    rank = dist.get_rank()
    shards = list_shards(6000 if rank == fail_rank else 40)
    print(f"rank {rank}: {len(shards)} shards", flush=True)
    model = DDP(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _step in range(3):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
