"""The first own error a rank printed (elastic_diag.error_lines) and the launcher's line clock that
feeds it (elastic_diag.tailer): pure scanning, then real files written while a thread reads them."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from elastic_diag.agent.tailer import StreamTailer
from elastic_diag.core.error_lines import ErrorScanner, error_line_from_json, error_line_to_json, scan_lines
from elastic_diag.core.taxonomy import load_taxonomy
from elastic_diag.layout import FIRST_ERROR_FILE

TAX = load_taxonomy()
CLOSED = "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:4000"


def tb(last: str, prefix: str = "") -> list[str]:
    return [f"{prefix}Traceback (most recent call last):", f'{prefix}  File "/job/train.py", line 60, in step',
            f"{prefix}    batch = next(it)", f"{prefix}{last}"]  # fmt: skip


def test_a_logged_traceback_is_the_first_error_at_the_time_it_was_printed():
    lines = ["step 1 loss 0.5", "2026-12-01 09:38:21,123 ERROR train: step 3 failed", *tb("ValueError: bad batch 3"),
             "rank 2: saving an emergency checkpoint"]  # fmt: skip
    found = scan_lines(lines, TAX, times=[100.0, 101.0, 101.1, 101.1, 101.1, 101.2, 115.0])
    assert found is not None and found.exception is not None
    assert (found.exception.type, found.exception.message, found.time) == ("ValueError", "bad batch 3", 101.1)
    assert found.text == "ValueError: bad batch 3"


def test_the_timestamp_a_line_carries_wins_when_it_is_earlier():
    """stdout is block-buffered when redirected: the line arrives late, its own timestamp does not."""
    stamp = time.time() - 30
    asctime = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(stamp)) + ",250"
    found = scan_lines([f"{asctime} ERROR train: fetch failed", *tb("OSError: [Errno 5] Input/output error")], TAX,
                       times=[stamp + 29.0] * 5)  # fmt: skip
    assert found is not None and abs(found.time - (int(stamp) + 0.25)) < 0.01
    assert found.logged is not None and found.arrival == found.time or found.logged == found.time


def test_a_timestamp_after_the_arrival_or_hours_before_is_ignored():
    future = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(time.time() + 7200))
    found = scan_lines([f"{future} ERROR x", *tb("ValueError: v")], TAX, times=[time.time()] * 5)
    assert found is not None and found.logged is None


def test_torchs_rank_prefix_is_read_through():
    found = scan_lines(tb("ValueError: bad", prefix="[rank2]: "), TAX)
    assert found is not None and found.exception is not None and found.exception.type == "ValueError"


def test_a_symptom_is_not_the_ranks_own_error():
    assert scan_lines(tb(CLOSED), TAX) is None
    size = ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:446] op.preamble.length <= op.nbytes. "
            "32 vs 16")  # fmt: skip
    assert scan_lines(tb(size), TAX) is None


def test_a_symptom_raised_while_handling_the_ranks_own_error_is_its_own():
    lines = [*tb("ValueError: bad batch"), "", "During handling of the above exception, another exception occurred:",
             "", *tb(CLOSED)]  # fmt: skip
    found = scan_lines(lines, TAX)
    assert found is not None and found.exception is not None
    assert (found.exception.type, found.exception.message) == ("ValueError", "bad batch")


def test_a_threads_exception_is_named_with_its_thread():
    found = scan_lines(["Exception in thread prefetch:", *tb("KeyError: 'label'")], TAX)
    assert found is not None and found.exception is not None and found.exception.thread == "prefetch"


def test_fatal_signal_banners_and_native_errors_outside_a_traceback():
    seg = scan_lines(["step 3", "Fatal Python error: Segmentation fault", "", "Current thread 0x01:"], TAX)
    assert seg is not None and seg.text == "Fatal Python error: Segmentation fault"
    assert scan_lines(["ValueError: a line that is no traceback"], TAX) is None
    assert (
        scan_lines(
            [
                "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=3, OpType=ALLREDUCE, "
                "NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600030 milliseconds"
            ],
            TAX,
        )
        is None
    )


def test_interleaved_tracebacks_give_the_first_complete_one():
    """Two threads printing at once: lines of one land inside the other's."""
    lines = ["Traceback (most recent call last):", "Exception in thread loader:", '  File "/job/a.py", line 1, in f',
             "Traceback (most recent call last):", '  File "/job/b.py", line 2, in g', "ValueError: from a",
             "KeyError: 'from b'"]  # fmt: skip
    found = scan_lines(lines, TAX)
    assert found is not None and found.exception is not None and found.exception.type in ("ValueError", "KeyError")


def test_a_traceback_cut_mid_line_still_counts():
    """SIGKILL in the middle of writing: the last line has no end; the stream's end closes it."""
    found = scan_lines(["Traceback (most recent call last):", '  File "/job/train.py", line 9, in step',
                        "RuntimeError: [enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAll"], TAX)  # fmt: skip
    assert found is not None and found.exception is not None and found.exception.type == "RuntimeError"


