"""FSDP2 (fully_shard) on CPU gloo with a gradient-norm logger: a hook on each block's output gradient
hands its norm to a metrics thread through a bounded queue. On rank 1 the metrics thread died on a
network error (caught and printed, as a logger does), so the queue fills and the next put() blocks
inside that rank's backward, while its peers wait in FSDP's gradient reduce-scatter."""

import queue
import threading
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

METRICS: queue.Queue[float] = queue.Queue(maxsize=8)


def ship_metrics(rank: int) -> None:
    sent = 0
    while True:
        METRICS.get()
        sent += 1
        if rank == 1 and sent == 20:
            print("metrics: ConnectionResetError while shipping, metrics thread exits", flush=True)
            return


class Block(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.proj(x))
        if y.requires_grad:
            y.register_hook(lambda g: METRICS.put(g.norm().item()))
        return y


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    rank = dist.get_rank()
    threading.Thread(target=ship_metrics, args=(rank,), name="metrics", daemon=True).start()
    model = torch.nn.Sequential(*(Block(32) for _ in range(3)))
    for block in model:
        fully_shard(block, reshard_after_forward=False)
    fully_shard(model, reshard_after_forward=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(20):
        loss = model(torch.randn(8, 32)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if rank == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
