"""A two-stage pipeline: stage 0 sends its activations to stage 1 with dist.send, stage 1 receives
them into a buffer it sized from its own config (hidden 12; stage 0's model has 16)."""

from datetime import timedelta

import torch
import torch.distributed as dist

HIDDEN = {0: 16, 1: 12}  # the stages were built from two versions of the config


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=6))
    rank = dist.get_rank()
    for _microbatch in range(4):
        if rank == 0:
            acts = torch.nn.Linear(8, HIDDEN[0])(torch.randn(4, 8)).detach()
            dist.send(acts, dst=1)
            grad = torch.empty(4, HIDDEN[0])
            dist.recv(grad, src=1)
        else:
            acts = torch.empty(4, HIDDEN[1])
            dist.recv(acts, src=0)
            dist.send(torch.zeros(4, HIDDEN[0]), dst=0)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
