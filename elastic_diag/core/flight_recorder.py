"""Flight-recorder dumps of every rank, compared: where the collective schedules part.

Pure (no torch). Reads torch's flight-recorder JSON (``_dump_fr_trace_json``, version 2.x), the
same wrapped in elastic_diag's ``fr_trace.json``, or torch's pickle dumps through an unpickler that
only builds plain containers. Robust to what torch 2.13 gets wrong: gloo's ``pg_config`` (empty
names, ``'[]'`` ranks) is never used; groups are keyed by the entries' own ``process_group``.

For one attempt, :func:`compare` looks at each process group's collectives by sequence number:

* the first sequence number where the ranks disagree on the op, the sizes or the dtypes: the rank
  (or ranks) in the minority is where the schedules part. It is ``collective_desync`` when what the
  minority issued there is a collective the majority also issues elsewhere in its schedule (a
  collective skipped or added), ``collective_mismatch`` when it is not (a shape, dtype or op that
  the others never use);
* otherwise, a collective the others entered and never completed while one rank never entered it:
  that rank is missing from it (``missing``).

Dumps can be truncated, of another version, or absent for a rank that died by a signal; what
cannot be read is reported in ``problems`` and the rest is still compared.
"""

from __future__ import annotations

import io
import json
import pickle
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from elastic_diag.core.values import as_int

MAX_ENTRIES = 20_000


# Collectives whose arguments differ by rank in a correct program: the root of a scatter passes the
# list its peers do not (they pass none), the root of a gather receives the list; an all_to_all's
# splits are uneven by design (MoE routing). Measured on torch 2.13 gloo (docs/attribution.md).
_BY_OUTPUT = ("scatter",)
_SIZES_VARY = ("all_to_all", "alltoall", "alltoall_base", "all_to_all_single")
_DTYPE_BYTES = {"Float": 4, "Double": 8, "Half": 2, "BFloat16": 2, "Int": 4, "Long": 8, "Short": 2, "Byte": 1,
                "Char": 1, "Bool": 1, "ComplexFloat": 8, "ComplexDouble": 16}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Collective:
    seq: int
    op: str
    sizes: str  # input sizes, as text: "[[1]]"
    dtypes: str
    time_ns: int | None
    out_sizes: str = ""
    out_dtypes: str = ""

    @property
    def shape(self) -> tuple[str, str, str]:
        """What every rank must agree on: the op and the sizes and dtypes every rank passes."""
        if self.op in _BY_OUTPUT:
            return (self.op, self.out_sizes, self.out_dtypes)
        if self.op in _SIZES_VARY:
            return (self.op, "", self.dtypes)
        return (self.op, self.sizes, self.dtypes)

    def describe(self) -> str:
        if self.op in _BY_OUTPUT:
            return f"{self.op} output sizes {self.out_sizes} {self.out_dtypes}"
        return f"{self.op} sizes {self.sizes} {self.dtypes}"

    def nbytes(self) -> int | None:
        """The bytes of what it passes (its comparable sizes), when the sizes and dtypes can be read."""
        sizes, dtypes = (self.out_sizes, self.out_dtypes) if self.op in _BY_OUTPUT else (self.sizes, self.dtypes)
        try:
            shapes = json.loads(sizes)
        except ValueError:
            return None
        names = [d for d in dtypes.split(",") if d]
        if not isinstance(shapes, list) or len(names) != len(shapes):
            return None
        total = 0
        for dims, name in zip(shapes, names, strict=True):
            if not isinstance(dims, list) or name not in _DTYPE_BYTES:
                return None
            n = 1
            for d in dims:
                if as_int(d) is None or d < 0:
                    return None  # a negative or 400-digit size is junk, not a size
                n *= d
            total += n * _DTYPE_BYTES[name]
        return total


@dataclass(frozen=True, slots=True)
class RankRecord:
    rank: int
    groups: dict[str, dict[int, Collective]]  # process group -> seq -> collective
    status: dict[str, tuple[int, int]]  # process group id -> (last enqueued, last completed)
    version: str | None = None
    reason: str | None = None


