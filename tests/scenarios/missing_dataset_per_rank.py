"""Every rank opens its own shard; the dataset path is wrong on every rank (a mount that is missing)."""

from datetime import timedelta

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=6))
    rank = dist.get_rank()
    with open(f"/mnt/datasets-missing/train/shard_{rank:05d}.bin", "rb") as fp:
        data = torch.frombuffer(bytearray(fp.read()), dtype=torch.float32)
    print(data.shape)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
