"""The emergency checkpoint many training loops write when a step fails: rank 1 hits a bad batch (a
ValueError in its loss), the except block saves "crash.pt" into the run's output folder before re-raising,
and that save fails too (the folder was never created on this node). Python prints the chain: the
ValueError, "During handling of the above exception, another exception occurred", the FileNotFoundError.
The first exception is the failure; the failed save is collateral. SCENARIO_FAIL_RANK=-1: no bad batch."""

import os
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def compute_loss(out: torch.Tensor, target: torch.Tensor, step: int, bad: bool) -> torch.Tensor:
    if bad:
        raise ValueError(f"Expected target size (8, 1), got torch.Size([8, 3]) at step {step}")
    return torch.nn.functional.mse_loss(out, target)


def main() -> None:
    fail_rank = int(os.environ.get("SCENARIO_FAIL_RANK", "1"))  # -1: a clean run
    dist.init_process_group("gloo", timeout=timedelta(seconds=8))
    rank = dist.get_rank()
    model = DDP(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out_dir = os.path.join(tempfile.gettempdir(), f"elastic_diag_runs_{os.getpid()}", "never-created")
    for step in range(12):
        try:
            x = torch.randn(8, 4)
            loss = compute_loss(model(x), x.sum(dim=1, keepdim=True), step, bad=rank == fail_rank and step == 5)
            opt.zero_grad()
            loss.backward()
            opt.step()
        except Exception:
            torch.save({"step": step, "model": model.state_dict()}, os.path.join(out_dir, "crash.pt"))
            raise
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
