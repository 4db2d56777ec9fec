"""The steps that settle each rank's exit where no launcher watched the ranks (core/launcher_exits.py): pure,
on hand-built evidence as the log reader gives it."""

from __future__ import annotations

from elastic_diag.core.attribution import settle
from elastic_diag.core.classify import classify_attempt
from elastic_diag.core.evidence import AttemptEvidence, LauncherExit, RankEvidence
from elastic_diag.core.exceptions import ExceptionRecord
from elastic_diag.core.launcher_exits import exits_from_launchers, exits_from_lines, named_ranks_exist, watchdog_aborts
from elastic_diag.core.log_lines import evidence_line
from elastic_diag.core.taxonomy import load_taxonomy

TAX = load_taxonomy()
WATCHDOG = ("[Rank {r}] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE, NumelIn=8, "
            "NumelOut=8, Timeout(ms)=600000) ran for 600010 milliseconds before timing out.")  # fmt: skip


def logs(*ranks: RankEvidence, exits: tuple[LauncherExit, ...] = (), **kw) -> AttemptEvidence:
    return AttemptEvidence(attempt=0, ranks=ranks, source="logs", launcher_exits=exits, **kw)


def rank(r: int, *texts: str, order: int = 1, **kw) -> RankEvidence:
    lines = tuple(evidence_line(t, order=order + i, signature=TAX.match_line(t)[0][0].id) for i, t in enumerate(texts))
    return RankEvidence(rank=r, local_rank=r, node="", lines=lines, **kw)


def summary(r: int, code: int | None, **kw) -> LauncherExit:
    return LauncherExit(exit_code=code, launcher="torchrun", rank=r, **kw)


def by_rank(evidence: AttemptEvidence) -> dict[int, RankEvidence]:
    return {ev.rank: ev for ev in evidence.ranks}


def test_torchrun_summary_gives_exits_and_the_ranks_it_does_not_list_exited_0():
    got = by_rank(exits_from_launchers(logs(rank(0), rank(1), rank(2), exits=(
        summary(1, -9, pid=77, host="node-a", time=50.0),)), TAX))  # fmt: skip
    assert (got[1].exit_code, got[1].pid, got[1].node, got[1].exit_time) == (-9, 77, "node-a", 50.0)
    assert got[0].exit_code == got[2].exit_code == 0


def test_unlisted_ranks_stay_unknown_when_a_closing_signal_went_to_a_process_no_line_ties_to_a_rank():
    got = by_rank(exits_from_launchers(logs(rank(0), rank(1), exits=(summary(1, 1),), signalled_unknown=1), TAX))
    assert got[0].exit_code is None and got[1].exit_code == 1


def test_a_line_time_beats_the_summary_time_and_a_cut_entry_keeps_its_exit_unknown():
    line = evidence_line("ValueError: x", time=12.0, order=3, signature="python-exception")
    ev = RankEvidence(rank=2, local_rank=2, node="", lines=(line,))
    got = by_rank(exits_from_launchers(logs(ev, exits=(summary(2, None, time=99.0),)), TAX))
    assert got[2].exit_code is None and got[2].exit_time == 12.0


def test_deepspeed_exits_count_where_they_tell_more_than_0_or_1():
    exits = (summary(0, 1), LauncherExit(exit_code=-9, launcher="deepspeed", rank=0),
             LauncherExit(exit_code=0, launcher="deepspeed", rank=1))  # fmt: skip
    got = by_rank(exits_from_launchers(logs(rank(0), rank(1), exits=exits), TAX))
    assert got[0].exit_code == -9 and got[1].exit_code == 0


def test_torch_agents_failed_line_is_a_local_rank_taken_for_the_rank_without_a_summary():
    agent = LauncherExit(exit_code=1, launcher="torch-agent", local_rank=3, pid=9)
    got = by_rank(exits_from_launchers(logs(exits=(agent,)), TAX))
    assert (got[3].exit_code, got[3].pid) == (1, 9)
    # with a summary, the summary tells
    got = by_rank(exits_from_launchers(logs(exits=(agent, summary(1, 1))), TAX))
    assert 3 not in got


def test_a_sigtermed_rank_is_stopped_only_while_another_failed_by_itself():
    both = by_rank(exits_from_launchers(logs(rank(0), rank(1), exits=(summary(0, 1), summary(1, -15))), TAX))
    assert both[1].stopped_by_agent and not both[0].stopped_by_agent
    only = by_rank(exits_from_launchers(logs(rank(0), rank(1), exits=(summary(0, -15), summary(1, -15))), TAX))
    assert not any(ev.stopped_by_agent for ev in only.values())


