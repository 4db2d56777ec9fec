"""A cleanup that needs the other ranks: rank 2 raises, and its finally block saves the model with a
barrier first (the usual "wait for everyone, then rank 0 saves"): that collective fails too."""

from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def save(model: torch.nn.Module) -> None:
    dist.barrier()
    if dist.get_rank() == 0:
        torch.save(model.state_dict(), "/tmp/elastic_diag_scenario_model.pt")


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=6))
    rank = dist.get_rank()
    model = DDP(torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        for step in range(30):
            if rank == 2 and step == 3:
                raise RuntimeError(f"loss scale overflowed 8 times in a row at step {step}")
            loss = model(torch.randn(8, 4)).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        save(model)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
