"""FSDP2 (fully_shard) on CPU; rank 1 materialises a buffer sized from a corrupt config value (the CPU
allocator refuses 16 TiB) in the middle of training."""

from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=8))
    rank = dist.get_rank()
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(3)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(8):
        cache_len = (1 << 42) if rank == 1 and step == 4 else 64
        kv_cache = torch.empty(cache_len, 32)
        loss = model(torch.randn(8, 32) + kv_cache[:8]).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
