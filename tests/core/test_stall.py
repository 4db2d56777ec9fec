"""A stall's record and its words (core/stall.py): the warning of one the job got over, the JSON codec, the
stall a failure came out of. Pure."""

from __future__ import annotations

import json

from elastic_diag.core.stall import StallRank, StallRecord, stall_from_json, stall_summary, stall_to_json, stall_warning

SAVE = "/job/src/checkpoint.py:88 in save"


def record(**kw) -> StallRecord:
    ranks = (
        StallRank(rank=0, local_rank=0, in_collective=False, where=SAVE, beacon=True),
        StallRank(rank=1, local_rank=1, in_collective=True, where="/job/train.py:40 in main",
                  collective="barrier #13 (process group 0)", beacon=True),
        StallRank(rank=2, local_rank=2, in_collective=True, where="/job/train.py:40 in main",
                  collective="barrier #13 (process group 0)", beacon=True),
    )  # fmt: skip
    base = {"number": 1, "node": "host-a", "since": 100.0, "detected_at": 105.3, "threshold_s": 5.0, "ranks": ranks}
    return StallRecord(**{**base, **kw})


def test_a_stall_the_job_got_over_is_a_warning_naming_the_rank_that_held_the_others_and_where():
    w = stall_warning(record(ended_at=141.2, outcome="resumed"), attempt=0)
    assert w["summary"] == "Rank 0 held its peers 41 s at checkpoint.py:88 in save; ranks 1, 2 waited in barrier."
    assert (w["class"], w["rank"], w["where"], w["duration_s"], w["stall"]) == ("stall", 0, SAVE, 41.2, 1)


def test_the_words_for_a_silent_beacon_a_skipped_snapshot_and_a_holder_on_another_node():
    quiet = StallRank(rank=0, local_rank=0, in_collective=False, where=SAVE, beacon=False)
    silent = record(ranks=(quiet, *record().ranks[1:]), ended_at=110.0)
    assert "its beacon was silent" in stall_summary(silent)
    skipped = record(snapshot="not taken: a snapshot was taken less than a minute earlier in this attempt",
                     ranks=tuple(StallRank(rank=r.rank, local_rank=r.local_rank, in_collective=r.in_collective)
                                 for r in record().ranks))  # fmt: skip
    assert stall_summary(skipped).startswith("rank 0 held its peers at least 5.3 s (no stack: not taken")
    elsewhere = record(ranks=record().ranks[1:], ended_at=130.0)
    assert stall_summary(elsewhere) == ("ranks 1, 2 waited in barrier for 30 s with no rank of node host-a outside "
                                        "it: the rank they waited for is on another node")  # fmt: skip


def test_stall_json_round_trips_and_garbage_is_no_record():
    rec = record(ended_at=141.2, outcome="resumed", took_s=0.4)
    back = stall_from_json(json.loads(json.dumps(stall_to_json(rec))))
    assert back == rec
    for bad in (None, [], {"stall": "1"}, {"stall": 1, "ranks": []}, {"stall": 1, "ranks": [], "since": "x"}):
        assert stall_from_json(bad) is None


def test_a_failure_that_began_in_a_stall_came_out_of_it_and_one_after_it_did_not():
    """The peers' collective timeout fires during the stall (t=106); the late rank then enters the collective
    (t=109: the stall 'ends'): the stall is the failure's. A failure that began after the job had got over its
    stall (t=200) is not."""
    from elastic_diag.core.stall import label_outcomes, stall_at_failure

    late = record(ended_at=109.0, outcome="resumed")
    assert stall_at_failure((late,), began=106.0) is late
    assert stall_at_failure((late,), began=200.0) is None
    assert stall_at_failure((record(),), began=None) is not None  # the hang verdict stopped it: still open
    assert stall_at_failure((record(snapshot="not taken: ..."),), began=None) is None
    (failed,) = label_outcomes((late,), failed=True, began=106.0, at=120.0)
    (got_over,) = label_outcomes((late,), failed=True, began=200.0, at=220.0)
    (last,) = label_outcomes((record(),), failed=False, began=None, at=150.0)
    assert (failed.outcome, got_over.outcome, last.outcome, last.duration_s) == ("failed", "resumed", "ended", 50.0)
