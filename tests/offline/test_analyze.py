"""Offline analysis: log formats, attribution on real runs' logs, bad input. No torch needed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import FIXTURES, ROOT
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic_diag.core.log_lines import completion_line
from elastic_diag.offline.analyze import Analyzer, analyze_paths, format_analysis
from elastic_diag.offline.files import PREFILTERS, grep_is_gnu_compatible

RUNS = FIXTURES / "runs"


# --- formats ---------------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(st.binary(max_size=4000))
def test_analyze_never_raises_on_arbitrary_bytes(tmp_path_factory, data):
    d = tmp_path_factory.mktemp("fuzz")
    (d / "rank_1.log").write_bytes(data)
    (d / "console.log").write_bytes(b"[rank0]: " + data)
    a = analyze_paths([d])
    assert a.diagnosis.failure_class
    json.dumps(a.to_json())


_CUDA = b"RuntimeError: CUDA error: an illegal memory access was encountered"


@pytest.mark.parametrize("prefilter", PREFILTERS)
def test_a_log_behind_a_hole_of_nul_bytes_is_read_and_the_hole_is_noted(tmp_path, monkeypatch, prefilter):
    """Issue 30: a crashed writer or a sparse file leaves NUL bytes (8 KB and more at the start, or mid-file):
    the text after them is read, never "skipped as binary" (a failed job called healthy), and the note says
    what was skipped. A real binary file is still skipped, with its kind."""
    monkeypatch.setenv("ELASTIC_DIAG_PREFILTER", prefilter)
    (tmp_path / "rank_3.log").write_bytes(
        b"\0" * 16384 + b"[rank3]: Traceback (most recent call last):\n"
        b'[rank3]:   File "train.py", line 9, in step\n[rank3]: ' + _CUDA + b"\n"
    )
    (tmp_path / "rank_0.log").write_bytes(b"step 1\n" + b"\0" * 5000 + b"step 2\n")
    a = analyze_paths([tmp_path])
    assert (a.diagnosis.initiating_rank, a.diagnosis.failure_class) == (3, "cuda_error"), format_analysis(a)
    notes = [s for s in a.skipped if "NUL bytes" in s]
    assert any("rank_3.log: 16384 NUL bytes" in s for s in notes) and any("rank_0.log: 5000" in s for s in notes)


def test_a_real_binary_file_is_still_skipped_with_its_kind(tmp_path):
    files = {"core": b"\x7fELF\x02\x01\x01" + b"\0" * 9000, "plot.png": b"\x89PNG\r\n\x1a\n" + b"\0" * 9000,
             "model.pt": b"PK\x03\x04" + b"\0" * 9000, "blob.bin": bytes(range(1, 256)) * 40}  # fmt: skip
    for name, data in files.items():
        (tmp_path / name).write_bytes(data + b"\n" + _CUDA + b"\n")
    a = analyze_paths([tmp_path])
    assert a.files == [] and a.diagnosis.failure_class != "cuda_error"
    assert sorted(s.split(": ", 1)[1] for s in a.skipped) == [
        "not a log (a PNG image), skipped", "not a log (a zip archive (a torch checkpoint is one)), skipped",
        "not a log (an ELF executable, library or core dump), skipped", "not a log (binary), skipped",
    ]  # fmt: skip


@pytest.mark.parametrize("prefilter", PREFILTERS)
@pytest.mark.parametrize("glue", [b"", b"\r"])
def test_a_culprit_after_a_progress_bar_longer_than_a_line_is_found(tmp_path, monkeypatch, prefilter, glue):
    """Issue 30: one physical line of 100 KB of \\r-separated bar frames, then rank 3's error (glued to the last
    frame, or after a \\r): each frame is a line to a terminal, so the error is not cut off with the line."""
    monkeypatch.setenv("ELASTIC_DIAG_PREFILTER", prefilter)
    bar = b"".join(b"\r 45%%|####      | %d/100000 [00:01<00:02, 1234.5it/s]" % i for i in range(2000))
    assert len(bar) > 64 * 1024
    (tmp_path / "console.log").write_bytes(b"[rank0]: step 1\n" + bar + glue + b"[rank3]: " + _CUDA + b"\n")
    a = analyze_paths([tmp_path / "console.log"])
    assert (a.diagnosis.initiating_rank, a.diagnosis.failure_class) == (3, "cuda_error"), format_analysis(a)


def test_junk_numbers_in_a_log_give_a_verdict_and_name_no_rank(tmp_path):
    """Issue 30: a rank prefix of 5,000 digits (Python refuses int() of that), a rank no C int holds, an exit
    code and a SeqNum of thousands of digits: no traceback, the failure is seen, and no rank comes from junk."""
    junk = "7" * 5000
    (tmp_path / "console.log").write_text(
        f"[rank{junk}]: RuntimeError: boom\n[rank99999999999]: Traceback (most recent call last):\n"
        f"Rank 99999999999 crashed with exit code 1\n  rank      : {junk} (local_rank: {junk})\n"
        f"[rank1]: [Rank {junk}] Watchdog caught collective operation timeout: WorkNCCL(SeqNum={junk}, OpType=X)\n"
        f"failed (exitcode: {junk}) local_rank: {junk} (pid: {junk}) of binary\n"
    )
    (tmp_path / f"rank_{'9' * 200}.log").write_text("RuntimeError: boom\n")
    a = analyze_paths([tmp_path])
    assert a.failure_seen and a.diagnosis.failure_class != "healthy"
    assert all(0 <= ev.rank <= 1 for ev in a.evidence.ranks), [ev.rank for ev in a.evidence.ranks]
    assert a.diagnosis.initiating_rank in (None, 1)
    json.dumps(a.to_json())


# --- attribution on the logs of real runs -----------------------------------------------------------


@pytest.mark.parametrize(
    "name, rank, cls",
    [("diag_hang", 2, "hang"), ("diag_sigkill", 2, "killed"), ("diag_segfault", 2, "segfault"),
     ("torchrun_console_cleanup_allreduce.log", 2, "python_exception")],
)  # fmt: skip
def test_real_runs(name, rank, cls):
    a = analyze_paths([RUNS / name])
    assert (a.diagnosis.initiating_rank, a.diagnosis.failure_class) == (rank, cls), format_analysis(a)


def test_context_keeps_the_lines_before_the_decisive_one():
    a = analyze_paths([RUNS / "torchrun_console_cleanup_allreduce.log"])
    assert a.context[-1].endswith("ValueError: injected failure: bad batch at step 3")
    assert any("Traceback (most recent call last)" in line for line in a.context)
    assert len(a.context) <= 101


def test_culprit_silent_while_every_other_rank_timed_out(tmp_path):
    for r in (0, 1, 3):
        (tmp_path / f"rank_{r}.log").write_text(
            "step 10 loss 0.3\nRuntimeError: [../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 30000ms "
            "for recv operation to complete\n"
        )
    (tmp_path / "rank_2.log").write_text("step 9 loss 0.31\nstep 10 loss 0.30\n")
    a = analyze_paths([tmp_path])
    assert (a.diagnosis.initiating_rank, a.diagnosis.failure_class) == (2, "hang")
    assert a.diagnosis.roles == {0: "collateral", 1: "collateral", 2: "initiating", 3: "collateral"}


def test_only_timeouts_names_nobody(tmp_path):
    for r in range(3):
        line = "RuntimeError: Timed out waiting 30000ms for recv operation to complete\n"
        (tmp_path / f"rank_{r}.log").write_text(line)
    a = analyze_paths([tmp_path])
    assert a.diagnosis.initiating_rank is None and a.diagnosis.failure_class == "collective_timeout"


# --- bad input ---------------------------------------------------------------------------------------


def test_bad_input_is_skipped_and_reported(tmp_path):
    (tmp_path / "empty.log").write_text("")
    (tmp_path / "core.bin").write_bytes(bytes(range(256)) * 64)
    (tmp_path / "latin1_rank_1.log").write_bytes(b"caf\xe9 \xff\xfe\nValueError: caf\xe9 broke\n")
    (tmp_path / "rank_2.log").write_bytes(b"x" * (10 << 20) + b"\nstep 1\n")  # a single 10 MB line
    (tmp_path / "truncated_rank_3.log").write_bytes(b"RuntimeError: Connection closed by peer [10.0.0.1]:29")
    loop = tmp_path / "loop"
    loop.mkdir()
    os.symlink(loop, loop / "again")
    a = analyze_paths([tmp_path, tmp_path / "missing.log"])
    assert any("binary" in s for s in a.skipped)
    assert any("missing.log" in s for s in a.skipped)
    assert (a.diagnosis.initiating_rank, a.diagnosis.exception_type) == (1, "ValueError")
    assert a.ranks[3].lines  # the truncated last line still counts


def test_ten_thousand_files(tmp_path):
    for i in range(10_000):
        (tmp_path / f"rank_{i}.log").write_text("step 1 ok\n")
    (tmp_path / "rank_7777.log").write_text("step 1\nFatal Python error: Segmentation fault\n")
    a = analyze_paths([tmp_path])
    assert (a.diagnosis.initiating_rank, a.diagnosis.failure_class) == (7777, "segfault")


def test_cli_json_and_missing_path(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-m", "elastic_diag.cli", "analyze", "--json", str(RUNS / "diag_hang")],
                       capture_output=True, text=True, timeout=60, env=env)  # fmt: skip
    assert p.returncode == 1, p.stderr  # a failure was diagnosed
    out = json.loads(p.stdout)
    assert out["schema"] == "elastic_diag.analysis/1"
    assert out["diagnosis"]["initiating_rank"] == 2 and {r["rank"] for r in out["ranks"]} == {0, 1, 2, 3}
    p = subprocess.run([sys.executable, "-m", "elastic_diag.cli", "analyze", str(tmp_path / "nope")],
                       capture_output=True, text=True, timeout=60, env=env)  # fmt: skip
    assert p.returncode == 2 and "no such file" in p.stderr


# --- fixtures rewritten from public reports (tests/fixtures/logs/*/expected.json) ----------------------

LOG_FIXTURES = sorted((FIXTURES / "logs").glob("*/expected.json"))


def _fixture_param(path: Path) -> object:
    """A fixture the analyzer gets wrong today says so (``known_gap`` in its expected.json): it is an
    expected failure, and a strict one, so the day it passes the gap is closed in the data too."""
    gap = json.loads(path.read_text()).get("known_gap")
    marks = [pytest.mark.xfail(strict=True, reason=f"known gap: {gap}")] if gap else []
    return pytest.param(path, id=path.parent.name, marks=marks)


@pytest.mark.parametrize("expected_file", [_fixture_param(p) for p in LOG_FIXTURES])
def test_public_report_fixtures(expected_file, record_property):
    expected = json.loads(expected_file.read_text())
    a = analyze_paths([expected_file.parent])
    got = (a.diagnosis.initiating_rank, a.diagnosis.failure_class)
    # read by conftest.py's terminal summary: the score of the analyzer on the whole corpus, and on the
    # fixtures an issue added, before its change (``before``: what the analyzer said then) and now
    before = expected.get("before") or {}
    record_property("fixture_score", [got[0] == expected["initiating_rank"], got[1] == expected["failure_class"],
                                      expected.get("added_in"), expected.get("family"),
                                      before.get("initiating_rank") == expected["initiating_rank"],
                                      before.get("failure_class") == expected["failure_class"]])  # fmt: skip
    assert got == (expected["initiating_rank"], expected["failure_class"]), (
        f"{expected_file.parent.name}: {expected.get('why')}\n{format_analysis(a)}"
    )
    if "all_ranks" in expected:  # every rank failed the same way: no rank is to blame before the others
        assert a.diagnosis.all_ranks is expected["all_ranks"], format_analysis(a)


def test_the_fixture_table_lists_every_fixture():
    """tests/fixtures/logs/README.md's table is generated from the expected.json files: current."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import fixture_table
    finally:
        sys.path.pop(0)
    readme = (FIXTURES / "logs" / "README.md").read_text()
    assert fixture_table.render(readme) == readme, "run: python tools/fixture_table.py"


