"""A script that already uses elastic_diag's watch() around its evaluation (a section with its own
timeout, shorter than the collective timeout); rank 2's evaluation never finishes."""

import time
from datetime import timedelta

import torch
import torch.distributed as dist

import elastic_diag


def evaluate(rank: int) -> float:
    while rank == 2:  # waits on a metric server that never answers
        time.sleep(0.2)
    return float(torch.randn(8).mean())


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    with elastic_diag.watch("evaluation", timeout=4):
        score = torch.tensor([evaluate(rank)])
    dist.all_reduce(score)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
