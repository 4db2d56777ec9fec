"""A library's exception whose __str__ itself raises (it formats a field that is not set)."""

from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


class TokenizerError(Exception):
    def __init__(self, position: int) -> None:
        super().__init__()
        self.position = position

    def __str__(self) -> str:
        return f"bad token at {self.position} in {self.source!r}"  # AttributeError: no .source


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=6))
    rank = dist.get_rank()
    model = DDP(torch.nn.Linear(4, 1))
    for step in range(6):
        if rank == 1 and step == 2:
            raise TokenizerError(position=113)
        model(torch.randn(8, 4)).mean().backward()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
