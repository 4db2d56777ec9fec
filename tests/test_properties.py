"""The property suite (issue 30): every parser and reader of what the tool reads from outside, fed arbitrary
bytes and structured near-misses (valid-looking prefixes, cut JSON, mixed encodings, \\r, \\x00, invalid UTF-8,
enormous and non-finite numbers, JSON nested deeper than Python's stack). The contract: a verdict, a value or
None, or the reader's documented error, never another exception; each example within a bounded time.

Parsers and readers covered here (what takes text, bytes or paths from outside), beside the ones their own
modules' tests fuzz (parse_line, rank_from_path: tests/core/test_log_lines.py; analyze_paths on bytes:
tests/offline/test_analyze.py; read_attempt on a rank folder: tests/test_layout.py; progress_from_json:
tests/core/test_progress.py):
core.log_lines (parse_line, SummaryParser.feed, parse_failed_line, parse_fingerprint_report,
parse_launcher_exit, parse_deepspeed_mapping, parse_deepspeed_exit, parse_watchdog_timeout, single_node_line),
core.error_lines (ErrorScanner.feed, error_line_from_json), core.stacks.parse_stack_dump, core.calls
(calls_from_json, calls_from_lines), core.exceptions (exception_from_json, exception_from_file_data),
core.progress (nonfinite_from_json, kernel_from_json), core.stall.stall_from_json, core.blocked.blocked_from_json,
core.merge.parse_record (ValueError), core.flight_recorder.load_dump + parse_record (layout.FR_ERRORS),
layout (read_json, load_flight_record, read_report, read_attempt with every evidence file junk),
report.reading (salvage_object, load_report_dir), offline (analyze_paths, format_analysis).

The budget is the ``ci`` profile (tests/conftest.py); ``HYPOTHESIS_PROFILE=thorough`` runs more examples.
"""

from __future__ import annotations

import contextlib
import json
import time

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elastic_diag.core import log_lines
from elastic_diag.core.blocked import blocked_from_json
from elastic_diag.core.calls import calls_from_json, calls_from_lines
from elastic_diag.core.classify import classify_attempt
from elastic_diag.core.error_lines import ErrorScanner, error_line_from_json
from elastic_diag.core.exceptions import exception_from_file_data, exception_from_json
from elastic_diag.core.flight_recorder import load_dump, parse_record
from elastic_diag.core.merge import parse_record as parse_node_record
from elastic_diag.core.progress import kernel_from_json, nonfinite_from_json, progress_from_json
from elastic_diag.core.stacks import parse_stack_dump
from elastic_diag.core.stall import stall_from_json
from elastic_diag.core.taxonomy import load_taxonomy
from elastic_diag.layout import FR_ERRORS, load_flight_record, read_attempt, read_json, read_report
from elastic_diag.offline.analyze import analyze_paths, format_analysis
from elastic_diag.report.reading import load_report_dir, salvage_object

TAX = load_taxonomy()
SECONDS = 10.0  # one example's bound: any reader taking longer on a few kB is a hang in waiting
_FIXTURE = settings(suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

# near-misses: what real lines start with, and what breaks parsers
_PIECES = ["[rank3]:", "[default1]:", "[rank", "]:", "[Rank 2] ", "E1026 04:01:29.444000 139 x.cpp:616] ",
           "[2024-03-01 12:00:00,123] ", "host-1:42:43 [0] NCCL WARN ", "worker-1: ", "3: ", "Traceback (most "
           "recent call last):", "RuntimeError: ", "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=",
           ", OpType=ALLREDUCE", "exitcode  : ", " (pid: ", "rank      : ", " (local_rank: ", "ChildFailedError",
           "Root Cause (first observed failure):", "[0]:", "=====", "exits with return code = ", "--local_rank=",
           "global_rank_mapping={'w': [0, 1]}", "Rank 4 is running collective: CollectiveFingerPrint(SequenceNumber=",
           "Rank 2 crashed with exit code ", "global_world_sizes=[", "--nnodes=1", "\r", "\x00", "\x1b[31m",
           "\x1b]0;t\x07", "\ufffd", "é", "\u2028", "\n", " ", "7" * 5000, "-", "1e308", "NaN", "Infinity",
           "99999999999"]  # fmt: skip
near_miss_text = st.lists(st.sampled_from(_PIECES) | st.text(max_size=8), max_size=25).map("".join)
any_bytes = st.binary(max_size=3000) | near_miss_text.map(lambda t: t.encode("utf-8", "surrogatepass")) | st.lists(
    st.sampled_from([p.encode() for p in _PIECES] + [b"\xff\xfe", b"\xc3", b"\x80\x04", b"{", b"[" * 3000]),
    max_size=30).map(b"".join)  # fmt: skip
_NUMBERS = (st.integers() | st.integers(min_value=10**300, max_value=10**400) | st.floats()
            | st.sampled_from([-1, 0, 2**31, 2**63, -(2**63), 1e308, -1e308, float("nan"), float("inf")]))  # fmt: skip
any_json = st.recursive(st.none() | st.booleans() | _NUMBERS | near_miss_text,
                        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
                            st.sampled_from(["rank", "time", "pid", "exit_code", "entries", "pg_status", "type",
                                             "message", "traceback", "text", "schema", "ranks", "steps", "since",
                                             "collective_seq_id", "input_sizes", "version", "kind", "calls"])
                            | st.text(max_size=6), inner, max_size=6), max_leaves=25)  # fmt: skip


def _json_bytes(value: object) -> bytes:
    return json.dumps(value, allow_nan=True).encode()


