"""A model whose second layer expects 12 features while the first makes 10: every rank fails at the
first forward."""

from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=6))
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 10), torch.nn.ReLU(), torch.nn.Linear(12, 4)))
    loss = model(torch.randn(8, 8)).sum()
    loss.backward()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
