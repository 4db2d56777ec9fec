"""A LightningModule trained with Trainer(accelerator="cpu", strategy="ddp", devices=N) under torchrun;
its training_step fails on rank 1 when a batch has no valid labels."""

import os

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

FAIL_RANK = int(os.environ.get("SCENARIO_FAIL_RANK", "1"))


class Classifier(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        if FAIL_RANK >= 0 and self.global_rank == FAIL_RANK and batch_idx == 3:
            raise ValueError(f"batch {batch_idx} has no valid labels (all masked)")
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def main() -> None:
    data = TensorDataset(torch.randn(256, 16), torch.randint(0, 4, (256,)))
    # under torchrun its TorchElasticEnvironment; started by srun directly, its SLURMEnvironment (as a Slurm user
    # writes it: the devices and nodes from the allocation)
    devices = int(os.environ.get("SLURM_NTASKS_PER_NODE") or os.environ["LOCAL_WORLD_SIZE"])
    trainer = L.Trainer(accelerator="cpu", strategy="ddp", devices=devices,
                        num_nodes=int(os.environ.get("SLURM_NNODES", "1")), max_epochs=1, limit_train_batches=12,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)  # fmt: skip
    trainer.fit(Classifier(), DataLoader(data, batch_size=8))


if __name__ == "__main__":
    main()