@dataclass(frozen=True, slots=True)
class Divergence:
    """Where the ranks' collective schedules part: the first collective one rank issued differently
    (``desync``: another op; ``mismatch``: other sizes, dtypes or op), or one the peers wait in that a rank
    never entered (``missing``)."""

    kind: str  # "desync" | "mismatch" | "missing"
    ranks: tuple[int, ...]  # where the schedules part (the minority), or the ranks missing
    group: str
    seq: int
    sides: dict[int, str]  # rank -> what it issued at that sequence number ("-" for nothing)
    summary: str


@dataclass(slots=True)
class Comparison:
    divergence: Divergence | None = None
    lags: dict[int, float] = field(default_factory=dict)  # rank -> median lateness entering collectives, s
    problems: list[str] = field(default_factory=list)


class _SafeUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a flight-recorder dump")


def load_dump(raw: bytes) -> dict[str, Any]:
    """One dump file's content as a dict (JSON, elastic_diag's wrapper, or a plain-data pickle). A garbled or
    hostile file raises one of ``layout.FR_ERRORS`` (RecursionError for nesting deeper than Python's stack)."""
    text = raw.lstrip()
    data = json.loads(raw) if text[:1] == b"{" else _SafeUnpickler(io.BytesIO(raw)).load()
    if not isinstance(data, dict):
        raise ValueError("not a flight-recorder dump (no top-level object)")
    if isinstance(data.get("trace"), dict):
        inner = dict(data["trace"])
        inner.setdefault("_reason", data.get("reason"))
        data = inner
    if "entries" not in data and "pg_status" not in data:
        raise ValueError("not a flight-recorder dump (no entries, no pg_status)")
    return data


def _group_key(entry: dict[str, Any]) -> str:
    pg = entry.get("process_group")
    if isinstance(pg, list | tuple) and pg:
        return str(pg[1] if len(pg) > 1 and pg[1] else pg[0])
    return str(entry.get("pg_id", "?"))


def parse_record(rank: int, data: dict[str, Any]) -> RankRecord:
    groups: dict[str, dict[int, Collective]] = {}
    entries = data.get("entries") or []
    if not isinstance(entries, list):
        entries = []
    for e in entries[-MAX_ENTRIES:]:
        if not isinstance(e, dict) or e.get("is_p2p"):
            continue
        seq = as_int(e.get("collective_seq_id"))
        if seq is None or seq <= 0:
            continue
        t = as_int(e.get("time_created_ns"))
        groups.setdefault(_group_key(e), {})[seq] = Collective(
            seq=seq,
            op=str(e.get("profiling_name") or "?").split(":")[-1],
            sizes=json.dumps(e.get("input_sizes"), separators=(",", ":")),
            dtypes=",".join(str(d) for d in e.get("input_dtypes") or []),
            time_ns=t if t is not None and t >= 0 else None,
            out_sizes=json.dumps(e.get("output_sizes"), separators=(",", ":")),
            out_dtypes=",".join(str(d) for d in e.get("output_dtypes") or []),
        )
    status: dict[str, tuple[int, int]] = {}
    pg_status = data.get("pg_status")
    for pg, st in pg_status.items() if isinstance(pg_status, dict) else ():
        if isinstance(st, dict):
            enqueued, completed = (_seq_of(st.get(k, -1)) for k in ("last_enqueued_collective",
                                                                    "last_completed_collective"))  # fmt: skip
            if enqueued is not None and completed is not None:
                status[str(pg)] = (enqueued, completed)
    reason = data.get("_reason")
    return RankRecord(rank=rank, groups=groups, status=status, version=str(data.get("version")),
                      reason=str(reason) if reason else None)  # fmt: skip


def _seq_of(value: Any) -> int | None:
    """A sequence number of ``pg_status`` (torch writes ints; -1 for none), also as a string or a float; None for
    junk (infinite, NaN, 400 digits, a list)."""
    if isinstance(value, str) and value.lstrip("-").isdigit() and len(value) <= 19:
        return int(value)
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**63:
        return int(value)
    return as_int(value)


