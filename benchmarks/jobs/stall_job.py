"""A small CPU training job (DDP, or FSDP2 with ``--fsdp2``) in which one rank stalls the way real jobs do.

``--stall`` chooses what the culprit does at ``--at-step`` while its peers go on into their next
collective and wait there:

* ``sleep``: a blocking call that never returns (a read from a dead NFS mount, modelled by a sleep);
* ``lock``: a lock that a prefetch thread holds forever;
* ``queue``: ``queue.get()`` on a batch queue whose producer thread died;
* ``gil``: a regex with catastrophic backtracking, native code that holds the GIL (no Python thread of
  the rank runs: its beacon cannot answer);
* ``reduce-scatter`` (with ``--fsdp2``): a gradient hook on the culprit blocks inside its backward, so
  its peers wait in FSDP2's reduce-scatter of that layer's gradients;
* ``save``: rank 0 spends ``--save-seconds`` in ``save_checkpoint`` while the others wait in the barrier
  after it, then the job goes on (a healthy run);
* ``slow-first-step``: every rank spends ``--first-step-seconds`` in its first step (compilation, a cold
  cache), then trains normally (a healthy run);
* ``straggler``: the culprit's steps take ``--slow-factor`` times as long as its peers' (a healthy run);
* ``none``: a healthy run.

The culprit writes the wall-clock time at which it stalls to ``--mark-file`` first.
"""

from __future__ import annotations

import argparse
import os
import queue
import re
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stall", default="none",
                   choices=("none", "sleep", "lock", "queue", "gil", "reduce-scatter", "save", "slow-first-step",
                            "straggler"))  # fmt: skip
    p.add_argument("--culprit-rank", type=int, default=1)
    p.add_argument("--at-step", type=int, default=6)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--step-seconds", type=float, default=0.1, help="simulated work per step")
    p.add_argument("--pg-timeout", type=float, default=300.0)
    p.add_argument("--fsdp2", action="store_true")
    p.add_argument("--save-seconds", type=float, default=40.0)
    p.add_argument("--first-step-seconds", type=float, default=20.0)
    p.add_argument("--slow-factor", type=float, default=3.0)
    p.add_argument("--mark-file", default=None)
    return p.parse_args()


def mark(path: str | None) -> None:
    if path:
        with open(path, "w") as fp:
            fp.write(repr(time.time()))


def save_checkpoint(model: torch.nn.Module, step: int, seconds: float) -> None:
    """Rank 0 writes the checkpoint; a slow shared file system makes it take ``seconds``."""
    state = {"step": step, "model": model.state_dict()}
    torch.save(state, os.devnull)
    time.sleep(seconds)


class BatchQueue:
    """Batches from a producer thread, as a prefetching loader hands them over."""

    def __init__(self, fail_after: int | None) -> None:
        self.q: queue.Queue[torch.Tensor] = queue.Queue(maxsize=4)
        self.fail_after = fail_after
        threading.Thread(target=self._produce, name="prefetch", daemon=True).start()

    def _produce(self) -> None:
        n = 0
        while True:
            if self.fail_after is not None and n >= self.fail_after:
                return  # the producer died (an exception swallowed by a bare except, say): nothing more comes
            self.q.put(torch.randn(32, 32))
            n += 1

    def next(self) -> torch.Tensor:
        return self.q.get()


def stall_now(kind: str) -> None:
    if kind == "sleep":
        while True:
            time.sleep(1.0)
    if kind == "lock":
        held = threading.Lock()
        threading.Thread(target=held.acquire, name="prefetch", daemon=True).start()
        time.sleep(0.1)
        held.acquire()
    if kind == "gil":
        re.match(r"(a+)+$", "a" * 64 + "!")


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.pg_timeout))
    rank = dist.get_rank()
    culprit = rank == args.culprit_rank
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 1))  # fmt: skip
    if args.fsdp2:
        from torch.distributed.fsdp import fully_shard

        # parameters stay unsharded between forward and backward, so the first collective of the backward is
        # the reduce-scatter of the last layer's gradients (with resharding it would be an all-gather)
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, reshard_after_forward=False)
        fully_shard(model, reshard_after_forward=False)
    else:
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    stalls_in_queue = args.stall == "queue" and culprit
    batches = BatchQueue(fail_after=args.at_step if stalls_in_queue else None)
    for step in range(args.steps):
        at = step == args.at_step
        if at and culprit and args.stall in ("sleep", "lock", "gil", "queue"):
            mark(args.mark_file)
        if at and culprit and args.stall in ("sleep", "lock", "gil"):
            stall_now(args.stall)
        x = batches.next()  # the queue stall: its producer is gone
        out = model(x)
        if at and culprit and args.stall == "reduce-scatter":
            mark(args.mark_file)
            out.register_hook(lambda grad: stall_now("sleep"))  # blocks inside this rank's backward
        loss = torch.nn.functional.mse_loss(out, x.sum(dim=1, keepdim=True))
        opt.zero_grad()
        loss.backward()
        opt.step()
        work = args.step_seconds
        if step == 0 and args.stall == "slow-first-step":
            work = args.first_step_seconds
        if culprit and args.stall == "straggler":
            work *= args.slow_factor
        time.sleep(work)
        if at and args.stall == "save":
            if rank == 0:
                mark(args.mark_file)
                save_checkpoint(model, step, args.save_seconds)
            dist.barrier()  # the others wait here for rank 0's save
        if rank == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
