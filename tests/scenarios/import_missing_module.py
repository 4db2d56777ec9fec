"""The job's environment lacks a package the script imports: every rank fails at import."""

from datetime import timedelta

import torch
import torch.distributed as dist
import wandb_offline_logger  # noqa: F401  (not installed in this environment)


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=6))
    torch.manual_seed(0)


if __name__ == "__main__":
    main()
