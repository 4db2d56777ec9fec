"""Every rank shows a tqdm progress bar on stderr (position=rank); rank 1 hits a bad batch, logs the
error through tqdm.write, flushes its metrics for a while, then re-raises: the traceback lands right
after a bar frame that has no newline."""

import logging
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

log = logging.getLogger("train")


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=5))
    rank = dist.get_rank()
    model = DDP(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    bar = tqdm(range(40), position=rank, desc=f"rank {rank}", mininterval=0)
    try:
        for step in bar:
            if rank == 1 and step == 6:
                raise RuntimeError(f"batch {step}: labels out of range (max 12, vocabulary 10)")
            loss = model(torch.randn(8, 4)).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            bar.set_postfix(loss=f"{loss.item():.3f}")
    except Exception:
        log.exception("training stopped")
        time.sleep(12)  # flushing the metrics writer
        raise
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
