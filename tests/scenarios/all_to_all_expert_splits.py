"""Mixture-of-experts token dispatch with all_to_all_single and uneven splits (normal: each rank routes
a different number of tokens to each expert). Rank 2 computed its receive splits from a stale routing
table, so what it expects is smaller than what the others send it."""

from datetime import timedelta

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=6))
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(4):
        send = [2 + ((rank + j + step) % 3) for j in range(world)]  # tokens this rank sends to each rank
        counts = torch.tensor(send)
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts)  # exchange the split sizes first, as MoE code does
        recv = recv_counts.tolist()
        if rank == 2 and step == 2:
            recv = [max(1, c - 1) for c in recv]  # the stale table
        tokens = torch.randn(sum(send), 8)
        out = torch.empty(sum(recv), 8)
        dist.all_to_all_single(out, tokens, recv, send)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
