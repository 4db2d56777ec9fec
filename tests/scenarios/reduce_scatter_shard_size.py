"""A hand-written ZeRO-style gradient sharding: reduce_scatter_tensor of the flat gradients; rank 2
flattened one more parameter (it built its model with an extra bias), so its input is larger."""

from datetime import timedelta

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=6))
    rank, world = dist.get_rank(), dist.get_world_size()
    model = torch.nn.Sequential(torch.nn.Linear(6, 6, bias=rank == 2), torch.nn.Linear(6, 6, bias=False))
    for _step in range(4):
        model(torch.randn(4, 6)).sum().backward()
        flat = torch.cat([p.grad.flatten() for p in model.parameters()])
        pad = (-flat.numel()) % world
        flat = torch.cat([flat, flat.new_zeros(pad)])
        shard = flat.new_empty(flat.numel() // world)
        dist.reduce_scatter_tensor(shard, flat)
        model.zero_grad()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
