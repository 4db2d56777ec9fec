"""A training loop that checkpoints with torch.distributed.checkpoint every few steps. The checkpoint
volume that rank 2 writes to is full (injected for real: rank 2's shard files are links to /dev/full,
so the kernel answers ENOSPC to rank 2's writes only); DCP then raises the same CheckpointException
on every rank."""

import os
import sys
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.nn.parallel import DistributedDataParallel as DDP

CKPT_ROOT = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="ckpt-")


def fill_rank2_volume(path: str) -> None:
    os.makedirs(path, exist_ok=True)
    for i in range(4):
        os.symlink("/dev/full", os.path.join(path, f"__2_{i}.distcp"))


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=8))
    rank = dist.get_rank()
    model = DDP(torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)]))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(1, 7):
        loss = model(torch.randn(16, 64)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 3 == 0:
            path = os.path.join(CKPT_ROOT, f"step_{step:06d}")
            if rank == 2 and step == 6:
                fill_rank2_volume(path)
            dist.barrier()
            dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=path)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
