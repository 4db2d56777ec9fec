"""The script installs its own sys.excepthook (to post the error to a chat webhook); the hook itself
fails, so Python prints 'Error in sys.excepthook' and the original exception."""

import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def notify(etype, value, tb):  # type: ignore[no-untyped-def]
    raise ConnectionError("webhook https://chat.internal/hooks/train unreachable")


def main() -> None:
    sys.excepthook = notify
    dist.init_process_group("gloo", timeout=timedelta(seconds=6))
    rank = dist.get_rank()
    model = DDP(torch.nn.Linear(4, 1))
    for step in range(6):
        if rank == 1 and step == 2:
            raise IndexError(f"label index 12 is out of range for 10 classes (step {step})")
        model(torch.randn(8, 4)).mean().backward()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
