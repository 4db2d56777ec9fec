"""The config file was renamed a key; every rank reads it after joining the process group."""

from datetime import timedelta

import torch
import torch.distributed as dist

CONFIG = {"model": {"hidden": 32}, "optim": {"learning_rate": 3e-4}}


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=6))
    model = torch.nn.Linear(CONFIG["model"]["hidden"], 1)
    lr = CONFIG["optim"]["lr"]  # renamed to learning_rate in the new config
    torch.optim.AdamW(model.parameters(), lr=lr)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
