"""DDP with gradient clipping that refuses non-finite gradients (error_if_nonfinite=True). Rank 1's
batch at step 3 holds an inf (a corrupt sample): its loss goes non-finite, the all-reduced gradients
carry it to every rank, and every rank raises the same clip error."""

from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=8))
    rank = dist.get_rank()
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(8):
        x = torch.randn(16, 8)
        if rank == 1 and step == 3:
            x[5, 2] = float("inf")
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
        opt.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