def _join(ranks: list[int] | tuple[int, ...]) -> str:
    return ", ".join(str(r) for r in sorted(ranks))


def compare(
    records: dict[int, RankRecord], expected: list[int] | None = None, receivers: Collection[int] = ()
) -> Comparison:
    """Compare the ranks' schedules; ``expected``: every rank of the attempt (to name missing dumps).

    ``receivers``: ranks without a record that gloo aborted because they RECEIVED more bytes than their
    own tensor holds (``op.preamble.length <= op.nbytes``; the abort kills them before any dump). Each
    one had the smaller side of the collective that failed: it breaks a tie between the records (1 vs 1
    with 3 ranks), and when every record agrees it is itself the rank whose tensor differed. When every
    rank but one is such a receiver, the one left sent them more than they hold.
    """
    out = Comparison()
    absent = [r for r in expected if r not in records] if expected is not None else []
    if absent:
        out.problems.append(f"no flight-recorder dump from rank(s) {_join(absent)}")
    receivers = [r for r in receivers if r not in records]
    if len(records) < 2:
        if len(records) == 1 and receivers and expected is not None and len(receivers) == len(expected) - 1:
            # every rank but one aborted receiving too much: the one left sent it; with two ranks, one
            # against one: both sides, nobody named
            out.divergence = _sender_of_too_much(records, receivers, name=len(receivers) >= 2)
        return out
    group_names = sorted({g for rec in records.values() for g in rec.groups})
    ties: list[Divergence] = []
    for group in group_names:
        divergence = _first_divergence(group, records, receivers, ties)
        if divergence is not None:
            out.divergence = divergence
            break
    if out.divergence is None and len(receivers) == 1 and absent == receivers:
        out.divergence = _receiver_parted(records, receivers[0])
    if out.divergence is None:
        for group in group_names:
            divergence = _missing_from_collective(group, records)
            if divergence is not None:
                out.divergence = divergence
                break
    if out.divergence is None and ties:
        out.divergence = ties[0]
    out.lags = lateness(records)
    return out


def _last_common(records: dict[int, RankRecord]) -> tuple[str, Collective] | None:
    """The last collective that carries data (not a barrier) of the first group every record holds,
    when all agree on it: the one a receiver of too much data can have died in."""
    for group in sorted({g for rec in records.values() for g in rec.groups}):
        tops = {r: max(rec.groups[group]) for r, rec in records.items() if rec.groups.get(group)}
        if len(tops) != len(records) or len(set(tops.values())) != 1:
            continue
        first = next(iter(records.values())).groups[group]
        for seq in sorted((q for q in first if q <= next(iter(tops.values()))), reverse=True)[:3]:
            if first[seq].op == "barrier":
                continue
            shapes = {rec.groups[group].get(seq, first[seq]).shape for rec in records.values()}
            if len(shapes) == 1 and all(seq in rec.groups[group] for rec in records.values()):
                return group, first[seq]
            break
    return None


def _receiver_parted(records: dict[int, RankRecord], receiver: int) -> Divergence | None:
    """Every record agrees; the one rank without a record aborted receiving more than its tensor holds:
    its own tensor was the smaller, the odd one."""
    common = _last_common(records)
    if common is None:
        return None
    group, c = common
    sides = {r: c.describe() for r in sorted(records)}
    sides[receiver] = f"{c.op} with a smaller tensor (it aborted receiving more bytes than it holds; no record)"
    summary = (
        f"process group {group}, collective #{c.seq} ({c.describe()}): rank(s) {_join(sorted(records))} agree; rank "
        f"{receiver} aborted receiving more bytes than its own tensor holds, so its tensor was smaller than theirs"
    )
    return Divergence(kind="mismatch", ranks=(receiver,), group=group, seq=c.seq, sides=dict(sorted(sides.items())),
                   summary=summary)  # fmt: skip


