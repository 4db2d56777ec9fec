"""FSDP2 (fully_shard) on CPU gloo; rank 1's batch carries a mask of the wrong length, so its
attention-like block fails in the forward, between FSDP's all-gathers."""

from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard


class Block(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(d, d)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * mask.unsqueeze(-1)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(32) for _ in range(3))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x, mask)
        return x.mean()


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=8))
    rank = dist.get_rank()
    model = Net()
    for b in model.blocks:
        fully_shard(b)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(8):
        x = torch.randn(4, 10, 32)
        mask = torch.ones(4, 12 if rank == 1 and step == 3 else 10)
        loss = model(x, mask)
        loss.backward()
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