SUSPECT_FIXTURES = [p for p in LOG_FIXTURES if "suspected_rank" in json.loads(p.read_text())]


def _suspect_param(path: Path) -> object:
    gap = json.loads(path.read_text()).get("known_gap_suspect")
    marks = [pytest.mark.xfail(strict=True, reason=f"known gap: {gap}")] if gap else []
    return pytest.param(path, id=path.parent.name, marks=marks)


@pytest.mark.parametrize("expected_file", [_suspect_param(p) for p in SUSPECT_FIXTURES])
def test_a_suspect_is_given_when_no_rank_is_proven(expected_file):
    """Where the fixture's author saw a rank that stands out without proof (``suspected_rank``), the
    analysis names it as suspected, with the reason, and still names no initiating rank."""
    expected = json.loads(expected_file.read_text())
    d = analyze_paths([expected_file.parent]).diagnosis
    assert (d.initiating_rank, d.suspected_rank) == (None, expected["suspected_rank"]), d.summary
    assert d.suspected_reason and f"rank {d.suspected_rank}" in d.summary


def test_every_prefilter_gives_the_same_analysis(monkeypatch):
    """Hyperscan, the system grep and Python's bytes.find are only faster or slower first stages:
    each gives the same analysis of every fixture (and each is the one used when asked for)."""
    sets = [p.parent for p in LOG_FIXTURES] + [RUNS / "diag_hang", RUNS / "diag_segfault"]
    results = {}
    for name in PREFILTERS:
        monkeypatch.setenv("ELASTIC_DIAG_PREFILTER", name)
        if Analyzer().prefilter != name:
            continue  # not installed here (hyperscan is a dependency on Linux x86_64/aarch64 only)
        results[name] = [analyze_paths([s]).to_json() for s in sets]
    assert "python" in results and len(results) >= 2, list(results)
    first, *others = results
    for other in others:
        for s, a, b in zip(sets, results[first], results[other], strict=True):
            for key in ("diagnosis", "ranks", "context", "torchrun_root_cause_rank"):
                assert a[key] == b[key], (s.name, key, first, other)


