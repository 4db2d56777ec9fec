"""The training loop catches any exception, logs it with logging.exception, writes an emergency
checkpoint (slow: longer than the process group's timeout) and re-raises. Rank 1's batch is bad."""

import logging
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
log = logging.getLogger("trainer")


def emergency_checkpoint(model: torch.nn.Module) -> None:
    log.info("writing emergency checkpoint")
    time.sleep(12)  # a large state dict to a network file system


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=5))
    rank = dist.get_rank()
    model = DDP(torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(20):
        try:
            x = torch.randn(8, 4)
            if rank == 1 and step == 3:
                raise ValueError(f"batch {step} on rank {rank} has 0 valid tokens")
            loss = model(x).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
        except Exception:
            log.exception("step %d failed", step)
            emergency_checkpoint(model)
            raise
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