def _sender_of_too_much(records: dict[int, RankRecord], receivers: list[int], name: bool = True) -> Divergence | None:
    """Every rank but one aborted receiving more bytes than it holds: the one left sent them (``name``:
    with two ranks, one against one, it is named as a side only)."""
    ((rank, rec),) = records.items()
    for group in sorted(rec.groups):
        if not rec.groups[group]:
            continue
        c = rec.groups[group][max(rec.groups[group])]
        sides = {rank: c.describe(), **{r: f"{c.op} with a smaller tensor (aborted receiving it; no record)"
                                        for r in receivers}}  # fmt: skip
        summary = (f"process group {group}, collective #{c.seq} ({c.describe()}): rank(s) {_join(receivers)} aborted "
                   f"receiving more bytes than their tensors hold from it")  # fmt: skip
        return Divergence(kind="mismatch", ranks=(rank,) if name else (), group=group, seq=c.seq,
                       sides=dict(sorted(sides.items())), summary=summary)  # fmt: skip
    return None


def _first_divergence(
    group: str, records: dict[int, RankRecord], receivers: Collection[int] = (), ties: list[Divergence] | None = None
) -> Divergence | None:
    by_rank = {r: rec.groups.get(group, {}) for r, rec in records.items()}
    if sum(1 for s in by_rank.values() if s) < 2:
        return None
    # only the window every rank still holds (ring buffers forget the oldest entries)
    low = max(min(s) for s in by_rank.values() if s)
    seqs = sorted({q for s in by_rank.values() for q in s if q >= low})
    for seq in seqs:
        present = {r: s[seq] for r, s in by_rank.items() if seq in s}
        if len(present) < 2:
            continue
        counts = Counter(c.shape for c in present.values())
        if len(counts) < 2:
            continue
        if receivers and len(counts) == 2:
            # each receiver that aborted had the smaller side: a vote for the shape with fewer bytes
            (a, _), (b, _) = counts.most_common(2)
            sized = {shape: next(c for c in present.values() if c.shape == shape).nbytes() for shape in (a, b)}
            if all(v is not None for v in sized.values()) and sized[a] != sized[b]:
                smaller = min(sized, key=lambda shape: sized[shape] or 0)
                counts[smaller] += len(receivers)
        majority_shape, majority_n = counts.most_common(1)[0]
        if list(counts.values()).count(majority_n) > 1:
            if ties is not None and not ties:  # no majority (1 against 1): both sides, nobody named
                sides = {r: c.describe() for r, c in sorted(present.items())}
                kind = "desync" if len({c.op for c in present.values()}) > 1 else "mismatch"
                ties.append(Divergence(kind=kind, ranks=(), group=group, seq=seq,
                                    sides=sides, summary=f"process group {group}, collective #{seq}: the ranks "
                                    f"disagree ({'; '.join(f'rank {r}: {v}' for r, v in sides.items())}) and no "
                                    "majority tells which side parted"))  # fmt: skip
            continue  # no majority (e.g. 2 ranks against 2): cannot say who parted
        minority = sorted(r for r, c in present.items() if c.shape != majority_shape)
        sides = {r: c.describe() for r, c in sorted(present.items())}
        kind = _kind(present, by_rank, minority)
        desync = kind == "desync"
        what = "issued a different collective" if desync else "issued the same collective with other sizes/dtypes/op"
        example = next(c for c in present.values() if c.shape == majority_shape)
        summary = (
            f"process group {group}, collective #{seq}: rank(s) {_join(minority)} {what} "
            f"({present[minority[0]].describe()}) than the other {majority_n} rank(s) ({example.describe()})"
        )
        return Divergence(kind=kind, ranks=tuple(minority), group=group, seq=seq, sides=sides, summary=summary)
    return None


def _period(schedule: dict[int, Collective], before: int) -> int | None:
    """The smallest period (collectives per step, up to 12) that the schedule repeats with just before
    ``before``, seen over at least two periods."""
    for p in range(1, 13):
        ks = [k for k in range(before - 2 * p, before) if k - p in schedule and k in schedule]
        if len(ks) >= p and all(schedule[k].shape == schedule[k - p].shape for k in ks):
            return p
    return None


