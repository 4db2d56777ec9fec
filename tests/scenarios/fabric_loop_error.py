"""A Lightning Fabric training loop launched by `fabric run --accelerator cpu --strategy ddp --devices N`
(the CLI creates the processes, so the script takes its settings from it and does not call launch());
rank 2's batch at step 4 holds a label outside the classifier's range, so its loss fails."""

import os

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

FAIL_RANK = int(os.environ.get("SCENARIO_FAIL_RANK", "2"))


def main() -> None:
    fabric = L.Fabric()  # accelerator, strategy and devices from `fabric run`
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = fabric.setup(model, opt)
    data = fabric.setup_dataloaders(DataLoader(TensorDataset(torch.randn(96, 8), torch.randint(0, 4, (96,))),
                                               batch_size=4))  # fmt: skip
    for step, (x, y) in enumerate(data):
        if step == 4 and fabric.global_rank == FAIL_RANK:
            y = y + 10  # a label the 4-way classifier does not have
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        fabric.backward(loss)
        opt.step()
        if step == 12:
            break
    fabric.print("done")


if __name__ == "__main__":
    main()