def test_no_grep_setting_means_python_or_hyperscan(monkeypatch):
    monkeypatch.setenv("ELASTIC_DIAG_NO_GREP", "1")
    monkeypatch.setenv("ELASTIC_DIAG_PREFILTER", "grep")
    assert Analyzer().prefilter != "grep"


def test_a_grep_without_gnu_output_is_not_used(tmp_path, monkeypatch):
    """BusyBox's grep has no -b/-Z (BSD's -Z means decompress): it is detected once, Python reads the
    files instead, and the analysis is the same. Real BusyBox when it is installed (.ci/run installs it)."""
    busybox = shutil.which("busybox")
    if busybox is None:
        pytest.skip("busybox is not installed (apt-get install busybox)")
    fixture = FIXTURES / "logs" / "60_rank_files_valueerror_rank4"
    monkeypatch.setenv("ELASTIC_DIAG_PREFILTER", "grep")
    expected = analyze_paths([fixture]).to_json()
    (tmp_path / "grep").symlink_to(busybox)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    grep_is_gnu_compatible.cache_clear()
    try:
        assert shutil.which("grep") == str(tmp_path / "grep")
        assert not grep_is_gnu_compatible()
        analyzer = Analyzer()
        assert analyzer.prefilter in ("hyperscan", "python")  # the next that works here
        analyzer.add_paths([fixture])
        got = analyzer.finish().to_json()
    finally:
        grep_is_gnu_compatible.cache_clear()
    for key in ("diagnosis", "ranks", "context"):
        assert got[key] == expected[key], key


