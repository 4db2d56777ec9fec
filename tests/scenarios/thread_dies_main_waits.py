"""A prefetch thread fills a queue of batches; on rank 1 it dies on a corrupt shard and the main
thread waits for a batch that never comes, while the other ranks wait in the next all-reduce."""

import queue
import threading
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def prefetch(rank: int, out: "queue.Queue[torch.Tensor]") -> None:
    for i in range(100):
        if rank == 1 and i == 5:
            raise ValueError(f"corrupt shard shard-{rank:03d}.bin at record {i}: bad magic")
        out.put(torch.randn(16, 8))


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=6))
    rank = dist.get_rank()
    batches: queue.Queue[torch.Tensor] = queue.Queue(maxsize=2)
    threading.Thread(target=prefetch, args=(rank, batches), name="prefetch", daemon=True).start()
    model = DDP(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(50):
        x = batches.get()
        loss = model(x).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
