"""The evidence folder's readers: bounded, and never raising on a missing, garbled or foreign file; the
same reader for the live capture and the offline analyzer."""

from __future__ import annotations

import json
import pickle
import resource

from hypothesis import given, settings
from hypothesis import strategies as st

from elastic_diag.layout import (
    ERROR_FILE,
    EXCEPTION_FILE,
    FR_FILE,
    load_flight_record,
    read_exception,
    read_flight_record,
    read_json,
    read_progress,
    read_tail,
)


def test_tail_of_a_flooded_file_is_bounded(tmp_path):
    big = tmp_path / "stderr.log"
    with open(big, "wb") as fp:
        chunk = (b"x" * 1023 + b"\n") * 1024  # 1 MiB
        for _ in range(200):  # 200 MiB
            fp.write(chunk)
        fp.write(b"RuntimeError: the last line\n")
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    lines = read_tail(big, max_lines=5)
    assert lines[-1] == "RuntimeError: the last line" and len(lines) == 5
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before < 20_000  # KiB


def test_tail_survives_binary_and_missing_files(tmp_path):
    f = tmp_path / "bin.log"
    f.write_bytes(b"\xff\xfe\x00garbage\nok line\n")
    assert read_tail(f, 10)[-1] == "ok line"
    assert read_tail(tmp_path / "missing.log", 10) == ()
    (tmp_path / "exception.json").write_text("{not json")
    assert read_exception(tmp_path) is None


def test_torchelastic_error_file_is_read_when_ours_is_absent(tmp_path):
    msg = {"message": {"message": "ValueError: bad shard 7", "extraInfo": {"py_callstack": "Traceback ...",
                                                                           "timestamp": "1764432000"}}}  # fmt: skip
    (tmp_path / ERROR_FILE).write_text(json.dumps(msg))
    exc = read_exception(tmp_path)
    assert exc is not None and (exc.type, exc.message, exc.time) == ("ValueError", "bad shard 7", 1764432000.0)
    ours = {"type": "KeyError", "message": "'x'", "traceback": "", "time": 1764432001.5}
    (tmp_path / EXCEPTION_FILE).write_text(json.dumps(ours))
    exc = read_exception(tmp_path)
    assert exc is not None and (exc.type, exc.time) == ("KeyError", 1764432001.5)  # ours wins: the precise one


def test_json_reader_refuses_what_is_not_an_object_or_too_big(tmp_path):
    f = tmp_path / "x.json"
    for text in ("[1, 2]", "", "{", "null"):
        f.write_text(text)
        assert read_json(f) is None
    f.write_text(json.dumps({"pad": "x" * (2 << 20)}))
    assert read_json(f) is not None and read_progress(f) is None  # progress.json is bounded to 1 MiB
    assert read_json(tmp_path / "missing.json") is None


def test_flight_record_reader_says_why_a_dump_is_unusable(tmp_path):
    assert read_flight_record(tmp_path, 3) == (None, None)  # no dump: nothing to say
    (tmp_path / FR_FILE).write_text('{"version": "2.10", "entries": [{"garbled": ')
    record, problem = read_flight_record(tmp_path, 3)
    assert record is None and problem is not None and problem.startswith("rank 3: not a usable flight-recorder dump")
    log = tmp_path / "trace.log"
    log.write_text("a log line that mentions a trace\n")
    assert not load_flight_record(log, 3).is_dump  # not a dump at all: the analyzer reads it as a log
    big = tmp_path / "big_trace.pkl"
    big.write_bytes(pickle.dumps({"entries": []}) + b"\0" * 2048)
    got = load_flight_record(big, 3, max_bytes=1024)
    assert got.record is None and got.problem is not None and "over the 1024-byte limit" in got.problem


# --- read_attempt: the one reader of an attempt's folder --------------------------------------------

STACK = """Current thread 0x00007f01 (most recent call first):
  File "/job/train.py", line 77 in fetch
  File "/job/train.py", line 92 in main
"""


