"""An exception as a rank recorded or printed it (core/exceptions.py): its chain, its sections, the user's
line, and the one JSON codec, which never raises on a record someone else wrote. Pure."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic_diag.core.exceptions import (
    ExceptionRecord,
    exception_from_error_file,
    exception_from_file_data,
    exception_from_json,
    exception_to_json,
)

CHAINED = """Traceback (most recent call last):
  File "/job/train.py", line 40, in step
    batch = next(it)
ValueError: bad shard 3

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File "/job/train.py", line 44, in step
    dist.barrier()
  File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 4000, in barrier
RuntimeError: Connection closed by peer
"""


def record() -> ExceptionRecord:
    return ExceptionRecord(type="RuntimeError", message="Connection closed by peer", traceback=CHAINED, time=5.0,
                           chain=(("ValueError", "bad shard 3"),),
                           mro=("RuntimeError", "builtins.Exception"))  # fmt: skip


def test_sections_locations_and_names():
    exc = record()
    assert "bad shard 3" in exc.section(0) and "Connection closed" in exc.section(-1)
    assert exc.location() == "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py:4000 in barrier"
    assert exc.user_location() == "/job/train.py:44 in step"
    assert exc.last_line == "RuntimeError: Connection closed by peer"
    assert exc.type_names() == ("RuntimeError", "builtins.Exception")


def test_the_codec_round_trips_and_bounds_what_it_writes():
    exc = record()
    assert exception_from_json(exception_to_json(exc)) == exc
    cut = exception_to_json(exc, message_chars=4, traceback_chars=10, time=9.0)
    assert cut["message"] == "Conn" and len(cut["traceback"]) == 10 and cut["time"] == 9.0


def test_torchelastic_s_error_file_and_ours_are_told_apart():
    theirs = {"message": {"message": "KeyError: 'label'", "extraInfo": {"py_callstack": "tb", "timestamp": "12"}}}
    got = exception_from_file_data(theirs)
    assert got is not None and (got.type, got.message, got.time) == ("KeyError", "'label'", 12.0)
    ours = exception_from_file_data({"type": "ValueError", "message": "x", "traceback": "", "time": 3.5})
    assert ours is not None and ours.type == "ValueError" and ours.time == 3.5


@pytest.mark.parametrize("data", [None, [], "x", {"type": ""}, {"type": 3}, {"message": {"message": 5}}])
def test_garbage_is_no_record(data):
    assert exception_from_json(data) is None
    assert exception_from_error_file(data if isinstance(data, dict) else None) is None


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(["type", "message", "traceback", "time", "mro", "chain", "thread",
                                        "problems"]),
                       st.none() | st.text(max_size=20) | st.floats() | st.lists(st.text(max_size=5) | st.lists(
                           st.text(max_size=5), max_size=3), max_size=3)))  # fmt: skip
def test_the_reader_never_raises(data):
    exception_from_json(data)
