"""Rank 1 has two worker threads that fail at the same moment (their tracebacks interleave on
stderr), then the main thread fails on the missing results."""

import threading
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

results: dict[str, torch.Tensor] = {}
go = threading.Barrier(2)


def augment(name: str) -> None:
    go.wait()
    raise OSError(f"augmentation cache {name} is unreadable")


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=6))
    rank = dist.get_rank()
    model = DDP(torch.nn.Linear(4, 1))
    for step in range(6):
        if rank == 1 and step == 2:
            threads = [threading.Thread(target=augment, args=(n,), name=n) for n in ("crop", "flip")]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            x = results["crop"]  # KeyError: the threads died
        else:
            x = torch.randn(8, 4)
        model(x).mean().backward()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
