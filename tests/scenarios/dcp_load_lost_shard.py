"""Resuming a sharded (FSDP2-style DTensor) checkpoint with torch.distributed.checkpoint: each rank
reads only its own shard, and rank 1's shard file was lost (a cleanup job deleted it). Every rank
raises the CheckpointException; it names rank 1."""

import os
import sys
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

CKPT = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="ckpt-")


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=8))
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    weights = {"embed": distribute_tensor(torch.randn(3000, 16), mesh, [Shard(0)])}
    dcp.save(weights, checkpoint_id=CKPT)
    dist.barrier()
    if rank == 0:  # the nightly cleanup removed a file it took for a temporary one
        os.remove(os.path.join(CKPT, "__1_0.distcp"))
    dist.barrier()
    resumed = {"embed": distribute_tensor(torch.zeros(3000, 16), mesh, [Shard(0)])}
    dcp.load(resumed, checkpoint_id=CKPT)
    print(f"rank {rank}: resumed", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
