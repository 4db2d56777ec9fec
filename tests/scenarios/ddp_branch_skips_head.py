"""A model with an auxiliary head used only when the batch has auxiliary labels; rank 1's batch at
step 3 has none, so its forward skips the head (DDP, find_unused_parameters=False)."""

from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(8, 8)
        self.aux_head = torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, has_aux: bool) -> torch.Tensor:
        h = torch.relu(self.body(x))
        out = h.sum(dim=1)
        if has_aux:
            out = out + self.aux_head(h).sum(dim=1)
        return out


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=6))
    rank = dist.get_rank()
    model = DDP(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(10):
        has_aux = not (rank == 1 and step == 3)
        loss = model(torch.randn(4, 8), has_aux).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
