"""Rank 1's DataLoader worker crashes in native code (a decoder library reading a bad file)."""

import ctypes
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset


def decode(blob: bytes, bad: bool) -> torch.Tensor:
    if bad:
        ctypes.string_at(0)  # the native decoder reads address 0
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8).float()


class Audio(Dataset):
    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __len__(self) -> int:
        return 120

    def __getitem__(self, i: int) -> torch.Tensor:
        return decode(bytes(range(16)), bad=self.rank == 1 and i == 29)


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=8))
    loader = DataLoader(Audio(dist.get_rank()), batch_size=6, num_workers=2)
    model = DDP(torch.nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for x in loader:
        loss = model(x).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
