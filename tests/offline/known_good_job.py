"""A user's small DDP trainer (gloo, CPU) for tests/offline/test_known_good.py: Python logging with timestamps, a
tqdm bar on rank 0, a library warning at start, a shard name and the loss every step. ``--fail raise``: the
culprit rank warns "checksum mismatch ... using cached copy" at ``--fail-at`` and raises two steps later;
``--fail stall``: it warns, then stalls past the collective timeout."""

import argparse
import logging
import os
import random
import socket
import sys
import time
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
from tqdm import tqdm

ap = argparse.ArgumentParser()
ap.add_argument("--seed", type=int, default=0)
ap.add_argument("--steps", type=int, default=12)
ap.add_argument("--fail", choices=["none", "raise", "stall"], default="none")
ap.add_argument("--culprit", type=int, default=1)
ap.add_argument("--fail-at", type=int, default=6)
ap.add_argument("--pg-timeout", type=float, default=6)
a = ap.parse_args()
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
log = logging.getLogger("trainer")
dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
rank, world = dist.get_rank(), dist.get_world_size()
rng = random.Random(a.seed * 100 + rank)
torch.manual_seed(a.seed)
log.info(
    "rank %d/%d on %s pid %d master %s:%s",
    rank,
    world,
    socket.gethostname(),
    os.getpid(),
    os.environ.get("MASTER_ADDR"),
    os.environ.get("MASTER_PORT"),
)
warnings.warn(
    "The default value of use_reentrant will change; pass use_reentrant explicitly", UserWarning, stacklevel=1
)
model = torch.nn.Linear(16, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
bar = tqdm(range(a.steps), disable=rank != 0, file=sys.stderr, mininterval=0)
for step in bar:
    x = torch.randn(32, 16)
    loss = ((model(x) - 1) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    opt.step()
    log.info(
        "step %d loss %.4f lr %.2e shard shard-%05d.tar", step, loss.item(), 0.01 * (0.9**step), rng.randrange(100000)
    )
    bar.set_postfix(loss=f"{loss.item():.3f}")
    if a.fail != "none" and rank == a.culprit:
        if step == a.fail_at:
            log.warning(
                "checksum mismatch for shard-%05d.tar (expected %08x, got %08x), using cached copy",
                rng.randrange(100000),
                rng.getrandbits(32),
                rng.getrandbits(32),
            )
        if step == a.fail_at + 2:
            if a.fail == "raise":
                raise ValueError("cached shard truncated: expected 4096 samples, got 1024")
            time.sleep(a.pg_timeout * 2.5)
    time.sleep(0.05)
log.info("done in %d steps", a.steps)
dist.destroy_process_group()