# JSON a file may hold: any JSON, cut JSON, JSON nested deeper than Python's stack, not JSON at all
any_json_file = (any_json.map(_json_bytes) | any_json.map(_json_bytes).flatmap(
    lambda b: st.integers(0, len(b)).map(lambda n: b[:n])) | st.integers(1000, 200_000).map(
    lambda n: b'{"a":' + b"[" * n + b"]" * n + b"}") | any_bytes)  # fmt: skip


def _bounded(started: float) -> None:
    assert time.perf_counter() - started < SECONDS


@given(st.lists(near_miss_text, max_size=30))
def test_the_line_parsers_return_a_value_or_none(lines):
    started = time.perf_counter()
    summary = log_lines.SummaryParser()
    scanner = ErrorScanner(TAX)
    for n, raw in enumerate(lines):
        parsed = log_lines.parse_line(raw)
        assert parsed.rank is None or 0 <= parsed.rank <= 2**31 - 1
        text = parsed.text
        summary.feed(text)
        scanner.feed(raw, float(n))
        for parse in (log_lines.parse_failed_line, log_lines.parse_fingerprint_report, log_lines.parse_launcher_exit,
                      log_lines.parse_deepspeed_mapping, log_lines.parse_deepspeed_exit,
                      log_lines.parse_watchdog_timeout, log_lines.single_node_line, log_lines.message_rank,
                      log_lines.failure_evidence, log_lines.completion_line):  # fmt: skip
            parse(text)
        log_lines.signatures_of(text, TAX)
    summary.finish()
    scanner.first()
    parse_stack_dump("\n".join(lines))
    calls_from_lines(lines)
    _bounded(started)


@given(any_json)
def test_the_json_record_readers_return_a_record_or_none(data):
    started = time.perf_counter()
    exception_from_file_data(data if isinstance(data, dict) else None)  # typed: what read_json returns
    for read in (error_line_from_json, exception_from_json, nonfinite_from_json, kernel_from_json, progress_from_json,
                 stall_from_json, blocked_from_json, calls_from_json):  # fmt: skip
        read(data)
    with contextlib.suppress(ValueError):  # its documented error
        parse_node_record(_json_bytes(data))
    if isinstance(data, dict):
        with contextlib.suppress(*FR_ERRORS):
            parse_record(1, data)
    _bounded(started)


@_FIXTURE
@given(any_json_file)
def test_the_file_readers_return_a_value_none_or_a_problem(tmp_path_factory, raw):
    started = time.perf_counter()
    d = tmp_path_factory.mktemp("readers")
    for name in ("fr_trace.json", "report.json"):
        (d / name).write_bytes(raw)
    data = read_json(d / "report.json")
    assert data is None or isinstance(data, dict)
    got = load_flight_record(d / "fr_trace.json", 1)
    assert got.record is not None or got.problem is not None or not got.is_dump
    with contextlib.suppress(*FR_ERRORS):
        load_dump(raw)
    read_report(d / "report.json", TAX)
    salvage_object(raw.decode("utf-8", "replace"))
    report, problems = load_report_dir(d)
    assert isinstance(report, dict) and isinstance(problems, list)
    _bounded(started)


_EVIDENCE = ("launcher.json", "exception.json", "error.json", "thread_exception.json", "progress.json", "worker.json",
             "first_error.json", "nonfinite.json", "fr_trace.json", "calls.json", "stacks.txt", "stderr.log",
             "stdout.log")  # fmt: skip


@_FIXTURE
@given(st.dictionaries(st.sampled_from(_EVIDENCE), any_json_file, max_size=6), any_json_file)
def test_an_evidence_folder_of_junk_is_judged_and_analyzed(tmp_path_factory, files, stall):
    """Every evidence file junk at once (deep JSON, 1e308, NaN, negative pids and offsets, cut files), and a
    stall record: read, judged, analyzed, shown; never a traceback, never a rank that has no folder."""
    started = time.perf_counter()
    diag = tmp_path_factory.mktemp("diag")
    attempt = diag / "attempt_0"
    for r in (0, 1):
        (attempt / f"rank_{r}").mkdir(parents=True)
    (attempt / "stall_0").mkdir()
    (attempt / "stall_0" / "stall.json").write_bytes(stall)
    for name, data in files.items():
        (attempt / "rank_1" / name).write_bytes(data)
    read = read_attempt(attempt)
    assert {ev.rank for ev in read.evidence.ranks} == {0, 1}
    diagnosis = classify_attempt(read.evidence)
    assert diagnosis.initiating_rank in (None, 0, 1)
    analysis = analyze_paths([diag])
    format_analysis(analysis)
    json.dumps(analysis.to_json())
    _bounded(started)


@_FIXTURE
@given(st.lists(any_bytes, min_size=1, max_size=4), st.sampled_from(["console.log", "rank_2.log", "x.log.gz"]))
def test_logs_of_near_misses_give_a_verdict(tmp_path_factory, pieces, name):
    started = time.perf_counter()
    d = tmp_path_factory.mktemp("logs")
    data = b"\n".join(pieces)
    if name.endswith(".gz"):
        import gzip

        data = gzip.compress(data)[: max(10, len(data) // 2)] if len(pieces) > 2 else gzip.compress(data)
    (d / name).write_bytes(data)
    analysis = analyze_paths([d])
    assert analysis.diagnosis.failure_class
    assert all(0 <= ev.rank <= 2**31 - 1 for ev in analysis.evidence.ranks)
    format_analysis(analysis)
    json.dumps(analysis.to_json())
    _bounded(started)
