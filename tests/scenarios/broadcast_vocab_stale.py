"""Rank 0 broadcasts the vocabulary ids it built; rank 2 sized its receive buffer from a stale vocab
file on its node (fewer entries)."""

from datetime import timedelta

import torch
import torch.distributed as dist


def vocab_size_on_disk(rank: int) -> int:
    return 900 if rank == 2 else 1000  # node 2 still has last week's vocab.txt


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=6))
    rank = dist.get_rank()
    ids = torch.arange(1000) if rank == 0 else torch.empty(vocab_size_on_disk(rank), dtype=torch.int64)
    dist.broadcast(ids, src=0)
    dist.barrier()
    print(f"rank {rank}: vocab of {ids.numel()} ids", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