def test_local_rank_prefixes_of_two_nodes_are_not_merged():
    """[defaultN] is a local rank: node 1's [default1] is global rank 5, not rank 1 of node 0."""
    a = analyze_paths([FIXTURES / "logs" / "74_two_node_consoles_local_prefixes_rank6"])
    assert sorted(a.ranks) == list(range(8))
    assert a.diagnosis.collateral_ranks == (0, 1, 2, 3, 4, 5, 7)


# --- never "healthy" on a failure; healthy only when the run ended well --------------------------------

ROOT_CAUSE_ONLY = """\
[2024-11-05 10:11:03,112] torch.distributed.elastic.multiprocessing.api: [ERROR] failed (exitcode: -6) \
local_rank: 0 (pid: 4242) of binary: /usr/bin/python
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
train.py FAILED
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2024-11-05_10:11:03
  host      : gpu-node-1
  rank      : 0 (local_rank: 0)
  exitcode  : -6 (pid: 4242)
  error_file: <N/A>
  traceback : Signal 6 (SIGABRT) received by PID 4242
============================================================
"""


@pytest.mark.parametrize(
    "text, cls",
    [
        ("epoch 1 step 100 loss 2.31\nSegmentation fault (core dumped)\n", "segfault"),
        ("torch.distributed.DistStoreError: Socket Timeout\n", "rendezvous_timeout"),
        ("torch.distributed.DistStoreError: Timed out after 901 seconds waiting for clients. 1/2 clients joined.\n",
         "rendezvous_timeout"),
        ("slurmstepd: error: Detected 1 oom-kill event(s) in StepId=4242.0. Some of your processes may have been "
         "killed by the cgroup out-of-memory handler.\n", "host_oom"),
        ("[W socket.cpp:436] [c10d] The server socket has failed to bind to [::]:29500 (errno: 98).\n",
         "port_conflict"),
        ("step 10 loss 1.2\nKilled\n", "killed"),
        (ROOT_CAUSE_ONLY, "abort"),
    ],
    ids=["segfault-line", "store-socket-timeout", "store-waiting-for-clients", "slurm-oom-event", "errno-98",
         "bare-killed", "root-cause-sigabrt"],
)  # fmt: skip
def test_a_log_that_shows_a_failure_is_never_healthy(tmp_path, text, cls):
    (tmp_path / "console.log").write_text(text)
    a = analyze_paths([tmp_path])
    assert a.diagnosis.failure_class == cls, format_analysis(a)
    assert a.failure_seen and a.diagnosis.summary


@pytest.mark.parametrize(
    ("text", "rank", "cls"),
    [
        ("torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.hpp:275, "
         "unhandled cuda error (run with NCCL_DEBUG=INFO for details), NCCL version 2.20.5\nncclUnhandledCudaError: "
         "Call to CUDA function failed.\nLast error:\nCuda failure 'out of memory'\n", None, "cuda_oom"),
        ("[rank3]: RuntimeError: NCCL communicator was aborted on rank 3.\n", None, "collective_timeout"),
        ("[rank0]: torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL"
         ".cpp:1970, unhandled system error (run with NCCL_DEBUG=INFO for details), NCCL version 2.21.5\n[rank0]: "
         "Last error:\n[rank0]: socketStartConnect: Connect to 10.0.0.2<52321> failed : Software caused connection "
         "abort\n", 0, "network_error"),
        ("torch.multiprocessing.spawn.ProcessExitedException: process 1 terminated with signal SIGKILL\n", 1, "killed"),
        ("Exception: process 2 terminated with signal SIGSEGV\n", 2, "segfault"),
        ("RuntimeError: Timed out initializing process group in store based barrier on rank: 2, for key: "
         "store_based_barrier_key:1 (world_size=4, worker_count=3, timeout=0:30:00)\n", None, "rendezvous_timeout"),
        ("subprocess.CalledProcessError: Command '['/usr/bin/python', 'train.py']' died with <Signals.SIGKILL: 9>.\n",
         None, "killed"),
        ("RuntimeError: Expected all tensors to be on the same device, but found at least two devices, cuda:1 and "
         "cuda:0!\n", None, "python_exception"),
    ],
    ids=["nccl-cuda-oom", "communicator-aborted", "socket-connect", "spawn-sigkill", "spawn-sigsegv",
         "store-barrier", "accelerate-sigkill", "bare-exception"],
)  # fmt: skip
def test_one_or_two_pasted_lines_are_classified(tmp_path, text, rank, cls):
    """What people paste into an issue title or a chat: a line or two, no prefix, no launcher summary."""
    (tmp_path / "console.log").write_text(text)
    d = analyze_paths([tmp_path]).diagnosis
    assert (d.initiating_rank, d.failure_class) == (rank, cls), d.summary


