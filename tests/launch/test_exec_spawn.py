"""``elastic-diag exec -- python train.py`` where the script starts its ranks itself (issue 31): the command is
the parent of its ranks. Real runs: ``torch.multiprocessing.spawn`` with 3 gloo ranks (an exception in a child,
a child stuck outside the collective, a parent that catches the failure and exits with its own code; a child
SIGKILLed and a healthy run are in test_exec_parity.py), plain ``multiprocessing`` children with the fork start
method that set their rank in the environment, and a command that never joins a process group."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from elastic_diag.launch.rank_env import LOOKED_FOR
from elastic_diag.report.schema import validate

EXEC = [sys.executable, "-m", "elastic_diag.cli", "exec"]

# As research scripts write it: the parent picks the port, mp.spawn passes the index, the child joins with it.
SPAWN_JOB = """
import logging, os, socket, sys, time
from datetime import timedelta
import torch, torch.distributed as dist, torch.multiprocessing as mp

def train(local_rank, world_size, mode):
    dist.init_process_group("gloo", rank=local_rank, world_size=world_size, timeout=timedelta(seconds=5))
    model = torch.nn.Linear(8, 8)
    for step in range(6):
        if local_rank == 1 and step == 2:
            if mode == "exception":
                batch = []
                batch[step]  # an empty batch from a bad shard
            elif mode == "kill":
                os.kill(os.getpid(), 9)  # what the OOM killer does
            elif mode == "hang":
                time.sleep(120)  # a save to a dead mount
        grad = model.weight.detach().clone()
        dist.all_reduce(grad)
        print(f"rank {local_rank} step {step} loss {float(grad.sum()):.3f}", flush=True)
    dist.destroy_process_group()

if __name__ == "__main__":
    mode = sys.argv[1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if os.environ.get("CATCH"):
        try:
            mp.spawn(train, args=(3, mode), nprocs=3, join=True)
        except Exception as e:
            logging.error("training failed: %s", type(e).__name__)
            sys.exit(2)
    else:
        mp.spawn(train, args=(3, mode), nprocs=3, join=True)
"""

# Plain multiprocessing, fork start method: each child sets its rank in the environment and joins with env://.
FORK_JOB = """
import multiprocessing as mp, os, socket, sys
from datetime import timedelta

def worker(rank, world, port):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch, torch.distributed as dist
    dist.init_process_group("gloo", timeout=timedelta(seconds=5))
    t = torch.ones(4)
    for step in range(4):
        if rank == 2 and step == 1:
            raise RuntimeError("rank 2 could not read its shard: checksum mismatch")
        dist.all_reduce(t)
    dist.destroy_process_group()

if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=worker, args=(r, 3, port)) for r in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    sys.exit(max(abs(p.exitcode) for p in procs))
"""


def _exec(tmp_path: Path, script: str, *args: str, extra: dict[str, str] | None = None,
          timeout: float = 100) -> tuple[subprocess.CompletedProcess[str], Path]:  # fmt: skip
    (tmp_path / "train.py").write_text(script)
    env = {k: v for k, v in os.environ.items() if k not in LOOKED_FOR and k not in ("WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", **(extra or {}))
    diag = tmp_path / "diag"
    p = subprocess.run([*EXEC, "--diag-dir", str(diag), "--", sys.executable, "train.py", *args], env=env,
                       cwd=tmp_path, capture_output=True, text=True, timeout=timeout, check=False)  # fmt: skip
    return p, diag


def _report(diag: Path) -> dict:
    report = json.loads((diag / "report.json").read_text())
    validate(report)
    return report


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    ("mode", "extra", "code", "failure_class"),
    [
        # the parent catches torch's ProcessRaisedException, logs it and exits 2 (an uncaught one, a child
        # SIGKILLed, a healthy run: test_exec_parity.py's mp.spawn cases)
        ("exception", {"CATCH": "1"}, 2, "python_exception"),
        ("hang", {}, 1, "hang"),
    ],
    ids=["exception-caught-by-the-parent", "hang"],
)
def test_mp_spawn_children_are_the_ranks_and_the_culprit_is_named(tmp_path, mode, extra, code, failure_class):
    """torch's own message names the process that exited first (a waiting rank, when rank 1 hangs); the verdict
    names rank 1 whatever it did, with its own evidence: the traceback torch only pickles to the parent, the
    signal, the stack taken before the parent stops it."""
    p, diag = _exec(tmp_path, SPAWN_JOB, mode, extra=extra)
    assert p.returncode == code, p.stderr[-3000:]
    report = _report(diag)
    d = report["diagnosis"]
    assert (report["status"], d["initiating_rank"], d["failure_class"]) == ("failed", 1, failure_class), d
    roles = {r["rank"]: r["role"] for r in report["ranks"]}
    assert roles[1] == "initiating" and {roles[0], roles[2]} <= {"collateral", "unaffected"}, roles
    assert "elastic_diag: job FAILED: initiating rank 1" in p.stderr, p.stderr[-2000:]
    assert "rank 0 step 1 loss" in p.stdout  # the ranks' output still reaches the console
    attempt = diag / "attempt_0"
    assert "rank 0 step 1 loss" in (attempt / "rank_0" / "stdout.log").read_text()
    joined = json.loads((attempt / "rank_1" / "joined.json").read_text())
    assert (joined["rank"], joined["world_size"], joined["spawn_index"]) == (1, 3, 1), joined
    launcher = json.loads((attempt / "rank_1" / "launcher.json").read_text())["rank"]
    if mode == "exception":
        assert "IndexError: list index out of range" in json.dumps(d["evidence"]), d["evidence"]
        assert json.loads((attempt / "rank_1" / "exception.json").read_text())["type"] == "IndexError"
        # its exit 1; SIGTERM from torch's teardown when a peer's "connection closed" ended first; or SIGABRT when
        # its interpreter tore down with gloo's threads still joinable (the exception stays the verdict)
        code = launcher["exit_code"]
        assert code in (1, -6) or (code == -15 and launcher["stopped_by_agent"]), launcher
    else:  # the hang: torch stopped rank 1 (SIGTERM) after rank 0 or 2 timed out
        assert launcher["stopped_by_agent"] and launcher["exit_code"] == -15, launcher
        assert any("train.py:17 in train" in line for line in d["evidence"]), d["evidence"]
    assert (diag / "report.html").is_file() and (attempt / "exec_parent" / "stderr.log").is_file()


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_fork_children_that_set_their_rank_in_the_environment(tmp_path):
    p, diag = _exec(tmp_path, FORK_JOB)
    assert p.returncode == 1, p.stderr[-3000:]
    d = _report(diag)["diagnosis"]
    assert (d["initiating_rank"], d["failure_class"], d["exception_type"]) == (2, "python_exception",
                                                                               "RuntimeError"), d  # fmt: skip
    assert "checksum mismatch" in p.stderr  # multiprocessing prints the child's traceback: now from its folder


@pytest.mark.parametrize(("code", "kept"), [(0, False), (3, True)])
def test_a_command_that_never_joins_a_group_keeps_its_exit_status(tmp_path, code, kept):
    p, diag = _exec(tmp_path, f"import sys; print('hi'); sys.exit({code})")
    assert p.returncode == code and p.stdout == "hi\n", p
    assert "no process of the command joined a process group" in p.stderr
    assert "SLURM_PROCID" in p.stderr and "OMPI_COMM_WORLD_RANK" in p.stderr
    assert diag.exists() is kept
    if kept:
        assert (diag / "attempt_0" / "exec_parent" / "stdout.log").read_text() == "hi\n"