def _attempt(tmp_path):
    """A folder as a run leaves it: launcher.json, three rank folders with what the ranks wrote."""
    from elastic_diag.core.evidence import AttemptEvidence, RankEvidence
    from elastic_diag.layout import AttemptLayout, RankLayout, write_launcher_record

    attempt = tmp_path / "attempt_0"
    layout = AttemptLayout(attempt=0, dir=attempt)
    for r in range(3):
        (attempt / f"rank_{r}").mkdir(parents=True)
        layout.ranks[r] = RankLayout(rank=r, local_rank=r, dir=attempt / f"rank_{r}")
        (attempt / f"rank_{r}" / "worker.json").write_text(json.dumps({"pid": 100 + r, "start_time": 1.0}))
    (attempt / "rank_0" / "stderr.log").write_text("step 1\nValueError: bad shard 3\n")
    (attempt / "rank_0" / "exception.json").write_text(json.dumps({"type": "ValueError", "message": "bad shard 3",
                                                                   "traceback": "", "time": 10.0}))  # fmt: skip
    (attempt / "rank_1" / "stderr.log").write_text(
        "[rank1]: RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:4000\n"
    )
    (attempt / "rank_2" / "stacks.txt").write_text("an earlier dump\n" + STACK)
    (attempt / "rank_2" / "progress.json").write_text(json.dumps({"steps": 4, "progress_time": 9.0}))
    seen = AttemptEvidence(attempt=0, run_id="r1", decided_at=11.0, ranks=(
        RankEvidence(rank=0, local_rank=0, node="n", pid=100, exit_code=1, exit_time=10.5),
        RankEvidence(rank=1, local_rank=1, node="n", pid=101, exit_code=1, exit_time=10.9),
        RankEvidence(rank=2, local_rank=2, node="n", pid=102, exit_code=-15, exit_time=12.0, alive_at_decision=True,
                     stopped_by_agent=True)))  # fmt: skip
    write_launcher_record(layout, seen, node="n", tail_lines=40, stack_offsets={2: len("an earlier dump\n")})
    return attempt


def test_read_attempt_gives_what_the_launcher_saw_and_what_the_ranks_wrote(tmp_path):
    from elastic_diag.layout import read_attempt

    read = read_attempt(_attempt(tmp_path))
    ev = {e.rank: e for e in read.evidence.ranks}
    assert read.problems == [] and read.evidence.decided_at == 11.0 and read.evidence.run_id == "r1"
    assert ev[0].exception is not None and ev[0].exception.type == "ValueError" and ev[0].exit_code == 1
    assert [line.signature for line in ev[1].lines] == ["gloo-connection-closed", "python-exception"]
    assert ev[2].stack is not None and str(ev[2].stack.user_frame()) == "/job/train.py:77 in fetch"
    assert ev[2].stopped_by_agent and ev[2].steps == 4 and ev[2].pid == 102


def test_a_folder_half_there_gives_what_is_there_and_says_what_is_missing(tmp_path):
    from elastic_diag.core.classify import classify_attempt
    from elastic_diag.layout import read_attempt

    attempt = _attempt(tmp_path)
    (attempt / "rank_0" / "launcher.json").write_text('{"schema": "elastic_diag.launcher/1", "rank": {"rank": 0, "ex')
    (attempt / "rank_1" / "launcher.json").write_text('{"schema": "elastic_diag.launcher/9", "rank": {}}')
    (attempt / "rank_2" / "progress.json").write_text("{not json")
    (attempt / "rank_1" / "fr_trace.json").write_text('{"version": "2.10", "entries": [')
    read = read_attempt(attempt)
    assert any("rank 1: launcher.json is not one this version reads" in p for p in read.problems), read.problems
    assert any("rank 1: not a usable flight-recorder dump" in p for p in read.problems), read.problems
    assert {e.rank for e in read.evidence.ranks} == {0, 1, 2}
    ev = {e.rank: e for e in read.evidence.ranks}
    assert (
        ev[0].exit_code is None and ev[1].exit_code is None and ev[2].exit_code == -15
    )  # only rank 2's record is read
    d = classify_attempt(read.evidence)
    assert (d.initiating_rank, d.exception_type) == (0, "ValueError")  # its own exception still tells


