"""A plain training loop with HF accelerate (Accelerator(cpu=True)) launched by torchrun; rank 1's
batch at step 3 is longer than the model's position table, so its embedding lookup fails."""

import os

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

FAIL_RANK = int(os.environ.get("SCENARIO_FAIL_RANK", "1"))


class TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tokens = torch.nn.Embedding(64, 16)
        self.positions = torch.nn.Embedding(32, 16)
        self.head = torch.nn.Linear(16, 64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1])
        return self.head(self.tokens(ids) + self.positions(pos))


def main() -> None:
    accelerator = Accelerator(cpu=True)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = DataLoader(TensorDataset(torch.randint(0, 64, (192, 16))), batch_size=4)
    model, opt, data = accelerator.prepare(model, opt, data)
    for step, (ids,) in enumerate(data):
        if accelerator.process_index == FAIL_RANK and step == 3:
            ids = torch.cat([ids, ids, ids], dim=1)  # a packed sequence of 48 tokens: past the 32 positions
        logits = model(ids)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
    accelerator.print("done")
    accelerator.end_training()


if __name__ == "__main__":
    main()
