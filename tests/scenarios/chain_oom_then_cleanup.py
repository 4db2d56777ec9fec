"""Rank 1 asks the CPU allocator for far more than the host has (a buffer sized from a corrupt header);
the script's `finally:` closes its metrics writer, whose flush fails on the half-written state
(a RuntimeError of its own). The chain's first exception, the allocation failure, is the failure:
host_oom, not the writer's error. SCENARIO_FAIL_RANK=-1: the header is right."""

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


class MetricsWriter:
    def __init__(self) -> None:
        self.pending: list[float] = []
        self.broken = False

    def add(self, value: float) -> None:
        self.pending.append(value)

    def close(self) -> None:
        if self.broken:
            raise RuntimeError("metrics writer: flush failed, 3 records pending (state was not saved)")


def main() -> None:
    fail_rank = int(os.environ.get("SCENARIO_FAIL_RANK", "1"))  # -1: a clean run
    dist.init_process_group("gloo", timeout=timedelta(seconds=8))
    rank = dist.get_rank()
    model = DDP(torch.nn.Linear(4, 1))
    writer = MetricsWriter()
    try:
        for step in range(10):
            if rank == fail_rank and step == 4:
                writer.broken = True
                n_items = 1 << 45  # from a corrupt shard header: 128 TiB of float32
                buffer = torch.empty(n_items, dtype=torch.float32)
                buffer.zero_()
            loss = model(torch.randn(8, 4)).pow(2).mean()
            loss.backward()
            writer.add(loss.item())
    finally:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
