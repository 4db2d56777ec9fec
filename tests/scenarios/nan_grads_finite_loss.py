"""The same clipping loop with a saturating activation (tanh): rank 1's corrupt sample leaves its loss
finite while its gradients go non-finite; the all-reduced gradients reach every rank, and every rank
raises the same clip error. No rank's own loss was non-finite: the evidence cannot name one."""

from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=8))
    rank = dist.get_rank()
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)))
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
