"""The evidence folder's readers: bounded, and never raising on a missing, garbled or foreign file; the
same reader for the live capture and the offline analyzer."""

from __future__ import annotations

import json
import pickle
import resource

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
