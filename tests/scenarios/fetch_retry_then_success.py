"""A rank's download fails once (the dataset server answered 503 on the first attempt); torchrun's
--max-restarts 1 restarts the job and the second attempt trains to the end."""

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


class ShardDownloadError(ConnectionError):
    pass


def download(rank: int) -> torch.Tensor:
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if rank == 1 and first_attempt:
        raise ShardDownloadError("GET https://datasets.internal/shards/00017.tar: 503 Service Unavailable (3 retries)")
    return torch.randn(32, 4)


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=8))
    rank = dist.get_rank()
    model = DDP(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(6):
        data = download(rank) if step == 2 else torch.randn(32, 4)
        loss = model(data).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    print(f"rank {rank} done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