def _kind(present: dict[int, Collective], by_rank: dict[int, dict[int, Collective]], minority: list[int]) -> str:
    """``desync`` when the minority issued a collective the others issue at another place of their
    schedule (it skipped one or added one), ``mismatch`` when it issued the same collective with other
    sizes or dtypes.

    A training step repeats its collectives; with its period ``p``: the minority issuing what the
    majority issued one period earlier at the same place is the same collective with other sizes (a
    ragged last batch: the sizes changed on one side); issuing what comes next in the period is a skip,
    what came before an extra one. Without a period: desync when the shape is one the majority uses
    elsewhere, mismatch when it never uses it."""
    seq = next(iter(present.values())).seq
    majority = [r for r in present if r not in minority]
    mine = {present[r].shape for r in minority}
    if len(mine) == 1 and majority:
        shape = next(iter(mine))
        theirs = by_rank[majority[0]]
        if shape[0] != present[majority[0]].op:
            return "desync"  # another op at the same place: a different collective
        p = _period(theirs, seq)
        if p is not None:
            if seq - p in theirs and theirs[seq - p].shape == shape:
                return "mismatch"
            nearby = [theirs[k].shape for k in (seq + 1 - p, seq - 1) if k in theirs and k != seq - p]
            if p > 1 and shape in nearby:
                return "desync"
    majority_shapes = {c.shape for r, s in by_rank.items() if r not in minority for c in s.values()}
    return "desync" if all(present[r].shape in majority_shapes for r in minority) else "mismatch"


def _missing_from_collective(group: str, records: dict[int, RankRecord]) -> Divergence | None:
    last = {r: max(rec.groups.get(group, {}) or [0]) for r, rec in records.items()}
    top = max(last.values())
    if top <= 0:
        return None
    behind = sorted(r for r, q in last.items() if q < top)
    if not behind or len(behind) * 2 >= len(last):
        return None
    ahead = [r for r in last if r not in behind]
    pending = [r for r in ahead if is_pending(records[r], group, top)]
    if not pending:
        return None
    op = next(records[r].groups[group][top] for r in ahead).describe()
    sides = {r: (records[r].groups[group][top].describe() if r in ahead else "-") for r in sorted(last)}
    summary = (
        f"process group {group}, collective #{top} ({op}): rank(s) {_join(ahead)} entered it and wait; "
        f"rank(s) {_join(behind)} never entered it (last entered #{', #'.join(str(last[r]) for r in behind)})"
    )
    return Divergence(kind="missing", ranks=tuple(behind), group=group, seq=top, sides=sides, summary=summary)


def is_pending(rec: RankRecord, group: str, seq: int) -> bool:
    """Entered ``seq`` and not completed it (from pg_status when the group's id is known)."""
    if not rec.status:
        return True
    return any(enq >= seq > done for enq, done in rec.status.values())


def lateness(records: dict[int, RankRecord]) -> dict[int, float]:
    """Per rank, the mean over collectives of how late it entered them against the median rank
    (seconds): a straggler enters every collective late. Empty with fewer than 3 ranks."""
    return {r: sum(v) / len(v) for r, v in lateness_samples(records).items() if len(v) >= 5}


def lateness_samples(records: dict[int, RankRecord]) -> dict[int, list[float]]:
    """Per rank, how late it entered each collective that every rank recorded, against the median
    rank (seconds). Empty with fewer than 3 ranks (no median to speak of)."""
    if len(records) < 3:
        return {}
    lags: dict[int, list[float]] = {r: [] for r in records}
    for group in {g for rec in records.values() for g in rec.groups}:
        seqs = set.intersection(*(set(rec.groups.get(group, {})) for rec in records.values()))
        for seq in seqs:
            times = {r: rec.groups[group][seq].time_ns for r, rec in records.items()}
            if any(t is None for t in times.values()):
                continue
            mid = _median([t for t in times.values() if t is not None])
            for r, t in times.items():
                if t is not None:
                    lags[r].append((t - mid) / 1e9)
    return lags


def _median(values: list[float]) -> float:
    """The median (statistics.median, without its import: the analyzer's start-up)."""
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
