"""Pick the best checkpoint after evaluation and broadcast its weights from the rank that holds it. Each
rank reads the evaluation scores from the metrics file of its own node; rank 2's node still has an older
file in which rank 2's checkpoint scored best, so rank 2 calls ``broadcast(src=2)`` while ranks 0 and 1
call ``broadcast(src=0)``: the flight recorder shows the same broadcast on every rank, and the collective
hangs (gloo: the two "roots" wait for their sends). SCENARIO_FAIL_RANK=-1: every node has the same file."""

import json
import os
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def best_rank(metrics_file: str) -> int:
    with open(metrics_file) as f:
        scores = json.load(f)
    return max(range(len(scores)), key=lambda r: scores[r])


def main() -> None:
    fail_rank = int(os.environ.get("SCENARIO_FAIL_RANK", "2"))
    dist.init_process_group("gloo", timeout=timedelta(seconds=6))
    rank, world = dist.get_rank(), dist.get_world_size()
    model = DDP(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _step in range(4):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    scores = [0.91] + [0.5] * (world - 1)
    if rank == fail_rank:
        scores[rank] = 0.95  # last week's eval, still on this node
    metrics = os.path.join(tempfile.mkdtemp(prefix=f"eval-node{rank}-"), "scores.json")
    with open(metrics, "w") as f:
        json.dump(scores, f)
    src = best_rank(metrics)
    for p in model.module.parameters():
        dist.broadcast(p.data, src=src)
    print(f"rank {rank}: weights of rank {src}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