def test_huge_and_garbled_lines_are_bounded():
    scanner = ErrorScanner(TAX)
    scanner.feed("x" * 5_000_000, 1.0)
    scanner.feed("\x00\xff" * 1000, 1.0)
    for line in tb("ValueError: " + "m" * 200_000):
        scanner.feed(line, 2.0)
    found = scanner.first()
    assert found is not None and found.exception is not None and len(found.exception.message) <= 20_000


def test_the_record_round_trips_and_garbage_is_refused():
    found = scan_lines(["Exception in thread prefetch:", *tb("ValueError: v")], TAX)
    assert found is not None
    back = error_line_from_json(json.loads(json.dumps(error_line_to_json(found))))
    assert back == found
    for garbage in (None, [], {"text": 3}, {"text": "x", "time": "soon"}, "{"):
        assert error_line_from_json(garbage) is None


def _append(path: Path, text: str) -> None:
    with open(path, "a") as fp:
        fp.write(text)


def test_the_tailer_stamps_lines_as_they_arrive(tmp_path):
    rank_dir = tmp_path / "rank_1"
    rank_dir.mkdir()
    tailer = StreamTailer({1: rank_dir}, poll_s=0.01)
    tailer.start()
    try:
        _append(rank_dir / "stderr.log", "step 0\nstep 1\n")
        time.sleep(0.2)
        before = time.time()
        _append(rank_dir / "stderr.log", "\n".join(tb("ValueError: bad shard")) + "\n")
        _append(rank_dir / "stdout.log", "progress 10%\rprogress 20%\r")  # a progress bar: \r, no \n
        deadline = time.time() + 5
        while not (rank_dir / FIRST_ERROR_FILE).exists() and time.time() < deadline:
            _append(rank_dir / "stderr.log", "cleaning up\n")
            time.sleep(0.05)
    finally:
        tailer.stop()
    found = tailer.first_error(1)
    assert found is not None and found.exception is not None and found.exception.type == "ValueError"
    assert before <= found.time <= before + 1.0
    on_disk = error_line_from_json(json.loads((rank_dir / FIRST_ERROR_FILE).read_text()))
    assert on_disk is not None and on_disk.exception is not None  # written once settled, while lines kept coming
    assert (on_disk.time, on_disk.text, on_disk.exception.type) == (found.time, found.text, "ValueError")


def test_the_tailer_reads_a_last_line_without_newline_once_final(tmp_path):
    rank_dir = tmp_path / "rank_0"
    rank_dir.mkdir()
    _append(rank_dir / "stderr.log", "Fatal Python error: Segmentation fault")  # no newline: killed mid-write
    tailer = StreamTailer({0: rank_dir})
    tailer.poll()
    assert tailer.first_error(0) is None
    tailer.poll(final=True)
    found = tailer.first_error(0)
    assert found is not None and "Segmentation fault" in found.text