def test_an_earlier_version_s_folder_takes_the_exits_from_its_report_never_its_roles(tmp_path):
    from elastic_diag.layout import read_attempt

    attempt = _attempt(tmp_path)
    for r in range(3):
        (attempt / f"rank_{r}" / "launcher.json").unlink()
    report = {"schema": "elastic_diag.report/1", "node": "old", "ranks": [
        {"rank": 0, "role": "collateral", "exit_code": 1}, {"rank": 1, "role": "initiating", "exit_code": -9},
        {"rank": 2, "role": "stopped", "exit_code": -15, "stack": STACK}]}  # fmt: skip
    (attempt / "report.json").write_text(json.dumps(report))
    read = read_attempt(attempt)
    ev = {e.rank: e for e in read.evidence.ranks}
    assert [ev[r].exit_code for r in range(3)] == [1, -9, -15] and ev[2].stopped_by_agent
    assert any("earlier version" in p for p in read.problems)


def test_one_node_reads_its_own_ranks_of_a_folder_several_nodes_share(tmp_path):
    """Two agents on a shared file system write into one attempt folder: each judges its own ranks."""
    from elastic_diag.layout import read_attempt

    attempt = _attempt(tmp_path)
    read = read_attempt(attempt, only={0, 2})
    assert {e.rank for e in read.evidence.ranks} == {0, 2} and read.problems == []


def test_write_atomic_masks_secrets_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    from elastic_diag import redaction
    from elastic_diag.layout import write_atomic, write_json_atomic

    monkeypatch.setattr(redaction, "_CURRENT", redaction.Redactor({"s3cr3t-value-123"}))
    write_json_atomic(tmp_path / "a.json", {"token": "s3cr3t-value-123"})
    write_atomic(tmp_path / "b.bin", b"\x00s3cr3t-value-123")  # bytes are written as they are
    assert "s3cr3t" not in (tmp_path / "a.json").read_text()
    assert (tmp_path / "b.bin").read_bytes() == b"\x00s3cr3t-value-123"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "b.bin"]


_FILES = ("launcher.json", "exception.json", "error.json", "thread_exception.json", "progress.json", "worker.json",
          "first_error.json", "nonfinite.json", "fr_trace.json", "stacks.txt", "stderr.log")  # fmt: skip


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(st.sampled_from(_FILES), st.one_of(
    st.binary(max_size=300),
    st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=30),
                 lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
                 max_leaves=20).map(lambda v: json.dumps(v).encode()),
), max_size=len(_FILES)))  # fmt: skip
def test_read_attempt_and_the_verdict_never_raise_on_what_a_folder_holds(tmp_path_factory, files):
    """Whatever a rank folder holds (garbled, foreign, cut), the folder is read, judged, and what was
    unreadable is said: never a traceback."""
    from elastic_diag.core.classify import classify_attempt
    from elastic_diag.layout import read_attempt

    attempt = tmp_path_factory.mktemp("fuzz") / "attempt_0"
    for r in range(2):
        (attempt / f"rank_{r}").mkdir(parents=True)
    for name, data in files.items():
        (attempt / "rank_1" / name).write_bytes(data)
    read = read_attempt(attempt)
    assert {ev.rank for ev in read.evidence.ranks} == {0, 1}
    assert classify_attempt(read.evidence).failure_class


def _one_rank(tmp_path, stderr: str, exception: dict | None, launcher: dict) -> object:
    attempt = tmp_path / "attempt_0"
    (attempt / "rank_1").mkdir(parents=True)
    (attempt / "rank_1" / "stderr.log").write_text(stderr)
    if exception is not None:
        (attempt / "rank_1" / "exception.json").write_text(json.dumps(exception))
    (attempt / "rank_1" / "launcher.json").write_text(
        json.dumps({"schema": "elastic_diag.launcher/1", "attempt": 0, "decided_at": 20.0, "rank": launcher})
    )
    return attempt


