"""A data sidecar started by each rank (a small server that decodes and caches samples) tells its rank
it is ready by writing a line into a named pipe; the rank opens the FIFO and reads the line before
training. On rank 1 the sidecar fails at start (its port setting is not a number) and exits, so nothing
ever opens the FIFO for writing and rank 1 waits in ``open()`` forever, while ranks 0 and 2 wait for it in
the first gradient all-reduce. SCENARIO_FAIL_RANK=-1: every sidecar starts."""

import os
import subprocess
import sys
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

SIDECAR = """
import sys
port = int(sys.argv[2])  # the decode server's port
with open(sys.argv[1], "w") as ready:
    ready.write(f"ready on {port}\\n")
"""


def start_sidecar(folder: str, rank: int, port: str) -> str:
    fifo = os.path.join(folder, f"sidecar-{rank}.ready")
    os.mkfifo(fifo)
    subprocess.Popen([sys.executable, "-c", SIDECAR, fifo, port], stderr=subprocess.DEVNULL)
    with open(fifo) as ready:  # blocks until the sidecar opens it for writing
        return ready.readline().strip()


def main() -> None:
    fail_rank = int(os.environ.get("SCENARIO_FAIL_RANK", "1"))
    dist.init_process_group("gloo", timeout=timedelta(seconds=6))
    rank = dist.get_rank()
    folder = tempfile.mkdtemp(prefix="sidecar-")
    status = start_sidecar(folder, rank, "${DECODE_PORT}" if rank == fail_rank else str(7100 + rank))
    print(f"rank {rank}: sidecar {status}", flush=True)
    model = DDP(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _step in range(3):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
