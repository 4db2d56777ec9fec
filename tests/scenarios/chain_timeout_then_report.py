"""Every rank wraps its step in ``try/except`` and, on any error, gathers a short status from all ranks
(``all_gather_object``) to print one report before re-raising. Rank 1 hits a KeyError in its label map
and re-raises it after its own report attempt; ranks 0 and 2 time out in the gradient all-reduce waiting
for rank 1, and their report's gather fails as well. Their tracebacks chain a collective timeout to
another error: a chain that begins with a symptom is a symptom, and rank 1's KeyError is the failure.
SCENARIO_FAIL_RANK=-1: every label is known."""

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

LABELS = {"cat": 0, "dog": 1, "bird": 2}


def report(rank: int, err: BaseException) -> None:
    statuses: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(statuses, f"rank {rank}: {type(err).__name__}")
    if rank == 0:
        print("failure report:", statuses, flush=True)


def main() -> None:
    fail_rank = int(os.environ.get("SCENARIO_FAIL_RANK", "1"))
    dist.init_process_group("gloo", timeout=timedelta(seconds=6))
    rank = dist.get_rank()
    model = DDP(torch.nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(8):
        try:
            names = ["cat", "dog", "bird", "ferret" if rank == fail_rank and step == 3 else "cat"]
            target = torch.tensor([LABELS[n] for n in names])
            loss = torch.nn.functional.cross_entropy(model(torch.randn(4, 8)), target)
            opt.zero_grad()
            loss.backward()
            opt.step()
        except Exception as err:
            try:
                report(rank, err)
            finally:
                raise
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
