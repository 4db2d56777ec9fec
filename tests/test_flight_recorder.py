"""Flight-recorder comparison and the health monitor's decision, on synthetic data (no processes)."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest

from elastic_diag.agent.health import AUTO_FLOOR_S, AUTO_START_S, HealthMonitor
from elastic_diag.core.classify import straggler_warnings
from elastic_diag.core.evidence import AttemptEvidence, RankEvidence
from elastic_diag.core.flight_recorder import compare, load_dump, parse_record


def entry(seq: int, size: int = 1, op: str = "all_reduce", t: int = 0, pg: str = "default_pg") -> dict:
    return {"collective_seq_id": seq, "profiling_name": f"gloo:{op}", "input_sizes": [[size]],
            "input_dtypes": ["Float"], "process_group": ["0", pg], "time_created_ns": t, "is_p2p": False}  # fmt: skip


def dump(entries: list[dict], enqueued: int, completed: int) -> dict:
    return {
        "version": "2.10",
        "pg_config": {"": {"name": "", "ranks": "[]"}},  # gloo's broken config: never used
        "pg_status": {"0": {"last_enqueued_collective": str(enqueued), "last_completed_collective": str(completed)}},
        "entries": entries,
    }


def schedule(n: int) -> list[dict]:
    """A step = a bucket all_reduce (1000 floats) then a metric all_reduce (1 float)."""
    return [entry(s, 1000 if s % 2 else 1) for s in range(1, n + 1)]


def test_a_skipped_collective_is_a_desync_of_the_minority_rank():
    good = schedule(6)
    skipped = schedule(5) + [entry(6, 1000)]  # its #6 is the next step's bucket: it skipped the metric
    records = {r: parse_record(r, dump(skipped if r == 2 else good, 6, 5)) for r in (0, 1, 2, 3)}
    f = compare(records, [0, 1, 2, 3]).finding
    assert f is not None and (f.kind, f.ranks, f.seq) == ("desync", (2,), 6)
    assert f.sides[2] == "all_reduce sizes [[1000]] Float" and f.sides[0] == "all_reduce sizes [[1]] Float"


def test_other_sizes_never_used_by_the_peers_are_a_mismatch():
    good = schedule(4)
    odd = schedule(3) + [entry(4, 2)]
    records = {r: parse_record(r, dump(odd if r == 1 else good, 4, 3)) for r in range(4)}
    f = compare(records).finding
    assert f is not None and (f.kind, f.ranks) == ("mismatch", (1,))


def test_a_rank_that_never_entered_the_collective_is_missing():
    records = {r: parse_record(r, dump(schedule(7), 7, 6)) for r in (0, 1, 3)}
    records[2] = parse_record(2, dump(schedule(6), 6, 6))
    f = compare(records).finding
    assert f is not None and (f.kind, f.ranks, f.seq) == ("missing", (2,), 7)


def test_no_majority_names_nobody_and_a_missing_dump_is_reported():
    records = {r: parse_record(r, dump(schedule(3) + [entry(4, 7 if r < 2 else 9)], 4, 3)) for r in range(4)}
    cmp = compare(records, [0, 1, 2, 3, 4])
    assert cmp.finding is not None and cmp.finding.ranks == ()  # both sides, nobody named
    assert cmp.finding.seq == 4 and set(cmp.finding.sides) == {0, 1, 2, 3}
    assert cmp.problems == ["no flight-recorder dump from rank(s) 4"]


def test_a_straggler_enters_collectives_late():
    records = {}
    for r in range(4):
        late = 300_000_000 if r == 3 else 0
        records[r] = parse_record(r, dump([entry(s, t=s * 10**9 + late) for s in range(1, 11)], 10, 10))
    lags = compare(records).lags
    assert lags[3] == pytest.approx(0.3) and abs(lags[0]) < 1e-9


def test_dumps_in_every_format_and_broken_ones(tmp_path: Path):
    d = dump(schedule(2), 2, 2)
    assert load_dump(json.dumps(d).encode())["entries"]
    assert load_dump(json.dumps({"reason": "exit", "trace": d}).encode())["_reason"] == "exit"
    tuples = [{**e, "process_group": ("0", "default_pg")} for e in d["entries"]]
    assert load_dump(pickle.dumps({**d, "entries": tuples}))
    with pytest.raises(ValueError):
        load_dump(json.dumps(d).encode()[:50])  # truncated
    with pytest.raises(pickle.UnpicklingError):
        load_dump(pickle.dumps(Path("/etc")))  # builds an object: refused
    with pytest.raises(ValueError):
        load_dump(b'{"something": "else"}')
    # entries of another version: unknown fields ignored, odd values skipped
    rec = parse_record(0, {"version": "9.9", "entries": [{"collective_seq_id": "x"}, entry(1), 5], "pg_status": []})
    assert list(rec.groups["default_pg"]) == [1]


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def write(path: Path, **data) -> None:
    base = {"steps": 0, "backward": 0, "heartbeats": 0, "watch": None, "pg_status": {}, "step_durations": []}
    path.write_text(json.dumps({**base, **data}))


def test_fixed_threshold_fires_only_when_no_rank_progresses(tmp_path: Path):
    clock = Clock()
    files = {r: tmp_path / f"p{r}.json" for r in range(2)}
    mon = HealthMonitor(files, 5.0, clock=clock, wall=clock)
    waiting = {"0": {"last_enqueued_collective": "5", "last_completed_collective": "4"}}
    for r in files:
        write(files[r], steps=1, pg_status=waiting if r == 1 else {})  # rank 1 waits in a collective
    assert mon.check() is None
    clock.t += 4
    write(files[0], steps=2)  # rank 0 progresses: no alarm
    assert mon.check() is None
    clock.t += 4.9
    assert mon.check() is None
    clock.t += 0.2
    alarm = mon.check()
    assert alarm is not None and alarm.stalled_s == pytest.approx(5.1) and alarm.reason == "--diag-hang-timeout"


def test_automatic_threshold_grows_with_the_step_time_and_waits_for_warmup(tmp_path: Path):
    clock = Clock()
    f = {0: tmp_path / "p.json"}
    mon = HealthMonitor(f, None, clock=clock, wall=clock)
    write(f[0], steps=1, step_durations=[])
    mon.check()
    assert mon.threshold() == AUTO_START_S  # before warm-up: slow first steps raise nothing
    write(f[0], steps=10, step_durations=[0.5] * 9)
    mon.check()
    assert mon.threshold() == AUTO_FLOOR_S
    write(f[0], steps=20, step_durations=[30.0] * 19)
    mon.check()
    assert mon.threshold() == 300.0


def test_no_rank_waiting_in_a_collective_or_only_exited_ranks_is_never_a_hang(tmp_path: Path):
    """Every rank busy outside collectives (a long checkpoint save, an evaluation) is not a hang; nor are
    ranks whose process already exited (the end of a healthy run)."""
    clock = Clock()
    files = {r: tmp_path / f"q{r}.json" for r in range(2)}
    exited: set[int] = set()
    mon = HealthMonitor(files, 5.0, clock=clock, wall=clock, exited=lambda: exited)
    for r in files:
        write(files[r], steps=3)
    mon.check()
    clock.t += 60
    assert mon.check() is None
    waiting = {"0": {"last_enqueued_collective": "9", "last_completed_collective": "8"}}
    write(files[1], steps=3, pg_status=waiting)
    exited.update({0, 1})
    clock.t += 60
    assert mon.check() is None
    exited.discard(1)
    clock.t += 10
    assert mon.check() is not None


def test_no_training_activity_is_never_a_hang(tmp_path: Path):
    clock = Clock()
    f = {0: tmp_path / "p.json"}
    mon = HealthMonitor(f, 1.0, clock=clock, wall=clock)
    write(f[0])  # a script with no process group, no optimizer, no heartbeat
    mon.check()
    clock.t += 3600
    assert mon.check() is None
    (f[0]).write_text("{garbled")
    assert mon.check() is None


def test_a_watch_past_its_timeout_names_its_rank(tmp_path: Path):
    clock = Clock()
    files = {r: tmp_path / f"p{r}.json" for r in range(2)}
    mon = HealthMonitor(files, 600.0, clock=clock, wall=clock)
    write(files[0], heartbeats=1)
    write(files[1], heartbeats=1, watch=["eval", clock.t, 2.0])
    assert mon.check() is None
    clock.t += 2.5
    alarm = mon.check()
    assert alarm is not None and alarm.rank == 1 and "watch('eval')" in alarm.reason


def test_the_public_api_is_a_no_op_outside_elastic_diag():
    import elastic_diag

    elastic_diag.heartbeat()
    with elastic_diag.watch("step", timeout=1.0):
        pass


FIXTURES = Path(__file__).parent / "fixtures" / "fr"


@pytest.mark.parametrize(
    "case, cls, rank",
    [
        ("shape-mismatch", "collective_mismatch", 2),
        ("skip-collective", "collective_desync", 2),
        ("deadlock", "hang", 2),
    ],
)
def test_analyze_reads_a_folder_of_flight_recorder_dumps(case, cls, rank):
    """Dumps taken by elastic_diag on real 4-rank gloo runs (skip-collective: rank 1 aborted and left none)."""
    from elastic_diag.offline.analyze import analyze_paths

    a = analyze_paths([FIXTURES / case])
    assert (a.diagnosis.failure_class, a.diagnosis.initiating_rank) == (cls, rank), a.diagnosis.summary


def test_analyze_reads_torch_pickle_dumps_and_reports_broken_ones(tmp_path: Path):
    from elastic_diag.offline.analyze import analyze_paths

    for src in sorted((FIXTURES / "deadlock").glob("*.json")):
        trace = json.loads(src.read_text())["trace"]
        for e in trace["entries"]:
            e["process_group"] = tuple(e["process_group"])
        rank = src.stem.rsplit("_", 1)[1]
        (tmp_path / f"nccl_trace_rank_{rank}").write_bytes(pickle.dumps(trace))  # torch's default dump name
    (tmp_path / "fr_trace_rank_9.json").write_text('{"entries": [{"collective_seq_id": 1,')  # truncated
    a = analyze_paths([tmp_path])
    assert (a.diagnosis.failure_class, a.diagnosis.initiating_rank) == ("hang", 2)
    assert any("fr_trace_rank_9.json" in s and "not a usable flight-recorder dump" in s for s in a.skipped)


def test_a_rank_that_answers_nothing_costs_at_most_the_timeout(tmp_path: Path):
    """No beacon and the dump signal ignored: request_dumps returns within its bound, with no stack."""
    import subprocess
    import sys
    import time

    from elastic_diag.agent.dumps import request_dumps
    from elastic_diag.layout import RankLayout

    code = "import signal, time; signal.signal(signal.SIGURG, signal.SIG_IGN); print('ready', flush=True); "
    code += "time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        layout = RankLayout(rank=0, local_rank=0, dir=tmp_path)
        t0 = time.monotonic()
        stacks, answered = request_dumps({0: (proc.pid, layout)}, 0.5, "req-1")
        took = time.monotonic() - t0
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    assert answered == set() and stacks == {0: ""}
    assert took < 1.5  # the beacon's wait and the signal's wait, each bounded by the timeout


def test_a_huge_stack_file_is_read_bounded(tmp_path: Path):
    from elastic_diag.layout import STACK_BYTES, read_stack_since

    frames = '  File "x.py", line 1 in f\n' * 400_000
    (tmp_path / "stacks.txt").write_text("Thread 0x1 (most recent call first):\n" + frames)
    text = read_stack_since(tmp_path, 0)
    assert len(text.encode()) <= STACK_BYTES


def _fsdp_like(late_steps: set[int], steps: int = 20, per_step: int = 10, lag_ns: int = 300_000_000) -> AttemptEvidence:
    """4 ranks, ``per_step`` collectives a step (FSDP: all-gathers, reduce-scatters, a metric); rank 3
    enters the first collective of each step in ``late_steps`` ``lag_ns`` late (its slow work comes
    just before it), and every later one on time (the others waited for it there)."""
    ranks = []
    for r in range(4):
        entries = []
        for s in range(1, steps * per_step + 1):
            step, first = (s - 1) // per_step, (s - 1) % per_step == 0
            late = lag_ns if r == 3 and first and step in late_steps else 0
            entries.append(entry(s, t=s * 10**8 + late + r * 1000))
        ranks.append(RankEvidence(rank=r, local_rank=r, node="n", flight_record=parse_record(r, dump(entries, 0, 0)),
                                  steps=steps, step_durations=(0.35,) * steps))  # fmt: skip
    return AttemptEvidence(attempt=0, ranks=tuple(ranks))


def test_a_straggler_late_at_one_collective_a_step_is_found_and_a_one_off_pause_is_not():
    every_step = straggler_warnings(_fsdp_like(set(range(20))))
    assert [(w["rank"], round(float(w["lag_s"]), 2)) for w in every_step] == [(3, 0.3)]  # type: ignore[arg-type]
    assert straggler_warnings(_fsdp_like({7})) == []  # one checkpoint save is not a straggler
    assert straggler_warnings(_fsdp_like(set(range(0, 20, 4)))) == []  # late in 5 of 20 steps: not consistent


def _collective(seq: int, op: str, ins: list, outs: list, dtype: str = "Float") -> dict:
    """An entry as torch 2.13's gloo records it (measured: the root of a scatter passes the list and the
    others pass nothing, with no input dtype)."""
    return {"collective_seq_id": seq, "profiling_name": f"gloo:{op}", "input_sizes": ins, "output_sizes": outs,
            "input_dtypes": [dtype] * len(ins), "output_dtypes": [dtype] * len(outs), "process_group": ["0", "pg"],
            "is_p2p": False}  # fmt: skip


@pytest.mark.parametrize("op, root, other", [
    ("scatter", ([[3, 4]], [[4]]), ([], [[4]])),
    ("gather", ([[4]], [[3, 4]]), ([[4]], [])),
    ("all_to_all", ([[6]], [[3]]), ([[6]], [[9]])),
])  # fmt: skip
def test_collectives_whose_arguments_differ_by_design_are_no_mismatch(op, root, other):
    records = {
        r: parse_record(
            r,
            dump([_collective(1, "all_reduce", [[4]], [[4]]), _collective(2, op, *(root if r == 0 else other))], 2, 2),
        )
        for r in range(3)
    }
    assert compare(records, [0, 1, 2]).finding is None


def test_a_scatter_whose_output_differs_is_a_mismatch():
    records = {r: parse_record(r, dump([_collective(1, "scatter", [[3, 4]] if r == 0 else [], [[5 if r == 2 else 4]])],
                                       1, 0)) for r in range(3)}  # fmt: skip
    f = compare(records, [0, 1, 2]).finding
    assert f is not None and (f.kind, f.ranks) == ("mismatch", (2,))


def test_the_aborted_receiver_breaks_a_one_against_one_tie():
    """3 ranks, rank 0 aborted receiving rank 2's bigger all_gather chunk (no record): ranks 1 and 2
    disagree; the receiver had the smaller side, so rank 2 is the odd one."""
    n = {1: 4, 2: 5}
    records = {r: parse_record(r, dump([_collective(1, "all_gather", [[n[r]]], [[3, n[r]]])], 1, 1)) for r in (1, 2)}
    assert compare(records, [0, 1, 2]).finding.ranks == ()  # without knowing of the receiver: a tie
    f = compare(records, [0, 1, 2], receivers=[0]).finding
    assert f is not None and (f.kind, f.ranks, f.seq) == ("mismatch", (2,), 1)
    dtype = {r: parse_record(r, dump([_collective(1, "all_reduce", [[4]], [[4]], "Double" if r == 2 else "Float")],
                                     1, 1)) for r in (0, 2)}  # fmt: skip
    f = compare(dtype, [0, 1, 2], receivers=[1]).finding
    assert f is not None and f.ranks == (2,)


def test_the_aborted_receiver_is_the_culprit_when_every_record_agrees():
    records = {r: parse_record(r, dump([_collective(1, "all_gather", [[4]], [[3, 4]])], 1, 1)) for r in (0, 1)}
    f = compare(records, [0, 1, 2], receivers=[2]).finding
    assert f is not None and (f.kind, f.ranks) == ("mismatch", (2,))
    assert "smaller tensor" in f.sides[2]


def test_the_one_rank_every_receiver_got_too_much_from():
    records = {2: parse_record(2, dump([_collective(1, "broadcast", [[5]], [[5]])], 1, 1))}
    f = compare(records, [0, 1, 2], receivers=[0, 1]).finding
    assert f is not None and (f.kind, f.ranks) == ("mismatch", (2,))
    assert compare(records, [0, 1, 2], receivers=[0]).finding is None  # one receiver, one record: who knows


def test_a_ragged_last_batch_is_a_mismatch_not_a_desync():
    """One all_gather a step; the last batch is shorter on one rank: the same collective with other
    sizes (it used that size every step before), not a skipped or an extra one."""
    records = {
        r: parse_record(
            r,
            dump(
                [_collective(s, "all_gather", [[3 if (r == 2 and s == 4) else 4]], [[3, 4]]) for s in range(1, 5)], 4, 3
            ),
        )
        for r in range(3)
    }
    f = compare(records, [0, 1, 2]).finding
    assert f is not None and (f.kind, f.ranks, f.seq) == ("mismatch", (2,), 4)
    other_op = {r: parse_record(r, dump([_collective(1, "barrier" if r == 1 else "all_reduce", [[1]], [[1]])], 1, 0))
                for r in range(3)}  # fmt: skip
    assert compare(other_op).finding.kind == "desync"
