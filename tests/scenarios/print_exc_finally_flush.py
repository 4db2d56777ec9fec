"""The old-style loop: traceback.print_exc() in the except block, then a finally block that flushes
the metrics writer (it blocks for a while) before the error propagates. Rank 1 fails."""

import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


class MetricsWriter:
    def flush(self) -> None:
        time.sleep(10)  # uploads the buffered metrics


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=5))
    rank = dist.get_rank()
    writer = MetricsWriter()
    model = DDP(torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        for step in range(20):
            batch = {"input": torch.randn(8, 4)}
            if rank == 1 and step == 2:
                del batch["input"]
            loss = model(batch["input"]).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
    except Exception:
        traceback.print_exc()
        raise
    finally:
        writer.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
