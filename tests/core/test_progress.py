"""The beacon's records and the kernel's as typed records (core/progress.py), read from JSON another process
wrote: every field checked, anything else ignored, never an exception."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic_diag.core.progress import (
    GroupStatus,
    KernelEvidence,
    NonFinite,
    Progress,
    Watch,
    kernel_from_json,
    nonfinite_from_json,
    progress_from_json,
)
from elastic_diag.core.values import as_int, as_seconds, as_text, signal_name

BEACON = {"time": 100.5, "pid": 42, "steps": 7, "progress_time": 99.0, "step_durations": [0.5, 0.6, "x"],
          "backward": 7, "heartbeats": 0, "watch": ["eval", 90.0, 30], "beacon_cpu_s": 0.004,
          "pg_status": {"0": {"last_enqueued_collective": 12, "last_completed_collective": 11},
                        "1": {"last_enqueued_collective": 3, "last_completed_collective": 3}, "junk": 5}}  # fmt: skip


def test_progress_json_is_read_field_by_field():
    p = progress_from_json(BEACON)
    assert p is not None
    assert (p.steps, p.progress_time, p.step_durations, p.pid) == (7, 99.0, (0.5, 0.6), 42)
    assert p.watch == Watch("eval", 90.0, 30.0)
    assert p.groups == (GroupStatus("0", 12, 11), GroupStatus("1", 3, 3))
    assert p.in_collective and p.started and p.completed_a_collective()


def test_activity_changes_with_any_progress_and_forward_activity_not_with_a_collective_completing():
    p = progress_from_json(BEACON)
    done = progress_from_json({**BEACON, "pg_status": {"0": {"last_enqueued_collective": 12,
                                                             "last_completed_collective": 12}}})  # fmt: skip
    assert p is not None and done is not None
    assert p.activity() != done.activity()
    assert p.forward_activity() != done.forward_activity()  # group 1 vanished
    same_groups = progress_from_json({**BEACON, "pg_status": {**BEACON["pg_status"], "0": {  # type: ignore[dict-item]
        "last_enqueued_collective": 12, "last_completed_collective": 12}}})  # fmt: skip
    assert same_groups is not None and p.forward_activity() == same_groups.forward_activity()


def test_a_rank_that_shows_nothing_has_not_started():
    p = progress_from_json({"time": 1.0, "pid": 3})
    assert p is not None and not p.started and not p.in_collective and not p.completed_a_collective()


@pytest.mark.parametrize("data", [None, [], "x", 3, {"steps": "7", "watch": ["only", "two"], "pg_status": [1]}])
def test_garbage_is_no_record_or_an_empty_one(data):
    p = progress_from_json(data)
    assert p is None or (p.steps is None and p.watch is None and p.groups == ())


def test_nonfinite_and_kernel_records_round_trip():
    nf = NonFinite(backward=4, step=3, time=40.0, where="train.py:61")
    assert nonfinite_from_json(nf.to_json()) == nf
    assert nonfinite_from_json({"backward": "4"}) is None
    k = KernelEvidence(proven=True, line="Out of memory: Killed process 77", looked_at=("kernel log: a line",))
    assert kernel_from_json(k.to_json()) == k
    assert kernel_from_json({"proven": "yes"}) == KernelEvidence(proven=False)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=6),
    max_leaves=30,
)


@settings(max_examples=200, deadline=None)
@given(JSON)
def test_the_readers_never_raise(data):
    for reader in (progress_from_json, nonfinite_from_json, kernel_from_json):
        reader(data)
    if isinstance(data, dict):
        progress_from_json({**BEACON, **data})


def test_values():
    assert as_seconds(True) is None and as_seconds(float("nan")) is None and as_seconds(3) == 3.0
    assert as_int(True) is None and as_int(3) == 3 and as_int(3.0) is None
    assert as_text("") is None and as_text("abc", 2) == "ab"
    assert signal_name(-9) == "SIGKILL" and signal_name(1) is None and signal_name(-99) == "SIG99"
    assert Progress().steps is None
