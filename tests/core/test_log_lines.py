"""Log formats (core/log_lines.py): where a line comes from (its prefixes, its file's path) and torchrun's
failure summary; the parsers never raise."""

from __future__ import annotations

import pytest
from helpers import FIXTURES
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic_diag.core.log_lines import SummaryParser, parse_launcher_exit, parse_line, rank_from_path

RUNS = FIXTURES / "runs"


@pytest.mark.parametrize(
    "line, rank, local, text",
    [
        ("[rank1]:[E1026 04:01:29.444000 139 ProcessGroupNCCL.cpp:616] [Rank 5] Watchdog caught x", 1, False,
         "[Rank 5] Watchdog caught x"),
        ("worker-1: [rank3]: RuntimeError: boom", 3, False, " RuntimeError: boom"),
        ("[default2]:step 3 loss 1.0", 2, True, "step 3 loss 1.0"),
        ("node-a:12345:12401 [2] NCCL WARN NET/IB : Got completion", None, False, "NCCL WARN NET/IB : Got completion"),
        ("RuntimeError: CUDA error: boom", None, False, "RuntimeError: CUDA error: boom"),
        ("[E ProcessGroupNCCL.cpp:737] [Rank 1] Watchdog caught", None, False, "[Rank 1] Watchdog caught"),
    ],
)  # fmt: skip
def test_line_prefixes(line, rank, local, text):
    p = parse_line(line)
    assert (p.rank, p.local, p.text) == (rank, local, text)


def test_nccl_device_is_not_a_rank_and_glog_time_is_kept():
    p = parse_line("host-7:4242:4300 [6] NCCL WARN Call to ibv_create_qp failed")
    assert p.rank is None and p.nccl_device == 6 and p.pid == 4242 and p.host == "host-7"
    g = parse_line("[rank0]:[E1213 17:24:49.082246429 ProcessGroupNCCL.cpp:2573] text")
    assert (g.rank, g.clock, g.pid) == (0, "1213 17:24:49.082246429", None)


@pytest.mark.parametrize(
    "path, rank",
    [("run/attempt_0/rank_5/stderr.log", 5), ("logs/abc_x/attempt_1/3/stderr.log", 3), ("slurm-77_3.out", 3),
     ("job.12.out", 12), ("out/rank_3.log", 3), ("trainer-pod-2.log", 2), ("train.log", None), ("x/rank3.txt", 3)],
)  # fmt: skip
def test_rank_from_path(path, rank):
    assert rank_from_path(path) == rank


def test_torchrun_summary_is_parsed():
    sp = SummaryParser()
    for line in (RUNS / "torchrun_console_cleanup_allreduce.log").read_text().splitlines():
        sp.feed(parse_line(line).text)
    failures = {f.rank: f for f in sp.finish()}
    assert set(failures) == {0, 1, 2, 3}
    assert failures[0].exit_code == -15 and failures[0].signal == "SIGTERM"
    assert failures[2].root and failures[2].exit_code == 1 and failures[2].pid


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=300))
def test_parse_line_never_raises(text):
    p = parse_line(text)
    assert isinstance(p.text, str) and len(p.text) <= len(text)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=120))
def test_rank_from_path_never_raises(text):
    r = rank_from_path(text)
    assert r is None or r >= 0


def test_launchers_that_name_a_global_rank_and_its_exit():
    """Composer's, Open MPI's and Horovod's lines: (rank, status, launcher); a death by signal N is -N."""
    assert parse_launcher_exit("Rank 2 crashed with exit code -7.") == (2, -7, "composer")
    assert parse_launcher_exit("Global rank 3 (PID 4242) exited with code 1") == (3, 1, "composer")
    mpi = "mpirun noticed that process rank 1 with PID 0 on node gpu-07 exited on signal 9 (Killed)."
    assert parse_launcher_exit(mpi) == (1, -9, "mpirun")
    assert parse_launcher_exit("Process 0 exit with status code 137.") == (0, -9, "horovodrun")
    assert parse_launcher_exit("Process 5 exit with status code 1.") == (5, 1, "horovodrun")
    assert parse_launcher_exit("Process 0 exit with status code 137 after 3 retries, restarting") is None