def test_a_cause_printed_above_a_long_traceback_is_the_ranks_evidence(tmp_path):
    """A DataLoader worker segfaults while the main process receives a batch from it: the main process raises
    ConnectionResetError from deep in multiprocessing (a traceback of 40+ lines); the worker's own last words,
    above that traceback, name the failure (measured under mpirun: tests/launch/test_exec_parity.py)."""
    from elastic_diag.core.classify import classify_attempt
    from elastic_diag.layout import read_attempt

    frames = "".join(f'[rank1]:   File "/usr/lib/python3.11/multiprocessing/connection.py", line {n}, in _recv\n'
                     f"[rank1]:     chunk = read(handle, remaining)\n" for n in range(25))  # fmt: skip
    stderr = ("UserWarning: This DataLoader will create 2 worker processes in total.\n"
              "ERROR: Unexpected segmentation fault encountered in worker.\n"
              "[rank1]: Traceback (most recent call last):\n" + frames +
              "[rank1]: ConnectionResetError: [Errno 104] Connection reset by peer\n")  # fmt: skip
    attempt = _one_rank(tmp_path, stderr, {"type": "ConnectionResetError", "message": "[Errno 104] Connection reset "
                        "by peer", "traceback": "", "time": 10.0, "mro": ["ConnectionResetError", "ConnectionError",
                        "OSError", "Exception"]}, {"rank": 1, "exit_code": 1, "exit_time": 10.5})  # fmt: skip
    d = classify_attempt(read_attempt(attempt).evidence)
    assert (d.initiating_rank, d.failure_class, d.signature_id) == (1, "segfault", "dataloader-worker-died"), d


def test_the_stack_a_rank_wrote_at_sigterm_is_its_stack_when_no_launcher_took_one(tmp_path):
    """elastic-diag exec: srun and mpirun SIGTERM every process of a step at once and may SIGKILL the watch
    before it asks for a stack; the rank wrote its own (stacks_at_sigterm.txt)."""
    from elastic_diag.layout import read_attempt

    attempt = _one_rank(tmp_path, "", None, {"rank": 1, "exit_code": -15, "exit_time": 10.5,
                                             "stopped_by_agent": True})  # fmt: skip
    (attempt / "rank_1" / "stacks.txt").write_text("")
    (attempt / "rank_1" / "stacks_at_sigterm.txt").write_text(STACK)
    ev = read_attempt(attempt).evidence.ranks[0]
    assert ev.stack is not None and str(ev.stack.user_frame()) == "/job/train.py:77 in fetch"


def test_an_abort_at_teardown_after_the_ranks_own_exception_is_its_consequence(tmp_path):
    """Measured under mp.spawn (tests/launch/test_exec_spawn.py): rank 1 raised IndexError, then its interpreter
    tore down with gloo's threads still joinable and std::terminate aborted it (exit -6). The exception recorded
    first is the failure; a rank that only aborts is still an abort."""
    from elastic_diag.core.classify import classify_attempt
    from elastic_diag.layout import read_attempt

    stderr = ("terminate called without an active exception\nFatal Python error: Aborted\n\n"
              "Thread 0x00007fe43daa0b80 (most recent call first):\n  <no Python frame>\n")  # fmt: skip
    exc = {"type": "IndexError", "message": "list index out of range", "traceback": "", "time": 10.0,
           "mro": ["IndexError", "LookupError", "Exception"]}  # fmt: skip
    attempt = _one_rank(tmp_path, stderr, exc, {"rank": 1, "exit_code": -6, "exit_time": 10.5})
    d = classify_attempt(read_attempt(attempt).evidence)
    assert (d.initiating_rank, d.failure_class, d.exception_type) == (1, "python_exception", "IndexError"), d
    bare = _one_rank(tmp_path / "bare", stderr, None, {"rank": 1, "exit_code": -6, "exit_time": 10.5})
    assert classify_attempt(read_attempt(bare).evidence).failure_class == "abort"
