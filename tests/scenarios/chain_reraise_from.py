"""A trainer that wraps whatever goes wrong in its own error, the way many frameworks do
(`raise TrainingError(...) from e`): rank 2's collate function hits a record without the key it needs
(KeyError), the loop re-raises it as a RuntimeError naming the step. Python prints "The above exception was
the direct cause of the following exception": the KeyError is the failure.
SCENARIO_FAIL_RANK=-1: every record is whole."""

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader


class TrainingError(RuntimeError):
    pass


def collate(records: list[dict]) -> torch.Tensor:
    return torch.stack([torch.tensor(r["features"], dtype=torch.float32) for r in records])


def main() -> None:
    fail_rank = int(os.environ.get("SCENARIO_FAIL_RANK", "2"))  # -1: a clean run
    dist.init_process_group("gloo", timeout=timedelta(seconds=8))
    rank = dist.get_rank()
    records = [{"features": [float(i)] * 4} for i in range(64)]
    if rank == fail_rank:
        records[21] = {"feature": [0.0] * 4}  # a record written by an older export script
    loader = DataLoader(records, batch_size=8, collate_fn=collate)
    model = DDP(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step, batch in enumerate(iter(loader)):
        try:
            loss = model(batch).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        except Exception as e:  # a failing step; the KeyError comes from the loader's next() instead
            raise TrainingError(f"step {step} failed") from e
    dist.destroy_process_group()


def run() -> None:
    try:
        main()
    except KeyError as e:
        raise TrainingError("data loading failed") from e


if __name__ == "__main__":
    run()
