"""A map-style dataset whose __getitem__ raises on one corrupt record, read by DataLoader workers
(num_workers=2); only rank 1's shard has the record."""

from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class Records(Dataset):
    def __init__(self, n: int) -> None:
        self.labels = {i: i % 3 for i in range(n) if i != 41}  # record 41 was never written

    def __len__(self) -> int:
        return 96

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.full((6,), float(i)), self.labels[i]


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=8))
    data = Records(96)
    sampler = DistributedSampler(data, shuffle=False)
    loader = DataLoader(data, batch_size=4, sampler=sampler, num_workers=2)
    model = DDP(torch.nn.Linear(6, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
