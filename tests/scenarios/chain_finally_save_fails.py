"""The "always save the last state" pattern: the training loop runs inside ``try: ... finally:`` and the
``finally`` block writes ``last.pt`` into the run's checkpoint folder. On rank 2 a batch with a wrong
feature size raises a RuntimeError in the forward (a shape error, the failure); the ``finally`` then fails
too, since on that node ``checkpoints`` is a file left by an old job (NotADirectoryError). Python chains
them ("During handling of the above exception, another exception occurred"): the shape error is the
failure, the failed save is collateral. SCENARIO_FAIL_RANK=-1: no bad batch, and the save works."""

import os
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def batch(step: int, bad: bool) -> torch.Tensor:
    return torch.randn(8, 12 if bad else 16)


def main() -> None:
    fail_rank = int(os.environ.get("SCENARIO_FAIL_RANK", "2"))
    dist.init_process_group("gloo", timeout=timedelta(seconds=8))
    rank = dist.get_rank()
    run_dir = tempfile.mkdtemp(prefix=f"run-rank{rank}-")
    if rank == fail_rank:
        open(os.path.join(run_dir, "checkpoints"), "w").close()  # a file, where a folder is expected
    else:
        os.makedirs(os.path.join(run_dir, "checkpoints"))
    model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    step = 0
    try:
        for step in range(10):
            loss = model(batch(step, bad=rank == fail_rank and step == 4)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        torch.save({"step": step, "model": model.state_dict()}, os.path.join(run_dir, "checkpoints", "last.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
