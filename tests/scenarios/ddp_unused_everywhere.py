"""A classifier head defined in __init__ but never used in forward: unused on every rank."""

from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = torch.nn.Linear(8, 8)
        self.classifier = torch.nn.Linear(8, 4)  # left over from an older version of the model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(x).relu().mean(dim=1)


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=6))
    model = DDP(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(5):
        loss = model(torch.randn(4, 8)).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
