"""The failures the examples can inject, one name each, shared by train_ddp.py and train_fsdp2.py.

``INJECTIONS`` maps each name to the failure class elastic_diag reports for it (the classes of docs/report.md).
Every class the product knows has at least one. Where a CPU can produce the failure for real, it
does (a segfault is a real SIGSEGV, a full disk is a real write to /dev/full, a port conflict a real
bind on the master port). Three cannot happen without a GPU or a real network fabric; for those the
culprit raises what torch raises there, with the message it prints (``SIMULATED``).

Three kinds of injection:

* at ``--at-step`` on the culprit (:func:`inject_now`): an exception, a signal, a hang...
* before ``init_process_group`` on the culprit (:func:`before_init`): ``late-join``;
* inside the training step (``IN_STEP``), written by each script where its collectives are.
"""

from __future__ import annotations

import ctypes
import os
import queue
import re
import signal
import socket
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

INJECTIONS: dict[str, str] = {
    "none": "healthy",
    "exception": "python_exception",
    "transient": "python_exception",  # fails on the first attempt only: a restart succeeds
    "segfault": "segfault",
    "abort": "abort",
    "sigkill": "killed",
    "exit": "silent_exit",
    "memoryerror": "host_oom",
    "cuda-oom": "cuda_oom",
    "cuda-error": "cuda_error",
    "network-error": "network_error",
    "disk-full": "io_error",
    "port-conflict": "port_conflict",
    "late-join": "rendezvous_timeout",
    "hang": "hang",
    "deadlock": "hang",
    "infinite-loop": "hang",
    "regex-hang": "hang",
    "skip-collective": "collective_desync",
    "extra-collective": "collective_desync",
    "shape-mismatch": "collective_mismatch",
    "recv-deadlock": "collective_timeout",
    "nan": "nan_inf",
    "straggler": "straggler",  # a warning: the job still succeeds
}
SIMULATED = ("cuda-oom", "cuda-error", "network-error")
IN_STEP = ("skip-collective", "extra-collective", "shape-mismatch", "recv-deadlock", "nan", "straggler")


def describe() -> str:
    """The --inject help: every name with the class it produces."""
    return "; ".join(f"{k} ({v}{', simulated' if k in SIMULATED else ''})" for k, v in INJECTIONS.items())


def announce(kind: str, step: int | str) -> None:
    """A last word on stderr, as a real job's log has before it dies (kept even after SIGKILL)."""
    print(f"rank {os.environ.get('RANK')}: step {step}: injecting {kind}", file=sys.stderr, flush=True)


def mark(mark_file: str | None) -> None:
    """The wall-clock time of the failure, written first (the detection-latency benchmark reads it)."""
    if mark_file:
        with open(mark_file, "w") as fp:
            fp.write(repr(time.time()))


def before_init(kind: str, rank: int, culprit: int, pg_timeout: float) -> None:
    """``late-join``: the culprit does slow rank-local work before init_process_group, longer than
    the process-group timeout its peers wait there (a dataset scan, a download)."""
    if kind == "late-join" and rank == culprit:
        announce(kind, "init")
        time.sleep(pg_timeout * 3 + 30)


def inject_now(kind: str, step: int, mark_file: str | None = None, model: Any = None) -> None:
    """The culprit's failure at ``step`` (the kinds that are not IN_STEP)."""
    announce(kind, step)
    mark(mark_file)
    if kind == "exception" or (kind == "transient" and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"):
        raise ValueError(f"injected failure: bad batch at step {step}")
    if kind == "segfault":
        ctypes.string_at(0)  # reads address 0: SIGSEGV in native code
    if kind == "abort":
        os.abort()  # SIGABRT, as std::terminate in a C++ extension
    if kind == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "exit":
        os._exit(1)
    if kind == "memoryerror":
        _ = b"x" * (1 << 62)
    if kind == "cuda-oom":  # simulated: what the caching allocator raises on a GPU
        raise torch.OutOfMemoryError(
            "CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of 79.10 GiB of which "
            "3.21 GiB is free. Of the allocated memory 71.43 GiB is allocated by PyTorch, and 2.91 GiB is reserved "
            "by PyTorch but unallocated."
        )
    if kind == "cuda-error":  # simulated: an asynchronous kernel fault surfacing at the next sync
        raise torch.AcceleratorError(
            "CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be asynchronously "
            "reported at some other API call, so the stacktrace below might be incorrect."
        )
    if kind == "network-error":  # simulated: an InfiniBand completion error on this rank's link
        # NCCL prints its WARN line on stderr, then the collective raises the generic remote error
        print(f"{socket.gethostname()}:{os.getpid()}:{os.getpid() + 7} [0] transport/net_ib.cc:1295 NCCL WARN "
              "NET/IB : Got completion from peer 10.0.0.3<52244> with status=12 opcode=0 len=0 vendor err 129 (Send) "
              "localGid ::ffff:10.0.0.2 remoteGid ::ffff:10.0.0.3", file=sys.stderr, flush=True)  # fmt: skip
        raise dist.DistBackendError(
            "NCCL error in: ProcessGroupNCCL.cpp:3356, remote process exited or there was a network error, NCCL "
            "version 2.27.3\nncclRemoteError: A call failed possibly due to a network error or a remote process "
            "exiting prematurely."
        )
    if kind == "disk-full":  # a real write to a full device: torch.save's own error
        torch.save(model.state_dict() if model is not None else {"step": step}, "/dev/full")
    if kind == "port-conflict":  # a second store on the job's own master port, as a stray server would
        # (not as one of the job's ranks: with torchrun's shared store, TORCHELASTIC_USE_AGENT_STORE makes torch
        # ignore a rank's failed bind on that port)
        os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
        dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=True,
                      timeout=timedelta(seconds=10))  # fmt: skip
    if kind == "hang":
        while True:  # stuck outside any collective; the peers wait in the next collective
            time.sleep(0.5)
    if kind == "deadlock":
        deadlocked_loader()
    if kind == "infinite-loop":
        spin()
    if kind == "regex-hang":
        # catastrophic backtracking: the regex engine holds the GIL for hours, so no Python thread of
        # this process runs (only a signal handler written in C can still dump its stack)
        re.match(r"(a+)+$", "a" * 64 + "!")


def recv_deadlock() -> None:
    """Every rank waits to receive from the next one and none sends: a pipeline schedule bug where
    every rank is inside a collective and no single rank is to blame."""
    rank, world = dist.get_rank(), dist.get_world_size()
    buf = torch.zeros(1)
    dist.recv(buf, src=(rank + 1) % world)


def deadlocked_loader() -> None:
    """A prefetching loader thread that takes two locks in the opposite order to the main thread: the
    main thread then waits forever for a batch that never comes (a classic dataloader deadlock)."""
    batches: queue.Queue[int] = queue.Queue()
    a, b = threading.Lock(), threading.Lock()

    def loader() -> None:
        with b:
            time.sleep(0.2)
            with a:
                batches.put(1)

    threading.Thread(target=loader, name="prefetch", daemon=True).start()
    with a:
        time.sleep(0.1)
        with b:
            pass
    batches.get()


def spin() -> None:
    """A Python loop that never ends (a convergence loop whose condition is never met)."""
    x = 0.0
    while x >= 0:
        x = (x + 1.0) % 1000.0