def test_a_log_hard_wrapped_at_the_terminal_width_reads_as_the_whole_one(tmp_path):
    """A paste out of tmux or a fixed-width terminal: every long line cut at the same column. The lines
    are joined back before matching, and the verdict is the one of the log with its lines whole."""
    lines = [f"[rank{r}]:[E1201 10:00:0{r}.123456789 ProcessGroupNCCL.cpp:632] [Rank {r}] Watchdog caught collective "
             f"operation timeout: WorkNCCL(SeqNum={101 if r != 2 else 97}, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, "
             "Timeout(ms)=600000) ran for 600071 milliseconds before timing out." for r in range(4)]  # fmt: skip
    whole = tmp_path / "whole"
    whole.mkdir()
    (whole / "console.log").write_text("\n".join(lines) + "\n")
    wrapped = tmp_path / "wrapped"
    wrapped.mkdir()
    width = 97
    (wrapped / "console.log").write_text("".join(
        "".join(line[i : i + width] + "\n" for i in range(0, len(line), width)) for line in lines))  # fmt: skip
    expected = analyze_paths([whole]).diagnosis
    assert (expected.initiating_rank, expected.failure_class) == (2, "collective_desync"), expected.summary
    got = analyze_paths([wrapped]).diagnosis
    assert (got.initiating_rank, got.failure_class) == (2, "collective_desync"), got.summary


def test_healthy_only_when_the_run_says_it_ended_well(tmp_path):
    log = tmp_path / "console.log"
    log.write_text("[default0]:epoch 1 step 100 loss 2.31\n[default1]:epoch 1 step 100 loss 2.30\n")
    cut = analyze_paths([tmp_path])
    assert cut.diagnosis.failure_class == "unknown" and not cut.failure_seen
    assert "nothing in them says the run ended well" in cut.diagnosis.summary
    with log.open("a") as fp:
        fp.write("I0115 09:41:15.003000 2201 torch/distributed/elastic/agent/server/api.py:879] [default] worker "
                 "group successfully finished. Waiting 300 seconds for other agents to finish.\n")  # fmt: skip
    done = analyze_paths([tmp_path])
    assert done.diagnosis.failure_class == "healthy" and not done.failure_seen
    assert "worker group successfully finished" in done.diagnosis.evidence[0]


@pytest.mark.parametrize("line", [
    "I0115 09:41:15.003000 2201 torch/distributed/elastic/agent/server/api.py:879] [default] worker group successfully "
    "finished. Waiting 300 seconds for other agents to finish.",
    "INFO:torch.distributed.elastic.agent.server.api:Local worker group finished (WorkerState.SUCCEEDED)",
    "[2024-05-01 10:00:00,123] [INFO] [launch.py:351:main] Process 4242 exits successfully.",
    "Training completed. Do not forget to share your model on huggingface.co/models =)",
    "`Trainer.fit` stopped: `max_epochs=3` reached.",
    "srun: launch/slurm: _step_signal: Terminating StepId=1234.0 ... task 0 exited with exit code 0",
    '{"name": "torchelastic.worker.status.SUCCEEDED", "source": "WORKER", "timestamp": 0, "metadata": {}}',
    "***** train metrics *****",
    "{'train_runtime': 5123.4, 'train_samples_per_second': 12.1, 'train_loss': 0.91, 'epoch': 3.0}",
    "[after training is done] datetime: 2024-03-26 09:37:40",
    ':::MLLOG {"key": "run_stop", "value": null, "metadata": {"status": "success"}}',
    "ENDING TIMING RUN AT 2023-09-27 07:41:40 PM",
    "Training completed after 10 iterations at 2024-01-10 19:56:58. Total running time: 51min 37s",
    "INFO: Job finished (status: SUCCEEDED).",
    "status: SUCCEEDED",
    "2024-06-01 12:00:00 | INFO | Training finished.",
    "[rank0]:[W604 08:55:15.856 ProcessGroupNCCL.cpp:1496] Warning: WARNING: destroy_process_group() was not called "
    "before program exit, which can leak resources.",
])  # fmt: skip
def test_every_completion_line_is_looked_for(line):
    """The end of every file is searched for a completion line only when it holds one of these words
    (a quick test before parsing): each kind of completion line holds one."""
    from elastic_diag.offline.analyze import _COMPLETION_WORDS

    assert completion_line(line) and any(w.decode() in line for w in _COMPLETION_WORDS)


@pytest.mark.parametrize("line", [
    "Training finished iteration 1 at 2025-01-10 19:56:58. Total running time: 51min 37s",  # Ray: one report
    "training done: 3 of 10 epochs",
    "Map:  17%|#7        | 170/1000 [00:01<00:08, 99.1 examples/s]",
])  # fmt: skip
def test_lines_that_only_look_like_an_end_are_not(line):
    assert not completion_line(line)


