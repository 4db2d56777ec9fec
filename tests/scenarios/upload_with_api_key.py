"""A training script that takes an API key on its command line (and a hub token from HF_TOKEN), prints
its whole configuration at start as many scripts do, and whose rank 1 fails pushing a checkpoint: the
HTTP error it raises quotes the URL, token included."""

import argparse
import os
from datetime import timedelta

import torch
import torch.distributed as dist


class HTTPError(Exception):
    pass


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--api-key", required=True)
    p.add_argument("--steps", type=int, default=4)
    args = p.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=10))
    rank = dist.get_rank()
    print(f"rank {rank}: config {vars(args)} hub_token={os.environ.get('HF_TOKEN')}", flush=True)
    t = torch.ones(4)
    for _ in range(args.steps):
        dist.all_reduce(t)
    if rank == 1:
        url = f"https://hub.example.org/api/upload?token={os.environ.get('HF_TOKEN')}&key={args.api_key}"
        raise HTTPError(f"401 Client Error: Unauthorized for url: {url}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