def test_live_evidence_is_left_as_it_is():
    live = AttemptEvidence(attempt=0, ranks=(RankEvidence(rank=0, local_rank=0, node="a", exit_code=0),))
    assert settle(live, TAX) == live


def test_a_sigabrt_with_no_line_while_peers_timed_out_is_the_watchdogs_abort():
    evidence = logs(rank(0, WATCHDOG.format(r=0)), RankEvidence(rank=1, local_rank=1, node="", exit_code=-6))
    got = by_rank(watchdog_aborts(evidence, TAX))
    assert [line.signature for line in got[1].lines] == ["nccl-watchdog-abort"]
    alone = logs(RankEvidence(rank=1, local_rank=1, node="", exit_code=-6))
    assert watchdog_aborts(alone, TAX) == alone  # nobody waited: its abort is its own


def test_a_rank_only_its_peers_name_is_among_the_ranks():
    report = "- To our best knowledge, ranks [3, 7] are the lagging ranks that caused this timeout."
    assert sorted(by_rank(named_ranks_exist(logs(rank(0, report)), TAX))) == [0, 3, 7]
    unranked = logs(
        rank(0), unranked=(evidence_line("    [5] finished collective #9, but didn't join collective #10"),)
    )
    assert sorted(by_rank(named_ranks_exist(unranked, TAX))) == [0, 5]
    plain = logs(rank(0, "ValueError: bad"))
    assert named_ranks_exist(plain, TAX) == plain


def test_a_rank_that_printed_an_error_and_no_launcher_told_its_exit_failed():
    segv = "Fatal Python error: Segmentation fault"
    got = by_rank(exits_from_lines(logs(rank(0, "ValueError: bad", order=5), rank(1, segv)), TAX))
    assert got[0].exit_code == 1 and not got[0].exit_seen
    assert got[1].signal == "SIGSEGV"
    quiet = by_rank(exits_from_lines(logs(RankEvidence(rank=2, local_rank=2, node="")), TAX))
    assert quiet[2].exit_code is None  # nothing printed: nothing is known


def test_a_stopped_rank_with_a_failure_of_its_own_was_dying_not_stopped():
    dying = RankEvidence(rank=0, local_rank=0, node="", exit_code=-15, stopped_by_agent=True,
                         exception=ExceptionRecord(type="ValueError", message="x", traceback=""))  # fmt: skip
    waiting = rank(1, WATCHDOG.format(r=1), exit_code=-15, stopped_by_agent=True)
    got = by_rank(exits_from_lines(logs(dying, waiting), TAX))
    assert got[0].stopped_by_agent and not got[0].alive_at_decision  # failed, by the launcher's signal
    assert got[1].stopped_by_agent and got[1].alive_at_decision
    d = classify_attempt(logs(dying, waiting))
    assert (d.initiating_rank, d.failure_class) == (0, "python_exception")  # not "killed": SIGTERM was the launcher's


def test_the_steps_are_idempotent():
    evidence = logs(rank(0, "ValueError: bad"), rank(1, WATCHDOG.format(r=1)),
                    exits=(summary(1, -6), summary(0, 1)))  # fmt: skip
    once = settle(evidence, TAX)
    assert settle(once, TAX) == once


OOM = ("RuntimeError: CUDA out of memory. Tried to allocate 3.20 GiB (GPU 0; 10.76 GiB total capacity; "
       "3.22 GiB already allocated)")  # fmt: skip


def unranked(*texts: str, order: int = 1) -> tuple:
    return tuple(evidence_line(t, order=order + i, signature=sig.id) for i, t in enumerate(texts)
                 for sig, _ in TAX.match_line(t))  # fmt: skip


def test_a_traceback_with_no_prefix_is_the_one_failed_process_s():
    agent = LauncherExit(exit_code=1, launcher="torch-agent", local_rank=0, pid=45736)
    got = settle(logs(exits=(agent,), unranked=unranked(OOM)), TAX)
    (only,) = got.ranks
    assert (only.rank, only.coordinate) == (0, "local") and only.lines and not got.unranked
    # printed by each process: every rank's, not the one the launcher reaped first
    twice = settle(logs(exits=(agent,), unranked=unranked(OOM) + unranked(OOM, order=5)), TAX)
    assert twice.ranks[0].lines == () and len(twice.unranked) == len(unranked(OOM)) * 2


def test_a_row_of_torchruns_table_maps_the_agents_local_rank_to_its_global_rank():
    agent = LauncherExit(exit_code=-8, launcher="torch-agent", local_rank=1, pid=52782, rank=9)
    (only,) = exits_from_launchers(logs(exits=(agent,)), TAX).ranks
    assert (only.rank, only.exit_code, only.coordinate) == (9, -8, "global")
