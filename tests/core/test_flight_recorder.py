"""Flight-recorder comparison and the health monitor's decision, on synthetic data (no processes)."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
from helpers import FIXTURES

from elastic_diag.core.classify import straggler_warnings
from elastic_diag.core.evidence import AttemptEvidence, RankEvidence
from elastic_diag.core.flight_recorder import compare, load_dump, parse_record
from elastic_diag.core.progress import Progress


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
    f = compare(records, [0, 1, 2, 3]).divergence
    assert f is not None and (f.kind, f.ranks, f.seq) == ("desync", (2,), 6)
    assert f.sides[2] == "all_reduce sizes [[1000]] Float" and f.sides[0] == "all_reduce sizes [[1]] Float"


def test_other_sizes_never_used_by_the_peers_are_a_mismatch():
    good = schedule(4)
    odd = schedule(3) + [entry(4, 2)]
    records = {r: parse_record(r, dump(odd if r == 1 else good, 4, 3)) for r in range(4)}
    f = compare(records).divergence
    assert f is not None and (f.kind, f.ranks) == ("mismatch", (1,))


def test_a_rank_that_never_entered_the_collective_is_missing():
    records = {r: parse_record(r, dump(schedule(7), 7, 6)) for r in (0, 1, 3)}
    records[2] = parse_record(2, dump(schedule(6), 6, 6))
    f = compare(records).divergence
    assert f is not None and (f.kind, f.ranks, f.seq) == ("missing", (2,), 7)


def test_no_majority_names_nobody_and_a_missing_dump_is_reported():
    records = {r: parse_record(r, dump(schedule(3) + [entry(4, 7 if r < 2 else 9)], 4, 3)) for r in range(4)}
    cmp = compare(records, [0, 1, 2, 3, 4])
    assert cmp.divergence is not None and cmp.divergence.ranks == ()  # both sides, nobody named
    assert cmp.divergence.seq == 4 and set(cmp.divergence.sides) == {0, 1, 2, 3}
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


FR_FIXTURES = FIXTURES / "fr"


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

    a = analyze_paths([FR_FIXTURES / case])
    assert (a.diagnosis.failure_class, a.diagnosis.initiating_rank) == (cls, rank), a.diagnosis.summary


def test_analyze_reads_torch_pickle_dumps_and_reports_broken_ones(tmp_path: Path):
    from elastic_diag.offline.analyze import analyze_paths

    for src in sorted((FR_FIXTURES / "deadlock").glob("*.json")):
        trace = json.loads(src.read_text())["trace"]
        for e in trace["entries"]:
            e["process_group"] = tuple(e["process_group"])
        rank = src.stem.rsplit("_", 1)[1]
        (tmp_path / f"nccl_trace_rank_{rank}").write_bytes(pickle.dumps(trace))  # torch's default dump name
    (tmp_path / "fr_trace_rank_9.json").write_text('{"entries": [{"collective_seq_id": 1,')  # truncated
    a = analyze_paths([tmp_path])
    assert (a.diagnosis.failure_class, a.diagnosis.initiating_rank) == ("hang", 2)
    assert any("fr_trace_rank_9.json" in s and "not a usable flight-recorder dump" in s for s in a.skipped)


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
                                  progress=Progress(steps=steps, step_durations=(0.35,) * steps)))  # fmt: skip
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
    assert compare(records, [0, 1, 2]).divergence is None


def test_a_scatter_whose_output_differs_is_a_mismatch():
    records = {r: parse_record(r, dump([_collective(1, "scatter", [[3, 4]] if r == 0 else [], [[5 if r == 2 else 4]])],
                                       1, 0)) for r in range(3)}  # fmt: skip
    f = compare(records, [0, 1, 2]).divergence
    assert f is not None and (f.kind, f.ranks) == ("mismatch", (2,))


def test_the_aborted_receiver_breaks_a_one_against_one_tie():
    """3 ranks, rank 0 aborted receiving rank 2's bigger all_gather chunk (no record): ranks 1 and 2
    disagree; the receiver had the smaller side, so rank 2 is the odd one."""
    n = {1: 4, 2: 5}
    records = {r: parse_record(r, dump([_collective(1, "all_gather", [[n[r]]], [[3, n[r]]])], 1, 1)) for r in (1, 2)}
    assert compare(records, [0, 1, 2]).divergence.ranks == ()  # without knowing of the receiver: a tie
    f = compare(records, [0, 1, 2], receivers=[0]).divergence
    assert f is not None and (f.kind, f.ranks, f.seq) == ("mismatch", (2,), 1)
    dtype = {r: parse_record(r, dump([_collective(1, "all_reduce", [[4]], [[4]], "Double" if r == 2 else "Float")],
                                     1, 1)) for r in (0, 2)}  # fmt: skip
    f = compare(dtype, [0, 1, 2], receivers=[1]).divergence
    assert f is not None and f.ranks == (2,)


def test_the_aborted_receiver_is_the_culprit_when_every_record_agrees():
    records = {r: parse_record(r, dump([_collective(1, "all_gather", [[4]], [[3, 4]])], 1, 1)) for r in (0, 1)}
    f = compare(records, [0, 1, 2], receivers=[2]).divergence
    assert f is not None and (f.kind, f.ranks) == ("mismatch", (2,))
    assert "smaller tensor" in f.sides[2]


def test_the_one_rank_every_receiver_got_too_much_from():
    records = {2: parse_record(2, dump([_collective(1, "broadcast", [[5]], [[5]])], 1, 1))}
    f = compare(records, [0, 1, 2], receivers=[0, 1]).divergence
    assert f is not None and (f.kind, f.ranks) == ("mismatch", (2,))
    assert compare(records, [0, 1, 2], receivers=[0]).divergence is None  # one receiver, one record: who knows


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
    f = compare(records, [0, 1, 2]).divergence
    assert f is not None and (f.kind, f.ranks, f.seq) == ("mismatch", (2,), 4)
    other_op = {r: parse_record(r, dump([_collective(1, "barrier" if r == 1 else "all_reduce", [[1]], [[1]])], 1, 0))
                for r in range(3)}  # fmt: skip
    assert compare(other_op).divergence.kind == "desync"
