"""A DataLoader worker of rank 1 is SIGKILLed (as the OOM killer does to the biggest worker)."""

import os
import signal
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset


class Images(Dataset):
    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __len__(self) -> int:
        return 200

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.rank == 1 and i == 37:
            os.kill(os.getpid(), signal.SIGKILL)  # the worker process dies, as under the OOM killer
        return torch.randn(8)


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=8))
    rank = dist.get_rank()
    loader = DataLoader(Images(rank), batch_size=8, num_workers=2)
    model = DDP(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for x in loader:
        loss = model(x).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
