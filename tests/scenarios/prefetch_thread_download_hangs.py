"""A prefetching loader: a background thread downloads the next batches from an object store and puts
them on a ``queue.Queue``; the training loop takes them with ``get()`` (no timeout, as most loops do).
On rank 2 the store accepts the connection and then never answers (a stuck gateway, modelled by a
listening socket that never replies), and the download has no timeout, so the thread waits in ``recv``
forever and rank 2's main thread waits in ``queue.get()``, while ranks 0 and 1 wait in the next gradient
all-reduce. SCENARIO_FAIL_RANK=-1: the store answers."""

import os
import queue
import socket
import threading
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def object_store(answers: bool) -> socket.socket:
    server = socket.create_server(("127.0.0.1", 0))
    if answers:

        def serve() -> None:
            while True:
                conn, _ = server.accept()
                conn.recv(4096)
                conn.sendall(b"0.5 0.25 0.125 1.0 2.0 0.75 0.5 0.25\n")
                conn.close()

        threading.Thread(target=serve, daemon=True).start()
    return server


def download(address: tuple[str, int], key: str) -> torch.Tensor:
    with socket.create_connection(address) as conn:  # no timeout
        conn.sendall(f"GET {key}\n".encode())
        data = conn.recv(4096)
    return torch.tensor([float(v) for v in data.split()]).reshape(1, 8).repeat(4, 1)


def prefetch(address: tuple[str, int], rank: int, out: "queue.Queue[torch.Tensor]") -> None:
    for step in range(6):
        out.put(download(address, f"batches/rank{rank}/{step:05d}.bin"))


def main() -> None:
    fail_rank = int(os.environ.get("SCENARIO_FAIL_RANK", "2"))
    dist.init_process_group("gloo", timeout=timedelta(seconds=6))
    rank = dist.get_rank()
    store = object_store(answers=True)
    stuck = object_store(answers=False)
    batches: queue.Queue[torch.Tensor] = queue.Queue(maxsize=2)
    address = (stuck if rank == fail_rank else store).getsockname()
    threading.Thread(target=prefetch, args=(address, rank, batches), name="prefetch", daemon=True).start()
    model = DDP(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(6):
        x = batches.get()
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
