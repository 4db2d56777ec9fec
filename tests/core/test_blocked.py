"""What a rank outside any collective waits on (core/blocked.py): the kernel's wait functions by kind, the
words, the rank the chain of waits leads to, and stall.json's ``blocked`` read as untrusted input. Pure."""

from __future__ import annotations

import json

import pytest

from elastic_diag.core.blocked import (
    Blocked,
    blocked_from_json,
    blocked_to_json,
    holding_rank,
    process_waits,
    wait_kind,
)
from elastic_diag.core.stall import StallRank, StallRecord, stall_from_json, stall_summary, stall_to_json


@pytest.mark.parametrize(("state", "wchan", "kind"), [
    ("S", "locks_lock_inode_wait", "lock"), ("S", "do_wait", "child"), ("S", "wait_for_partner", "fifo"),
    ("S", "anon_pipe_read", "pipe"), ("S", "pipe_read", "pipe"), ("S", "wait_woken", "socket"),
    ("S", "futex_wait_queue", "futex"), ("S", "futex_do_wait", "futex"), ("S", "hrtimer_nanosleep", "sleep"),
    ("S", "do_epoll_wait", "poll"), ("D", "nfs_wait_bit_killable", "disk"), ("R", None, "running"),
    ("S", None, "unknown"), ("S", "some_new_kernel_function", "unknown"),
])  # fmt: skip
def test_the_kernel_wait_function_tells_what_the_thread_waits_for(state, wchan, kind):
    assert wait_kind(state, wchan) == kind


def test_a_child_blocked_writing_its_output_is_the_classic_pipe_deadlock():
    assert process_waits("S", "anon_pipe_write") == "blocked writing to a pipe that nobody read (anon_pipe_write)"
    assert process_waits("D", "nfs_wait") == "in uninterruptible I/O (state D, nfs_wait)"


def lock_on(holder: int | None) -> Blocked:
    return Blocked(state="S", wchan="locks_lock_inode_wait", waits_for="lock", what="/cache/.fetch.lock",
                   holder_pid=4100 if holder is not None else None, holder_rank=holder)  # fmt: skip


CHILD = Blocked(state="S", wchan="do_wait", waits_for="child", what="ffmpeg -i clip.mp4", holder_pid=4242,
                holder_rank=2, holder_waits="sleeping (hrtimer_nanosleep)")  # fmt: skip


def test_the_chain_of_waits_leads_to_the_rank_holding_the_others():
    assert holding_rank({1: lock_on(2), 2: CHILD}) == 2
    assert holding_rank({1: lock_on(3), 3: lock_on(2), 2: CHILD}) == 2  # 1 waits on 3, which waits on 2
    assert holding_rank({2: CHILD}) is None  # its own child: nobody waits on another rank
    assert holding_rank({1: lock_on(2), 2: lock_on(1)}) is None  # a deadlock between two ranks names neither
    assert holding_rank({1: lock_on(2), 3: lock_on(4)}) is None  # two chains, two ends
    assert holding_rank({}) is None


def test_the_words_name_the_holder_and_what_it_waits_on():
    assert lock_on(2).describe(1) == "waited for the lock on /cache/.fetch.lock held by rank 2 (pid 4100)"
    assert CHILD.describe(2) == ("waited for its child process 4242 (ffmpeg -i clip.mp4), which was itself "
                                 "sleeping (hrtimer_nanosleep)")  # fmt: skip
    foreign = Blocked(state="S", wchan="anon_pipe_read", waits_for="pipe", what="fd 5, pipe:[77]", holder_pid=9)
    assert foreign.describe(0) == (
        "was blocked on a pipe (fd 5, pipe:[77]) whose write end pid 9 (no rank of this node) held"
    )


def stall_of(blocked: dict[int, Blocked]) -> StallRecord:
    ranks = (StallRank(rank=0, local_rank=0, in_collective=True, collective="all_reduce #4 (process group 0)"),
             *(StallRank(rank=r, local_rank=r, in_collective=False, where=f"/job/data.py:{20 + r} in fetch", blocked=b)
               for r, b in blocked.items()))  # fmt: skip
    return StallRecord(number=1, node="n1", since=100.0, detected_at=102.0, threshold_s=2.0, ranks=ranks)


def test_a_stall_names_the_holder_not_the_lowest_blocked_rank():
    stall = stall_of({1: lock_on(2), 2: CHILD})
    assert stall.holder == 2 and stall.holders_first() == (2, 1)
    text = stall_summary(stall)
    assert text.startswith("rank 2 held its peers at least 2.0 s at data.py:22 in fetch (rank 2 waited for its child")
    assert "rank 1 waited for the lock on /cache/.fetch.lock held by rank 2" in text
    assert stall_from_json(json.loads(json.dumps(stall_to_json(stall)))) == stall


@pytest.mark.parametrize("bad", [
    None, [], "lock", {"waits_for": "teleport"}, {"waits_for": ["lock"]},
    {"waits_for": "lock", "holder_pid": -1, "holder_rank": 10**30, "state": "SLEEPING", "what": 5},
    {"waits_for": "lock", "holder_rank": True, "what": "x" * 100_000},
])  # fmt: skip
def test_a_hostile_blocked_record_is_dropped_or_cut(bad):
    got = blocked_from_json(bad)
    if got is None:
        return
    assert got.holder_pid is None and got.holder_rank is None and got.state is None
    assert got.what is None or len(got.what) <= 300
    assert blocked_from_json(blocked_to_json(got)) == got
