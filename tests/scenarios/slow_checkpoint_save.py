"""A DDP loop that checkpoints every few steps the way many training scripts do: rank 0 writes the
state, everyone meets in a barrier, training goes on. The shared file system is slow today, so rank 0's
save takes SCENARIO_SAVE_SECONDS (fsync on a busy NFS server, modelled by a wait) while the others
wait in the barrier. With a collective timeout above the save the run is healthy; with
SCENARIO_PG_TIMEOUT below it, the others time out in the barrier, and rank 0, reaching it late, finds
them gone. Prints "step N" lines."""

import os
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

SAVE_SECONDS = float(os.environ.get("SCENARIO_SAVE_SECONDS", "8"))
PG_TIMEOUT = float(os.environ.get("SCENARIO_PG_TIMEOUT", "300"))
CKPT_EVERY = 5


def save_checkpoint(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, folder: str) -> None:
    path = os.path.join(folder, f"step{step:06d}.pt")
    with open(path, "wb") as fp:
        torch.save({"step": step, "model": model.state_dict(), "opt": opt.state_dict()}, fp)
        fp.flush()
        time.sleep(SAVE_SECONDS)  # os.fsync(fp.fileno()) on a file server that answers slowly today
    print(f"saved {path}", flush=True)


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=PG_TIMEOUT))
    rank = dist.get_rank()
    model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    folder = tempfile.mkdtemp(prefix="ckpt-")
    for step in range(1, 9):
        x = torch.randn(16, 16)
        loss = torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(0.05)
        if rank == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
        if step % CKPT_EVERY == 0:
            if rank == 0:
                save_checkpoint(model, opt, step, folder)
            dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