@pytest.mark.timeout(30)
def test_a_flood_costs_a_seek_not_the_whole_file(tmp_path):
    rank_dir = tmp_path / "rank_0"
    rank_dir.mkdir()
    with open(rank_dir / "stderr.log", "w") as fp:
        line = "W1201 09:38:21.123 1 ProcessGroupGloo.cpp:12] a warning that repeats\n"
        fp.write(line * ((24 << 20) // len(line)))  # 24 MiB of warnings
        fp.write("\n".join(tb("ValueError: at the end")) + "\n")
    tailer = StreamTailer({0: rank_dir})
    start = time.monotonic()
    for _ in range(3):
        tailer.poll()
    tailer.poll(final=True)
    assert time.monotonic() - start < 5
    assert tailer.skipped_bytes(0) > 0
    found = tailer.first_error(0)
    assert found is not None and found.exception is not None and found.exception.message == "at the end"


def test_an_abort_that_follows_from_a_symptom_is_not_the_ranks_own():
    """gloo aborts the receiver of mismatched data: 'terminate called' then what(): the symptom."""
    lines = ["terminate called after throwing an instance of 'gloo::EnforceNotMet'",
             "  what():  [enforce fail at /pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:446] "
             "op.preamble.length <= op.nbytes. 8 vs 4", "Fatal Python error: Aborted", ""]  # fmt: skip
    assert scan_lines(lines, TAX) is None
    watchdog = ["[rank0]:[E1201 09:38:21.1 1 ProcessGroupNCCL.cpp:616] [Rank 0] Watchdog caught collective operation "
                "timeout: WorkNCCL(SeqNum=9, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for "
                "600010 milliseconds before timing out.", "terminate called after throwing an instance of "
                "'c10::DistBackendError'", "Fatal Python error: Aborted"]  # fmt: skip
    assert scan_lines(watchdog, TAX) is None
    own = scan_lines(["terminate called after throwing an instance of 'std::bad_alloc'", "  what():  std::bad_alloc",
                      "Fatal Python error: Aborted", "", "Current thread 0x01:"], TAX)  # fmt: skip
    assert own is not None and own.text.startswith("terminate called")


def test_a_failing_excepthook_is_read_past_to_the_original_exception():
    lines = ["Error in sys.excepthook:", *tb("ConnectionError: webhook unreachable"), "", "Original exception was:",
             *tb("IndexError: label index 12 is out of range")]  # fmt: skip
    found = scan_lines(lines, TAX)
    assert found is not None and found.exception is not None and found.exception.type == "IndexError"
    peer = ["Error in sys.excepthook:", *tb("ConnectionError: webhook unreachable"), "", "Original exception was:",
            *tb(CLOSED)]  # fmt: skip
    assert scan_lines(peer, TAX) is None


def test_the_own_exception_of_a_chain_keeps_its_own_frames():
    lines = ["Traceback (most recent call last):", '  File "/job/train.py", line 31, in main',
             "ValueError: bad batch", "", "During handling of the above exception, another exception occurred:", "",
             "Traceback (most recent call last):", '  File "/job/train.py", line 40, in save',
             '  File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 9, in barrier',
             CLOSED]  # fmt: skip
    found = scan_lines(lines, TAX)
    assert found is not None and found.exception is not None
    assert found.exception.location() == "/job/train.py:31 in main"


def test_tracebacks_quoted_in_a_message_are_the_messages():
    """DCP's CheckpointException quotes each failed rank's traceback: on every rank, the printed
    exception is the wrapper (a symptom here), not rank 2's inner OSError."""
    quoted = [
        f"Traceback (most recent call last): (RANK {r})" if i == 0 else line
        for r in (1, 2)
        for i, line in enumerate(tb("OSError: [Errno 28] No space left on device"))
    ]
    lines = [*tb("torch.distributed.checkpoint.api.CheckpointException: CheckpointException ranks:dict_keys([1, 2])"),
             *quoted, "", "rank 0: exiting"]  # fmt: skip
    assert scan_lines(lines, TAX) is None


def test_a_progress_bar_and_colours_do_not_hide_the_traceback():
    bar = "Epoch 1:  45%|████▌     | 45/100 [00:02<00:00, 20.1it/s]"
    lines = [bar, f"{bar}Traceback (most recent call last):", '  File "/job/train.py", line 9, in step',
             "\x1b[31mValueError\x1b[0m: \x1b[1mbad batch\x1b[0m"]  # fmt: skip
    found = scan_lines(lines, TAX)
    assert found is not None and found.exception is not None
    assert (found.exception.type, found.exception.message) == ("ValueError", "bad batch")


def test_a_native_line_before_the_traceback_it_caused_is_the_first_error():
    """A DataLoader worker's own signal handler writes its line, then the main process's read of the
    worker's pipe fails (torch 2.13: a bare ConnectionResetError, its traceback the stream's last
    lines). The worker's line came first and says what happened, also when the stream ends there."""
    lines = [
        "ERROR: Unexpected segmentation fault encountered in worker.",
        "\x00[rank1]: Traceback (most recent call last):",
        '[rank1]:   File "/app/train.py", line 34, in main',
        "[rank1]:     for x in loader:",
        '[rank1]:   File "/usr/lib/python3.11/multiprocessing/connection.py", line 395, in _recv',
        "[rank1]:     chunk = read(handle, remaining)",
        "[rank1]: ConnectionResetError: [Errno 104] Connection reset by peer",
    ]
    first = scan_lines(lines, TAX)
    assert first is not None and first.text == lines[0]
    scanner = ErrorScanner(TAX)
    for i, line in enumerate(lines):
        scanner.feed(line, float(i))
    assert (settled := scanner.settled(100.0)) is not None and settled.text == lines[0]


def test_the_line_clock_finds_an_error_glued_after_a_long_progress_bar_and_after_a_nul_hole(tmp_path):
    """Issue 30: the tailer splits at \\r (each frame a line), so a bar of 100 KB without a newline does not hide
    the error glued after it; an error after a crashed writer's NUL bytes is found too (parse_line reads past
    them)."""
    bar = "".join(f"\r 45%|####      | {i}/100000 [00:01<00:02, 1234.5it/s]" for i in range(2000))
    error = "RuntimeError: CUDA error: an illegal memory access was encountered\n"
    for n, text in enumerate((bar + "[rank3]: " + error, "\x00" * 9000 + error)):
        rank_dir = tmp_path / f"rank_{n}"
        rank_dir.mkdir()
        _append(rank_dir / "stderr.log", text)
        tailer = StreamTailer({n: rank_dir})
        tailer.poll(final=True)
        found = tailer.first_error(n)
        assert found is not None and found.text.startswith("RuntimeError: CUDA error"), (n, found)
