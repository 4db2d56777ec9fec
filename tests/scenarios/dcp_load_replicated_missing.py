"""Resuming a DDP (replicated) model from a torch.distributed.checkpoint whose shard written by rank 2
is gone: DCP spreads the reads of replicated tensors over every rank's file, so every rank's part of
the load fails on the same missing file."""

import os
import sys
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

CKPT = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="ckpt-")


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=8))
    rank = dist.get_rank()
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)])
    dcp.save(model.state_dict(), checkpoint_id=CKPT)
    dist.barrier()
    if rank == 2:
        os.remove(os.path.join(CKPT, "__2_0.distcp"))
    dist.barrier()
    state = model.state_dict()
    dcp.load(state, checkpoint_id=CKPT)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
