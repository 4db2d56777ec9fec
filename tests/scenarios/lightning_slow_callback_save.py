"""A LightningModule trained with Trainer(strategy="ddp") under torchrun; a user's callback on rank 0
writes a checkpoint to slow storage after batch 5 (here: the write, then a wait for the network file
system), while the other ranks go on into the next batch's gradient all-reduce and wait there. The job
is healthy: the save ends and training goes on."""

import os
import time

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

SAVE_SECONDS = float(os.environ.get("SCENARIO_SAVE_SECONDS", "4"))
OUT = os.environ.get("SCENARIO_OUT", ".")


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x).squeeze(-1), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-2)


class SnapshotToNFS(L.Callback):
    @L.pytorch.utilities.rank_zero_only
    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: object) -> None:
        if trainer.global_step == 5:
            path = os.path.join(OUT, f"snapshot-step{trainer.global_step}.pt")
            torch.save(module.state_dict(), path)
            time.sleep(SAVE_SECONDS)  # the NFS flush: a slow storage server, not a bug


def main() -> None:
    data = TensorDataset(torch.randn(256, 16), torch.randn(256))
    trainer = L.Trainer(accelerator="cpu", strategy="ddp", devices=int(os.environ["LOCAL_WORLD_SIZE"]),
                        max_epochs=1, limit_train_batches=12, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[SnapshotToNFS()])  # fmt: skip
    trainer.fit(Regressor(), DataLoader(data, batch_size=8))


if __name__ == "__main__":
    main()
