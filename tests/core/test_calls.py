"""The ranks' own records of their collective calls compared (core/calls.py): another root, a skipped
new_group, sends and receives that do not pair; calls.json read as untrusted input; the fact lines a
verdict prints read back. Pure."""

from __future__ import annotations

import pytest

from elastic_diag.core.calls import Call, RankCalls, calls_from_json, calls_from_lines, compare_calls


def rooted(*roots: int | None, op: str = "broadcast", group: str = "0") -> RankCalls:
    return RankCalls(calls=tuple(Call(op=op, group=group, root=r, where=f"/job/train.py:{40 + i} in main")
                                 for i, r in enumerate(roots)))  # fmt: skip


def test_the_rank_that_passed_another_root_is_named_with_both_sides():
    split = compare_calls({0: rooted(0, 0), 1: rooted(0, 0), 2: rooted(0, 2)})
    assert split is not None and (split.kind, split.ranks) == ("root", (2,))
    assert "rank 2 did not join the others' broadcast #2 of process group 0" in split.summary
    assert "ranks 0, 1 called broadcast with root 0; rank 2 called broadcast with root 2" in split.summary
    assert split.lines[2] == "rank 2: broadcast(root=2) #2 of process group 0 at /job/train.py:41 in main"


def test_two_sides_of_equal_size_name_no_rank():
    split = compare_calls({0: rooted(0), 1: rooted(1)})
    assert split is not None and split.ranks == () and "no majority" in split.summary


def test_calls_that_agree_or_a_record_cut_short_say_nothing():
    assert compare_calls({0: rooted(0, 1), 1: rooted(0, 1), 2: rooted(0, 1)}) is None
    cut = RankCalls(calls=rooted(0, 2).calls, complete=False)  # its first calls fell out of the ring: not aligned
    assert compare_calls({0: rooted(0, 0), 1: rooted(0, 0), 2: cut}) is None
    assert compare_calls({0: rooted(0)}) is None
    # another op at the same index is the flight recorder's to judge (a skipped or extra collective)
    assert compare_calls({0: rooted(0), 1: rooted(0), 2: rooted(0, op="reduce")}) is None


def groups(*calls: list[int]) -> RankCalls:
    return RankCalls(new_groups=tuple((tuple(c), "/job/pipe.py:20 in build") for c in calls))


def test_a_rank_that_skipped_a_new_group_call_is_named():
    split = compare_calls({0: groups([0, 1], [1, 2]), 1: groups([0, 1], [1, 2]), 2: groups([1, 2])})
    assert split is not None and (split.kind, split.ranks) == ("new_group", (2,))
    assert "rank 2 did not join the others' new_group call #1" in split.summary
    assert "ranks 0, 1 called new_group([0, 1]); rank 2 called new_group([1, 2])" in split.summary


def test_sends_and_receives_that_do_not_pair_give_both_sides():
    a = RankCalls(p2p={("send", "0", 1): 3})
    b = RankCalls(p2p={("recv", "0", 0): 3, ("send", "0", 2): 2})
    c = RankCalls(p2p={("recv", "0", 1): 3})
    split = compare_calls({0: a, 1: b, 2: c})
    assert split is not None and (split.kind, split.ranks) == ("p2p", ())
    assert "rank 1 called send(dst=2) 2 time(s), rank 2 called recv(src=1) 3 time(s)" in split.summary
    paired = RankCalls(p2p={("recv", "0", 0): 3, ("send", "0", 2): 3})
    assert compare_calls({0: a, 1: paired, 2: c}) is None


def test_the_fact_lines_a_verdict_prints_read_back_to_the_same_split():
    for by_rank in ({0: rooted(0, 0), 1: rooted(0, 0), 2: rooted(0, 2)},
                    {0: groups([0, 1], [1, 2]), 1: groups([0, 1], [1, 2]), 2: groups([1, 2])}):  # fmt: skip
        split = compare_calls(by_rank)
        assert split is not None
        back = compare_calls(calls_from_lines(list(split.lines)))
        assert back is not None and (back.kind, back.ranks) == (split.kind, split.ranks)


@pytest.mark.parametrize("bad", [
    None, [], {"calls": "x"}, {"calls": [1, "a", {"op": 3}, {"op": "broadcast"}]},
    {"calls": [], "p2p_counts": {"send|0|x": 1, "teleport|0|1": 2, "send|0|1": "many"}, "new_groups": "none"},
    {"calls": [{"op": "broadcast", "group": "0", "root": 10**40, "time": True, "where": 7}], "max_calls": -5},
])  # fmt: skip
def test_hostile_calls_json_is_skipped_or_cut_to_what_is_valid(bad):
    got = calls_from_json(bad)
    if got is None:
        return
    assert all(c.root is None or c.root < 2**31 for c in got.calls) and got.p2p == {}
    assert all(isinstance(c.where, str | None) and (c.time is None or isinstance(c.time, float)) for c in got.calls)


def test_a_cycle_of_receives_with_no_send_at_all_is_no_pairing_problem():
    cycle = {r: RankCalls(p2p={("recv", "0", (r + 1) % 3): 1}) for r in range(3)}
    assert compare_calls(cycle) is None