def test_a_progress_bar_with_a_record_glued_after_it_is_two_lines():
    from elastic_diag.offline.analyze import _frames

    bar = "Running tokenizer on dataset:   9%|#    | 280000/2969526 [29:55<4:48:08, 155.57 examples/s]"
    record = "[E ProcessGroupNCCL.cpp:475] [Rank 2] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=2)"
    assert _frames(bar + record) == [bar, record]
    assert _frames(bar + " done") == [bar + " done"]


def test_exit_status_says_whether_a_failure_was_found(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cli = [sys.executable, "-m", "elastic_diag", "analyze"]
    healthy = subprocess.run([*cli, str(FIXTURES / "logs" / "70_healthy_torchrun_console")], capture_output=True,
                             text=True, timeout=60, env=env)  # fmt: skip
    assert healthy.returncode == 0 and "healthy" in healthy.stdout
    (tmp_path / "core").write_bytes(b"\x7fELF" + bytes(range(256)) * 64)
    unreadable = subprocess.run([*cli, str(tmp_path)], capture_output=True, text=True, timeout=60, env=env)
    assert unreadable.returncode == 2 and "nothing readable" in unreadable.stderr


def test_gzipped_logs_are_read_and_other_archives_are_listed(tmp_path):
    """The same analysis from gzipped logs as from the plain ones; a .zst is listed as skipped, not read
    as text; a gzipped log cut short still gives what it holds."""
    import gzip

    case = FIXTURES / "logs" / "52_slurm_keyerror_rank3_collateral_timeouts"
    for f in case.glob("job.*.out"):
        (tmp_path / f"{f.name}.gz").write_bytes(gzip.compress(f.read_bytes()))
    plain, packed = analyze_paths([case]), analyze_paths([tmp_path])
    assert packed.diagnosis.to_json() == plain.diagnosis.to_json()
    assert [r.stderr_tail for r in packed.ranks.values()] == [r.stderr_tail for r in plain.ranks.values()]
    (tmp_path / "rank_9.log.zst").write_bytes(b"(\xb5/\xfd" + bytes(100))
    whole = (tmp_path / "job.3.out.gz").read_bytes()
    (tmp_path / "job.3.out.gz").write_bytes(whole[: len(whole) // 2])
    a = analyze_paths([tmp_path])
    assert any("rank_9.log.zst: compressed" in s for s in a.skipped)
    assert any("job.3.out.gz" in s for s in a.skipped) or 3 in a.ranks


# --- evidence folders: read as the live agent reads them ---------------------------------------------


def test_a_diag_dir_half_written_gives_a_verdict_and_says_what_is_missing(tmp_path):
    """A run killed mid-write, a copy missing files, a report from another version: a verdict from what is
    there, the list of what could not be read, no traceback."""
    run = tmp_path / "run"
    shutil.copytree(RUNS / "diag_sigkill", run)
    (run / "report.json").write_text('{"schema": "elastic_diag.report/7", "status": "fail')  # cut, another version
    (run / "attempt_0" / "report.json").write_text(json.dumps({"schema": "elastic_diag.report/7", "ranks": [
        {"rank": 2, "exit_code": -9, "role": "weird"}, {"rank": 0, "exit_code": 1}, {"rank": "x"}]}))  # fmt: skip
    (run / "attempt_0" / "rank_1" / "exception.json").write_text("{garbled")
    (run / "attempt_0" / "rank_3" / "stderr.log").write_bytes(bytes(range(256)) * 100)
    (run / "attempt_0" / "rank_0" / "fr_trace.json").write_text('{"version": "2.10", "entries": [')
    a = analyze_paths([run])
    assert (a.diagnosis.initiating_rank, a.diagnosis.failure_class) == (2, "killed"), a.diagnosis.summary
    said = " ".join(a.skipped)
    assert "schema 'elastic_diag.report/7'" in said and "rank 0: not a usable flight-recorder dump" in said, said
    out = subprocess.run([sys.executable, "-m", "elastic_diag.cli", "analyze", str(run)], capture_output=True,
                         text=True, timeout=60, cwd=ROOT)  # fmt: skip
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr


def test_the_diag_dir_alone_and_without_its_reports_give_the_same_verdict():
    """report.json is the live verdict, never evidence: the rank folders alone give the same one."""
    import tempfile

    for case in ("diag_hang", "diag_segfault", "diag_sigkill"):
        with tempfile.TemporaryDirectory() as tmp:
            copy = Path(tmp) / case
            shutil.copytree(RUNS / case, copy)
            for written in copy.rglob("report.*"):
                if written.parent != copy / "attempt_0":  # an earlier version's folder keeps its exits there
                    written.unlink()
            alone = analyze_paths([copy]).diagnosis
        whole = analyze_paths([RUNS / case]).diagnosis
        assert (alone.initiating_rank, alone.failure_class) == (whole.initiating_rank, whole.failure_class), case


# --- repeats of a line (other digits, the same rank) are skipped: the same verdicts, faster -------------------


def _read_every_line(monkeypatch):
    """The analyzer as it was before it skipped repeats: every candidate line read, no chunk read as dense."""
    import elastic_diag.offline.analyze as analyze

    monkeypatch.setattr(analyze.Analyzer, "_key", lambda self, line_bytes, file_rank: None)
    monkeypatch.setattr(analyze, "_DENSE_LINES", 1 << 62)


def _verdict(a):
    d = a.to_json()["diagnosis"]
    return {k: d.get(k) for k in ("failure_class", "initiating_rank", "collateral_ranks", "summary", "signature")}


def test_skipping_repeats_changes_no_fixture_verdict(monkeypatch):
    """Every log fixture: the verdict (class, culprit, roles, summary) with repeats skipped is the one of a read
    of every line."""
    fixtures = sorted(p for p in (FIXTURES / "logs").iterdir() if p.is_dir())
    skipping = {p.name: _verdict(analyze_paths([p / "input"] if (p / "input").exists() else [p])) for p in fixtures}
    _read_every_line(monkeypatch)
    every = {p.name: _verdict(analyze_paths([p / "input"] if (p / "input").exists() else [p])) for p in fixtures}
    assert {k: v for k, v in skipping.items() if v != every[k]} == {}


def _dense_log(path: Path, lines: int, tail: str) -> None:
    """A console of 8 ranks where every line holds an anchor word: the retry warnings, evaluation bars and
    tokenizer warnings real runs print over and over, then ``tail``."""
    import random

    rng = random.Random(3)
    out = []
    for n in range(lines):
        r = rng.randrange(8)
        kind = n % 4
        if kind == 0:
            out.append(f"[rank{r}]:wandb: Network error (ReadTimeout), entering retry loop. attempt {n}")
        elif kind == 1:
            out.append(
                f"[rank{r}]:Evaluating: {n % 100:3d}%|####      | {n % 100}/100 [00:{n % 60:02d}<00:10, 3.1it/s]"
            )
        elif kind == 2:
            out.append(
                f"[rank{r}]:Exception ignored in: <function _ConnectionBase.__del__ at 0x7f{rng.getrandbits(40):010x}>"
            )
        else:
            size = rng.randrange(1025, 9000)
            out.append(f"[rank{r}]:Token indices sequence length is longer than the maximum ({size} > 1024). error")
    path.write_text("\n".join(out) + "\n" + tail)


def test_a_dense_log_is_read_as_every_line_would_be(tmp_path, monkeypatch):
    """20,000 lines that each hold an anchor (read as a dense chunk), then rank 5's out-of-memory error and the
    others' timeouts: the culprit is named, as by a read of every line, and quickly."""
    import time

    tail = "\n".join(_timeouts((r for r in range(8) if r != 5), seq=7)) + "\n"
    tail += "[rank5]:torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB. GPU 5 has 79.19 GiB\n"
    _dense_log(tmp_path / "console.log", 20_000, tail)
    t0 = time.perf_counter()
    fast = analyze_paths([tmp_path])
    fast_s = time.perf_counter() - t0
    assert (fast.diagnosis.failure_class, fast.diagnosis.initiating_rank) == ("cuda_oom", 5)
    _read_every_line(monkeypatch)
    t0 = time.perf_counter()
    slow = analyze_paths([tmp_path])
    slow_s = time.perf_counter() - t0
    assert _verdict(fast) == _verdict(slow)
    assert fast_s * 3 < slow_s, (fast_s, slow_s)


def _timeouts(ranks, seq=4):
    return [
        f"[rank{r}]:[Rank {r}] Watchdog caught collective operation timeout: WorkNCCL(SeqNum={seq}, "
        "OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600071 milliseconds before timing out."
        for r in ranks
    ]


def _class_and_culprit(folder: Path, lines: list[str]) -> tuple[str, int | None]:
    (folder / "console.log").write_text("\n".join(lines) + "\n")
    d = analyze_paths([folder]).diagnosis
    return d.failure_class, d.initiating_rank


def test_a_repeated_line_whose_digits_decide_is_read_every_time(tmp_path):
    """Lines the same but for digits that decide (a signal's number, an errno): never skipped. Rank 2 logs a
    SIGTERM banner from a helper process a hundred times, then its own segfault banner."""
    lines = [f"[rank2]:Caught signal 15 (Terminated) in helper {n}" for n in range(100)]
    lines.append("[rank2]:Caught signal 11 (Segmentation fault)")
    assert _class_and_culprit(tmp_path, lines + _timeouts((0, 1, 3))) == ("segfault", 2)


def test_a_rank_past_its_line_bound_keeps_a_new_signature(tmp_path):
    """A rank that logged 500 transient network errors (past the 64 error lines a rank keeps) and then ran out of
    memory keeps its out-of-memory line: the culprit and class are that."""
    error = "urllib3.exceptions.ReadTimeoutError: HTTPSConnectionPool(host='hf.co', port=443): Read timed out."
    lines = [f"[rank1]:{error} (read timeout={n})" for n in range(500)]
    lines.append("[rank1]:torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 1 has 79.19 GiB")
    assert _class_and_culprit(tmp_path, lines + _timeouts((0, 2, 3))) == ("cuda_oom", 1)


_GREEN, _RESET = "\x1b[32m", "\x1b[0m"
# the same failure as users meet it, each a log of 3,000 repeated lines then the culprit's error: (name, lines)
_REPEAT_VARIANTS = [
    # Lightning's progress bar with colours, frames joined by \r on one physical line, srun --label prefixes
    (
        "srun_label_colour_bars",
        [
            f"{r}: {_GREEN}Epoch 0:{_RESET} "
            + "\r".join(
                f"{k:3d}%|##| {k}/100 [00:0{k % 10}<00:09, 9.{k}it/s, loss=nan]" for k in range(n % 50, n % 50 + 3)
            )
            for n in range(3000)
            for r in (n % 4,)
        ]
        + ["2: RuntimeError: CUDA error: an illegal memory access was encountered"],
    ),
    # accelerate's logger repeating a dataloader warning with a changing address, then rank 3's own error
    (
        "accelerate_warning_addresses",
        [
            f"[rank{n % 4}]:{n:05d} - WARNING - accelerate.data_loader - batch sampler <object at 0x7f{n * 7919:010x}> "
            "skipped an incomplete batch: error in collate"
            for n in range(3000)
        ]
        + ["[rank3]:ValueError: expected sequence of length 128 at dim 1 (got 97)"],
    ),
    # DeepSpeed-style bracketed timestamps on every line and a retry error with a changing attempt number
    (
        "deepspeed_timestamped_retries",
        [
            f"[rank{n % 4}]:[2026-12-03 10:{n // 60 % 60:02d}:{n % 60:02d},{n % 1000:03d}] [WARNING] [engine.py:42] "
            f"checkpoint upload attempt {n} failed: Connection reset by peer"
            for n in range(3000)
        ]
        + ["[rank0]:torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.00 GiB. GPU 0 has 79.19 GiB"],
    ),
]


@pytest.mark.parametrize(("name", "lines"), _REPEAT_VARIANTS, ids=[v[0] for v in _REPEAT_VARIANTS])
def test_repeats_in_other_wordings_give_the_verdict_of_every_line(tmp_path, monkeypatch, name, lines):
    """Colours, \\r-joined progress bars, srun's task labels, addresses and timestamps in repeated lines: the
    culprit's own error comes through, and the verdict is the one of a read of every line."""
    fast = _class_and_culprit(tmp_path, lines)
    assert fast[1] == {"srun_label_colour_bars": 2, "accelerate_warning_addresses": 3}.get(name, 0), fast
    _read_every_line(monkeypatch)
    assert _class_and_culprit(tmp_path, lines) == fast


# --- bounded on hostile input ---------------------------------------------------------------------------------


def test_a_gzip_that_expands_a_thousand_times_is_read_in_part_and_says_so(tmp_path, monkeypatch):
    """A .gz of wget-style progress dots (1,000x): read up to 100x its size (at least GZIP_MIN_LIMIT, 1 MiB
    here), the rest not read, and the note says so; never called healthy."""
    import gzip

    import elastic_diag.offline.analyze as analyze

    monkeypatch.setattr(analyze, "GZIP_MIN_LIMIT", 1 << 20)
    with gzip.open(tmp_path / "console.log.gz", "wb", compresslevel=9) as f:
        for _ in range(16):
            f.write(b"[rank2]:" + b"." * (1 << 20) + b"\n")
        f.write(b"[rank2]:RuntimeError: the end\n")
    assert (tmp_path / "console.log.gz").stat().st_size * 500 < 16 << 20
    a = analyze_paths([tmp_path])
    assert any("expands more than 100x" in note and "read its first 1 MiB" in note for note in a.skipped), a.skipped
    assert a.diagnosis.failure_class != "healthy"


def test_a_line_of_48_mb_and_a_rank_of_a_billion_stay_small(tmp_path):
    """One physical line of 48 MB (a progress bar rewritten with \\r, never a newline) before rank 3's error, and a
    rank number of a billion: the culprit is named and the reader's peak memory stays far below the line's size
    (a child process, its own peak RSS)."""
    bar = b"Epoch 0:  45%|####5     | 450/1000 [00:12<00:15, 36.1it/s, loss=2.31]\r"
    with open(tmp_path / "console.log", "wb") as f:
        f.write(bar * ((48 << 20) // len(bar)))
        f.write(b"\n[rank3]:RuntimeError: CUDA error: an illegal memory access was encountered\n")
    billion = "[rank1000000000]:[Rank 1000000000] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, "
    (tmp_path / "other.log").write_text(billion + "OpType=ALLREDUCE) ran for 600071 milliseconds\n")
    # the child's own high-water mark (VmHWM): getrusage's ru_maxrss of a child keeps its parent's at exec
    code = (
        "import sys; from elastic_diag.offline.analyze import analyze_paths; a = analyze_paths([sys.argv[1]]); "
        "hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1]; "
        "print(a.diagnosis.failure_class, a.diagnosis.initiating_rank, hwm)"
    )
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, cwd=ROOT,
                         timeout=120, check=True).stdout.split()  # fmt: skip
    assert out[:2] == ["cuda_error", "3"], out
    assert int(out[2]) < 200 * 1024, f"peak RSS {out[2]} KB"
