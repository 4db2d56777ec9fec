"""Each rank streams its shards from a data server; rank 1's server is down (a real refused
connection on a closed local port) and the script does not catch it."""

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

DATA_SERVER = ("127.0.0.1", int(os.environ.get("SHARD_SERVER_PORT", "9")))  # port 9 (discard): nothing listens


def fetch_shard(rank: int, step: int) -> torch.Tensor:
    if rank == 1 and step == 4:
        with socket.create_connection(DATA_SERVER, timeout=2) as conn:  # ConnectionRefusedError
            conn.sendall(b"GET shard")
    return torch.randn(16, 8)


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=8))
    rank = dist.get_rank()
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(12):
        x = fetch_shard(rank, step)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
