"""Model weights downloaded once per node under the ``filelock`` library's FileLock, as the Hugging Face
libraries do: the first rank to take the lock downloads, the others poll the lock and then read the
cached file. Rank 0 had the weights in its cache already and waits in the first barrier. On rank 1 the
download stalls (the mirror accepts the connection and never answers, no timeout set), so rank 1 holds the
lock forever, rank 2 polls it forever, and rank 0 waits in the barrier. The rank that holds the others up
is rank 1. SCENARIO_FAIL_RANK=-1: the mirror answers."""

import os
import socket
import tempfile
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from filelock import FileLock


def mirror(answers: bool) -> socket.socket:
    server = socket.create_server(("127.0.0.1", 0))
    if answers:

        def serve() -> None:
            while True:
                conn, _ = server.accept()
                conn.recv(4096)
                conn.sendall(b"\x00" * 1024)
                conn.close()

        threading.Thread(target=serve, daemon=True).start()
    return server


def cached_weights(cache: str, address: tuple[str, int]) -> str:
    path = os.path.join(cache, "model.safetensors")
    with FileLock(path + ".lock"):
        if not os.path.exists(path):
            with socket.create_connection(address) as conn:
                conn.sendall(b"GET /org/model/resolve/main/model.safetensors\n")
                data = conn.recv(1 << 16)
            with open(path, "wb") as f:
                f.write(data)
    return path


def main() -> None:
    fail_rank = int(os.environ.get("SCENARIO_FAIL_RANK", "1"))
    dist.init_process_group("gloo", timeout=timedelta(seconds=6))
    rank = dist.get_rank()
    cache = os.path.join(tempfile.gettempdir(), f"hub_cache_{os.environ['TORCHELASTIC_RUN_ID']}")
    os.makedirs(cache, exist_ok=True)
    server = mirror(answers=rank != fail_rank)
    if rank != 0:
        while rank != 1 and not os.path.exists(os.path.join(cache, "model.safetensors.lock")):
            time.sleep(0.05)  # the scenario's timing: rank 1's download takes the lock first
        path = cached_weights(cache, server.getsockname())
        print(f"rank {rank}: weights at {path}", flush=True)
    dist.barrier()
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _step in range(3):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        opt.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
